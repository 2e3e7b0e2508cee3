"""HF layout: save_pretrained folder + tokenizer + model card, loadable with load_drafter; push_to_hub."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deepspec.drafters.build import load_drafter
from deepspec.export import export_drafter, load_exported, push_to_hub
from deepspec.export.model_card import load_tau_table

CASES = {
    "dspark-markov": ("dspark", "tiny_qwen3", {"num_draft_layers": 2, "markov_rank": 8,
                                                   "calibration_temperatures": [1.0 + 0.1 * i for i in range(7)]}),
    "eagle3-reduced": ("eagle3", "tiny_llama", {"draft_vocab_size": 100, "target_layer_ids": [0, 1, 2]}),
    # not 3 fused layers: the engine layouts refuse it (their fc is 3H -> H), the hf layout holds any count
    "eagle3-two-layers": ("eagle3", "tiny_llama", {"target_layer_ids": [0, 2]}),
    "dspark-gemma3": ("dspark", "tiny_gemma3", {"num_draft_layers": 1, "markov_rank": 4, "sequential_head": "rnn"}),
}  # every kind's tiny test config round-trips through every layout it allows in tests/drafters/test_every_kind.py


@pytest.mark.float_exact
@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_export_loads_with_load_drafter_to_identical_logits(case, request, probe, tmp_path):
    kind, target_fixture, overrides = CASES[case]
    target = request.getfixturevalue(target_fixture)
    model = probe.make_drafter(kind, target, **overrides)
    expected = probe.outputs(model, target)
    out = export_drafter(model, tmp_path / "hf", "hf", target=target)
    probe.assert_same(expected, probe.outputs(load_drafter(out, target), target))
    probe.assert_same(expected, probe.outputs(load_exported(out, target), target))


def test_hf_config_records_kind_target_layers_and_calibration(tiny_qwen3, probe, tmp_path):
    temps = [1.0 + 0.1 * i for i in range(7)]
    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, calibration_temperatures=temps)
    out = export_drafter(model, tmp_path / "hf", "hf", target=tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepspec_dspark" and config["drafter_kind"] == "dspark"
    assert config["target_name"] == "tiny-random-qwen3" and config["target_revision"] == "seed0"
    assert config["target_layer_ids"] == model.config.target_layer_ids
    assert config["layer_id_convention"] == "output_of_layer"
    assert config["block_size"] == 7 and config["mask_token_id"] == model.config.mask_token_id
    assert config["calibration_temperatures"] == pytest.approx(temps)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file()
    card = (out / "README.md").read_text()
    assert "Not evaluated" in card and "No training record" in card


@pytest.mark.float_exact
@pytest.mark.parametrize("kind,overrides", [("eagle3", {"target_layer_ids": [0, 1, 2]}),
                                            ("dspark", {"num_draft_layers": 1, "markov_rank": 8}),
                                            ("dflash", {"num_draft_layers": 1})])
def test_hf_config_records_draft_vocab_buffers(tiny_llama, probe, tmp_path, kind, overrides):
    from safetensors.torch import load_file

    from deepspec.drafters.draft_vocab import build_draft_vocab

    model = probe.make_drafter(kind, tiny_llama, draft_vocab_size=50, **overrides)
    d2t, t2d = build_draft_vocab(torch.arange(tiny_llama.model.config.vocab_size) % 97, 50, always_keep=[2])
    model.set_draft_vocab(d2t, t2d)
    expected = probe.outputs(model, tiny_llama)
    out = export_drafter(model, tmp_path / "hf", "hf", target=tiny_llama)
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == 50 and config["draft_vocab_mapping"]["tensors"] == ["d2t", "t2d"]
    assert load_drafter(out, tiny_llama).config.draft_vocab_size == 50
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["d2t"], d2t) and torch.equal(tensors["t2d"], t2d)
    assert not any("lm_head" in name for name in tensors) or kind == "eagle3"  # block heads stay the target's rows
    probe.assert_same(expected, probe.outputs(load_exported(out, tiny_llama), tiny_llama))


def test_model_card_holds_the_given_tau_table_and_training_record(tiny_qwen3, probe, tmp_path):
    # The training run's layout (deepspec.training.checkpoint / log): <run>/config.yaml,
    # <run>/checkpoints/step-N/{drafter/, trainer_state.json, checksums.json}.
    from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest
    from deepspec.utils.io import atomic_write_json

    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1)
    run = tmp_path / "run"
    step_dir = run / "checkpoints" / "step-00001234"
    model.save_pretrained(step_dir / "drafter")
    (step_dir / "trainer_state.json").write_text(json.dumps({
        "step": 1234, "epoch": 2, "samples_seen": 40000, "tokens_seen": 5_000_000, "rng": {"torch": [1, 2, 3]}}))
    atomic_write_json(step_dir / MANIFEST_FILE, folder_manifest(step_dir))
    (run / "config.yaml").write_text("data:\n  cache_dir: outputs/cache/sharegpt\n  train_split: train\n"
                                     "trainer:\n  epochs: 3\n  global_batch_size: 64\n  progress_bar: true\n"
                                     "optim:\n  lr: 0.0006\n")
    results = tmp_path / "results.json"  # eval/evaluate.py's results.json (deepspec.evaluation.tables)
    results.write_text(json.dumps({
        "settings": {"target": "tiny", "temperature": 1.0, "max_new_tokens": 64,
                     "benchmarks": [{"name": "humaneval", "domain": "code"}, {"name": "gsm8k", "domain": "math"}]},
        "drafters": {"dflash": {"kind": "dflash", "benchmarks": {"gsm8k": {"tau": 4.25}, "humaneval": {"tau": 3.5}}},
                     "dspark": {"kind": "dspark", "benchmarks": {"gsm8k": {"tau": 5.125}, "humaneval": {"tau": None}}}},
        "table": {"columns": [], "rows": []}}))
    out = export_drafter(step_dir, tmp_path / "hf", "hf", target=tiny_qwen3, tau_table=results,
                         commands=["deepspec export --checkpoint ckpt --format hf --out hf"])
    card = (out / "README.md").read_text()
    assert "| drafter | humaneval | gsm8k |" in card  # the evaluation's benchmark order
    assert "| dflash | 3.50 | 4.25 |" in card and "| dspark | – | 5.12 |" in card
    assert "temperature=1.0" in card and "max_new_tokens=64" in card
    assert "| step | 1234 |" in card and "| tokens_seen | 5000000 |" in card and "rng" not in card
    assert "| data.cache_dir | outputs/cache/sharegpt |" in card and "| optim.lr | 0.0006 |" in card
    assert "| trainer.epochs | 3 |" in card and "progress_bar" not in card
    assert "deepspec export --checkpoint ckpt --format hf --out hf" in card
    assert "Not evaluated" not in card


def test_model_card_shows_the_data_settings_the_run_read(tiny_qwen3, tiny_cache, probe, tmp_path):
    """An offline run read its cache, not data.source / data.cache (left at their defaults in config.yaml): the
    card shows what the cache was built with (its meta.json, found from the run's folder for a relative
    data.cache_dir), or says it was not found; an online run shows its data.source and data.cache."""
    from deepspec.utils.checksums import MANIFEST_FILE, folder_manifest
    from deepspec.utils.io import atomic_write_json

    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1)
    project = tmp_path / "project"  # where the runs started: outputs/cache/tiny is the tiny cache
    (project / "outputs" / "cache").mkdir(parents=True)
    (project / "outputs" / "cache" / "tiny").symlink_to(tiny_cache)

    def card(name: str, data: str) -> str:
        step_dir = project / "outputs" / "runs" / name / "checkpoints" / "step-00000010"
        model.save_pretrained(step_dir / "drafter")
        atomic_write_json(step_dir / MANIFEST_FILE, folder_manifest(step_dir))
        (step_dir.parent.parent / "config.yaml").write_text(
            f"data:\n{data}  source:\n    prompts: sharegpt\n    format: chat\n  cache:\n    max_length: 2048\n"
            "    out_dir: outputs/cache/smollm2-135m\ntrainer:\n  epochs: 3\n")
        return (export_drafter(step_dir, tmp_path / name, "hf", target=tiny_qwen3) / "README.md").read_text()

    offline = card("offline", "  cache_dir: outputs/cache/tiny\n  features: offline\n")
    assert "data.source." not in offline and "data.cache." not in offline and "2048" not in offline
    assert "| data.cache_dir | outputs/cache/tiny |" in offline and "| trainer.epochs | 3 |" in offline
    assert "The cache it trained on (data.cache_dir) was built with, from " in offline
    for row in ("| data.format | chat |", "| cache.max_length | 64 |", "| cache.layer_ids | [0, 1, 2] |",
                "| cache.storage_dtype | fp32 |", "| samples | 20 |", "| data.limit | null |"):
        assert row in offline, row
    missing = card("missing", "  cache_dir: outputs/cache/gone\n")  # offline by default
    assert "data.source." not in missing and "| cache.max_length |" not in missing
    assert ("The cache it trained on (data.cache_dir=outputs/cache/gone) was not found at export time: the "
            "settings it was built with are not shown.") in missing
    online = card("online", "  cache_dir: outputs/cache/tiny\n  features: online\n")
    assert "| data.source.prompts | sharegpt |" in online and "| data.cache.max_length | 2048 |" in online
    assert "data.cache.out_dir" not in online and "The cache it trained on" not in online


def test_tau_table_accepts_other_schemas_and_rejects_bad_values(tmp_path):
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"results": [{"drafter": "a", "benchmark": "mbpp", "acceptance_length": 2.5}]}))
    assert load_tau_table(records).values == {("a", "mbpp"): 2.5}
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"tau": {"dspark": {"mt-bench": 4.0, "gsm8k": 6.0}}}))
    table = load_tau_table(good)
    assert table.drafters == ["dspark"] and table.benchmarks == ["mt-bench", "gsm8k"]
    assert table.values[("dspark", "gsm8k")] == 6.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"results": [{"drafter": "a", "benchmark": "b", "tau": "high"}]}))
    with pytest.raises(ValueError, match=r"bad\.json: results\[0\]\.tau"):
        load_tau_table(bad)
    with pytest.raises(ValueError, match="not a τ results file"):
        (tmp_path / "empty.json").write_text("{}")
        load_tau_table(tmp_path / "empty.json")


class RecordingHubApi:
    """Stand-in for huggingface_hub.HfApi: records calls, no network."""

    def __init__(self):
        self.calls = []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))


def test_push_to_hub_uploads_the_exported_folder(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1)
    out = export_drafter(model, tmp_path / "hf", "hf")
    api = RecordingHubApi()
    assert push_to_hub(out, "org/tiny-dflash", api=api) == "org/tiny-dflash"
    assert api.calls[0] == ("create_repo", {"repo_id": "org/tiny-dflash", "repo_type": "model", "private": False,
                                            "exist_ok": True})
    name, kwargs = api.calls[1]
    assert name == "upload_folder" and kwargs["folder_path"] == str(out) and kwargs["repo_id"] == "org/tiny-dflash"
    with pytest.raises(ValueError, match="repo_id"):
        push_to_hub(out, "no-org", api=api)
    with pytest.raises(FileNotFoundError, match="config.json"):
        push_to_hub(tmp_path / "missing", "org/x", api=api)


def test_export_rejects_unknown_format_and_missing_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        export_drafter(tmp_path, tmp_path / "out", "onnx")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_drafter(tmp_path / "nope", tmp_path / "out", "hf")


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
@pytest.mark.parametrize("given", ["step folder", "drafter folder"])
def test_export_of_a_damaged_checkpoint_names_the_file_from_its_checksums(tiny_qwen3, probe, tmp_path, damage, given):
    """A training checkpoint's checksums.json is checked before any file is parsed (a flipped byte in the weights
    would otherwise export a broken drafter silently, a truncated file fail in safetensors naming nothing)."""
    from deepspec.utils.checksums import folder_manifest
    from deepspec.utils.io import atomic_write_json

    step_dir = tmp_path / "run" / "checkpoints" / "step-00000003"
    probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8).save_pretrained(step_dir / "drafter")
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 3}))
    atomic_write_json(step_dir / "checksums.json", folder_manifest(step_dir))
    checkpoint = step_dir if given == "step folder" else step_dir / "drafter"
    assert export_drafter(checkpoint, tmp_path / "ok", "hf").is_dir()  # intact: exported
    weights = step_dir / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flipped byte":
        data[-5] ^= 0x20
    else:
        del data[len(data) // 2:]
    weights.write_bytes(bytes(data))
    expected = "sha256 differs" if damage == "flipped byte" else "B recorded (truncated or replaced)"
    damaged = rf"the checkpoint is damaged \({re.escape(str(weights))}: .*{re.escape(expected)}"
    with pytest.raises(ValueError, match=damaged):
        export_drafter(checkpoint, tmp_path / "hf", "hf")
    assert not (tmp_path / "hf").exists()
