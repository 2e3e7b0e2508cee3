"""A base model as the target: its tokenizer has no chat template (`tiny_base_target_dir`: tiny-random-llama saved
with the SmolLM2 tokenizer minus its template). The text format runs through every stage, each through its own
entry point (regenerate with the local backend, cache, train, calibrate, evaluate, export); a chat template given
in the target config is the other way; without either, every stage refuses at once in one line naming both."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prompts(n: int) -> list[dict]:
    """Conversations (a prefix: the first user message) and prompt records, as ShareGPT-like input mixes them."""
    records = []
    for i in range(n):
        if i % 3 == 2:
            records.append({"id": f"p{i}", "prompt": f"Chapter {i}. The river ran past the old mill and"})
        else:
            records.append({"id": f"c{i}", "conversations": [
                {"from": "human", "value": f"Story {i}: once upon a time there was a " + "very " * (i % 4) + "tall"},
                {"from": "gpt", "value": "A human-written answer the text format does not continue."}]})
    return records


def cache_overrides(base: Path, prompts_path: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["target=tiny-random-llama", f"target.name={base}", f"data.prompts={prompts_path}",
            "data.val_fraction=0.34", f"cache.out_dir={out_dir}", "cache.layer_ids=[0,1,2]",
            "cache.storage_dtype=fp32", "cache.max_length=64", "cache.batch_size=4", "cache.progress=false", *extra]


def train_overrides(base: Path, cache: Path, out_dir: Path, *extra: str) -> list[str]:
    return ["target=tiny-random-llama", f"target.name={base}", "drafter=dspark", "drafter.block_size=4",
            "drafter.markov_rank=8", "drafter.num_draft_layers=1", f"data.cache_dir={cache}",
            f"trainer.out_dir={out_dir}", "data.max_anchors_per_seq=8", "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2", "trainer.max_steps=4", "trainer.val_every=4", "trainer.save_every=100",
            "trainer.decode_eval_prompts=2", "trainer.decode_eval_max_new_tokens=8", "trainer.progress_bar=false",
            "calibration.enabled=false", "optim.lr=3e-3", "optim.warmup_fraction=0.0", "logger=jsonl", *extra]


@pytest.fixture(scope="module")
def text_run(tiny_base_target_dir, tmp_path_factory):
    """regenerate (text format, local backend) -> cache (data.format=text) -> train 4 steps."""
    from deepspec.cache.config import compose_cache_config
    from deepspec.cache.pipeline import run_cache_job
    from deepspec.data.cli import main as regenerate
    from deepspec.training import run
    from deepspec.training.config import compose_train_config

    root, base = tmp_path_factory.mktemp("text_run"), tiny_base_target_dir
    source = write_jsonl(root / "prompts.jsonl", prompts(12))
    regenerated = root / "regenerated.jsonl"
    assert regenerate(["--prompts", str(source), "--out", str(regenerated), "--target", str(base), "--format", "text",
                       "--greedy", "--max-new-tokens", "12", "--batch-size", "4"]) == 0
    cache = root / "cache"
    assert run_cache_job(compose_cache_config(cache_overrides(base, regenerated, cache, "data.format=text"))) == 0
    summary = run(compose_train_config(train_overrides(base, cache, root / "train")))
    return SimpleNamespace(root=root, base=base, source=source, regenerated=regenerated, cache=cache,
                           drafter=Path(summary["checkpoint"]) / "drafter", summary=summary)


def test_regeneration_continues_each_prefix(text_run):
    """A base model continues text: each record's prefix (a conversation's first user message, a prompt record's
    prompt) with the target's own greedy continuation, written as a prompt/completion record."""
    import torch

    from deepspec.data.rendering import leading_special_ids
    from deepspec.targets.load import load_target

    records = [json.loads(line) for line in text_run.regenerated.read_text().splitlines()]
    source = prompts(12)
    assert [r["id"] for r in records] == [s["id"] for s in source]
    for record, given in zip(records, source):
        assert set(record) == {"id", "prompt", "completion", "source", "finish_reasons"}
        assert record["prompt"] == given.get("prompt") or record["prompt"] == given["conversations"][0]["value"]
    meta = json.loads(text_run.regenerated.with_name("regenerated.jsonl.meta.json").read_text())
    assert meta["data_format"] == "text" and meta["chat_template"] is None
    # The first continuation, by hand: greedy from the prefix's tokens, up to 12 tokens or the end of sequence.
    target = load_target(str(text_run.base), device="cpu")
    tokenizer = target.tokenizer
    ids = leading_special_ids(tokenizer) + tokenizer(records[0]["prompt"], add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(12):
            token = int(target.model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    assert records[0]["completion"] == tokenizer.decode(new, skip_special_tokens=False)


def test_the_cache_learns_the_completions_and_records_the_format(text_run):
    from deepspec.cache import CacheReader
    from deepspec.cache.format import read_meta
    from deepspec.targets.load import load_tokenizer

    meta = read_meta(text_run.cache)
    assert meta.data_format == "text" and meta.chat_template is None and meta.counts["samples"] == 12
    reader = CacheReader(text_run.cache)
    tokenizer = load_tokenizer(str(text_run.base))
    by_id = {json.loads(line)["id"]: json.loads(line) for line in text_run.regenerated.read_text().splitlines()}
    for i, sample in enumerate(reader.samples):
        record = by_id[sample["id"]]
        prompt = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
        item = reader[i]
        assert item.input_ids.tolist() == (prompt + completion)[:64]  # this tokenizer adds no BOS
        assert item.loss_mask.tolist() == ([False] * len(prompt) + [True] * len(completion))[:64]


def test_training_records_the_format_and_decodes_at_validation(text_run):
    """The drafter's config says how its data were rendered; decoding at validation stops at the end of sequence
    (the text format has no end-of-turn token), on the prompts of the validation samples."""
    config = json.loads((text_run.drafter / "config.json").read_text())
    assert config["data_format"] == "text" and config["chat_template"] is None
    validation = text_run.summary["validation"]
    assert validation["decode_num_prompts"] == 2 and validation["tau_decoded_T0"] >= 1.0


def test_calibrate_evaluate_and_export_the_text_drafter(text_run):
    from deepspec.calibration.cli import main as calibrate
    from deepspec.cli import main as deepspec
    from deepspec.evaluation.cli import main as evaluate

    root, base = text_run.root, str(text_run.base)
    assert calibrate(["--drafter", str(text_run.drafter), "--cache", str(text_run.cache), "--max-prompts", "4",
                      "--max-new-tokens", "12", "--min-samples", "1", "--holdout", "0", "--out",
                      str(root / "calibration")]) == 0
    assert json.loads((text_run.drafter / "config.json").read_text())["calibration_temperatures"]

    bench = write_jsonl(root / "story.jsonl", [{"turns": ["The castle on the hill was", "ignored second turn"]},
                                                {"prompt": "def add(a, b):"}, {"text": "Rain fell all night and"}])
    out = root / "eval"
    assert evaluate(["--target", base, "--drafter", f"d={text_run.drafter}", "--benchmarks", str(bench),
                     "--format", "text", "--max-new-tokens", "8", "--device", "cpu", "--no-progress",
                     "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["data_format"] == "text"
    story = results["drafters"]["d"]["benchmarks"]["story"]
    assert story["num_prompts"] == 3 and story["num_rounds"] >= 3 and story["tau"] >= 1.0
    # The chat format is refused at once (no template), and with a template it is not the drafter's format.
    with pytest.raises(ValueError, match=r"has no chat template .*set --format text .* or give a chat template "
                                         r"with --chat-template"):
        evaluate(["--target", base, "--drafter", str(text_run.drafter), "--benchmarks", str(bench),
                  "--out", str(root / "eval_chat")])
    with pytest.raises(ValueError, match=r"--format=chat but drafter 'drafter'.s training data \(its config.json\) "
                                         r"was rendered in the text format: set --format=text"):
        evaluate(["--target", base, "--drafter", str(text_run.drafter), "--benchmarks", str(bench),
                  "--chat-template", TEMPLATE, "--device", "cpu", "--out", str(root / "eval_template")])

    exported = root / "export"
    assert deepspec(["export", "--checkpoint", str(text_run.drafter), "--format", "hf", "--out", str(exported),
                     "--target", base]) == 0
    assert json.loads((exported / "config.json").read_text())["data_format"] == "text"
    assert "rendered in the text format" in (exported / "README.md").read_text()


def test_a_chat_template_in_the_target_config_is_the_other_way(tiny_base_target_dir, tmp_path):
    """`target.chat_template` (a file) renders the chat format for a tokenizer without one: cached, recorded, and
    checked by training (a run without it is refused naming it), while the tokenizer's fingerprint stays its own."""
    from deepspec.cache.config import compose_cache_config
    from deepspec.cache.format import read_meta
    from deepspec.cache.pipeline import run_cache_job
    from deepspec.data.chat import render_conversation
    from deepspec.data.sources import load_jsonl
    from deepspec.targets.load import load_target
    from deepspec.training.config import compose_train_config, plan_training, resolve_config

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    source = write_jsonl(tmp_path / "prompts.jsonl", prompts(6))
    cache = tmp_path / "cache"
    assert run_cache_job(compose_cache_config(cache_overrides(tiny_base_target_dir, source, cache,
                                                              f"target.chat_template={template}"))) == 0
    meta = read_meta(cache)
    assert meta.data_format == "chat" and meta.chat_template == TEMPLATE
    # 2 of 6 are prompt records (no answer): skipped, counted; the answers are learned as the template renders them.
    assert meta.counts["samples"] == 4 and meta.counts["skipped"] == {"no_assistant_tokens": 2}
    target = load_target(str(tiny_base_target_dir), device="cpu")
    assert target.tokenizer.chat_template is None and meta.tokenizer_hash == target.fingerprint()["tokenizer_hash"]
    from deepspec.cache import CacheReader

    first = next(c for c in load_jsonl(source)[0] if c.id == CacheReader(cache).samples[0]["id"])
    target.tokenizer.chat_template = TEMPLATE
    expected = render_conversation(target.tokenizer, first.messages).input_ids[:64]
    assert CacheReader(cache)[0].input_ids.tolist() == expected

    overrides = train_overrides(tiny_base_target_dir, cache, tmp_path / "train")
    plan = plan_training(resolve_config(compose_train_config([*overrides, f"target.chat_template={template}"])), 1)
    assert plan.rendering == {"data_format": "chat", "chat_template": TEMPLATE, "chat_template_kwargs": {}}
    with pytest.raises(ValueError, match=r"target.chat_template gives the tokenizer's own chat template but the cache "
                                         r"at data.cache_dir=.* was rendered with a given chat template"):
        plan_training(resolve_config(compose_train_config(overrides)), 1)


def test_online_features_refuse_a_base_model_in_the_chat_format_and_all_skipped_data(tiny_base_target_dir,
                                                                                    tmp_path):
    """Training that computes its own features applies the same rules: no chat template fails before any weights
    load (naming data.source.format=text), and data whose every record is skipped is refused, naming the cause."""
    from deepspec.cache.config import CacheSchema
    from deepspec.cache.online import OnlineFeatures
    from deepspec.data.rendering import AllSkipped, Rendering
    from deepspec.data.sources import load_jsonl
    from deepspec.targets.load import load_target
    from deepspec.training.config import compose_train_config, plan_training, resolve_config

    source = write_jsonl(tmp_path / "prompts.jsonl", prompts(3))
    online = [*train_overrides(tiny_base_target_dir, tmp_path / "cache", tmp_path / "train"),
              "data.features=online", f"data.source.prompts={source}"]
    with pytest.raises(ValueError, match=r"has no chat template .*set data.source.format=text to use plain text, or "
                                         r"give a chat template with target.chat_template="):
        plan_training(resolve_config(compose_train_config(online)), 1)
    plan_training(resolve_config(compose_train_config([*online, "data.source.format=text"])), 1)

    prompt_only = write_jsonl(tmp_path / "prompt_only.jsonl", [{"id": "q", "prompt": "Nothing follows"}])
    conversations = {"train": load_jsonl(prompt_only)[0]}
    with pytest.raises(AllSkipped, match=r"data.source: all 1 records were skipped, nothing was written \(1 "
                                         r"no_loss_tokens, the first 'q' \(prompt_only.jsonl:1\): .*\)\. The text "
                                         r"format learns from a record's text or completion"):
        OnlineFeatures(conversations, load_target(str(tiny_base_target_dir), device="cpu"), [0],
                       options=CacheSchema(max_length=64, storage_dtype="fp32"), rendering=Rendering(format="text"))


@pytest.fixture(scope="module")
def tiny_base_gemma3_dir(tmp_path_factory) -> Path:
    """tiny-random-gemma3 (sliding-window layers: a 16-token window, shorter than the sequences decoded) saved with
    the SmolLM2 tokenizer without its chat template: a Gemma 3 base model in miniature."""
    from deepspec.targets.load import make_tiny_target

    target = make_tiny_target("gemma3")
    target.tokenizer.chat_template = None
    out = tmp_path_factory.mktemp("tiny_base_gemma3")
    target.model.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out


def test_a_sliding_window_base_model_runs_every_stage_calibration_included(tiny_base_gemma3_dir, tmp_path):
    """Gemma 3's sliding-window layers through cache, training with its calibration at the end, `deepspec
    calibrate` and `deepspec evaluate --with-prompt-lookup` (the batched rollouts calibration runs included)."""
    from deepspec.cache.config import compose_cache_config
    from deepspec.cache.pipeline import run_cache_job
    from deepspec.calibration.cli import main as calibrate
    from deepspec.evaluation.cli import main as evaluate
    from deepspec.training import run
    from deepspec.training.config import compose_train_config

    base = tiny_base_gemma3_dir
    cache = tmp_path / "cache"
    source = write_jsonl(tmp_path / "prompts.jsonl", prompts(12))
    assert run_cache_job(compose_cache_config(cache_overrides(base, source, cache, "data.format=text"))) == 0
    summary = run(compose_train_config(train_overrides(
        base, cache, tmp_path / "train", "calibration.enabled=true", "calibration.min_samples=1",
        "calibration.holdout=0", "calibration.max_prompts=4", "calibration.max_new_tokens=24")))
    drafter = Path(summary["checkpoint"]) / "drafter"
    assert json.loads((drafter / "config.json").read_text())["calibration_temperatures"]  # after training
    assert calibrate(["--drafter", str(drafter), "--cache", str(cache), "--max-prompts", "4", "--max-new-tokens",
                      "24", "--min-samples", "1", "--holdout", "0", "--out", str(tmp_path / "calibration")]) == 0
    config = json.loads((drafter / "config.json").read_text())
    assert config["calibration_temperatures"] and config["prompt_lookup_acceptance"]
    bench = write_jsonl(tmp_path / "story.jsonl", [{"prompt": "The castle on the hill was old and"},
                                                   {"text": "Rain fell all night over the quiet town and"}])
    out = tmp_path / "eval"
    assert evaluate(["--target", str(base), "--drafter", f"d={drafter}", "--benchmarks", str(bench), "--format",
                     "text", "--max-new-tokens", "24", "--with-prompt-lookup", "--device", "cpu", "--no-progress",
                     "--out", str(out)]) == 0
    story = json.loads((out / "results.json").read_text())["drafters"]["d"]["benchmarks"]["story"]
    assert story["num_prompts"] == 2 and story["tau"] >= 1.0
