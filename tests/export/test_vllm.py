"""vLLM speculators layout: Eagle3, DFlash, DSpark and MTP schema (+1 layer ids, explicit norm_before_residual and
sample_from_anchor, a resolvable verifier) and round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.drafters.draft_vocab import build_draft_vocab
from deepspec.export import detect_layout, export_drafter, load_exported

VERIFIER = "deepspec-tests/tiny-random"  # a hub id: written as given, resolved only by speculators when it loads
ROUND_TRIPS = {
    "eagle3-qwen3-reduced": ("eagle3", "tiny_qwen3", {"draft_vocab_size": 64, "target_layer_ids": [0, 1, 2]}),
    "dspark-markov": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8,
                                              "calibration_temperatures": [0.5 + 0.1 * i for i in range(7)]}),
    "dspark-markov-mask": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8,
                                                   "block_convention": "mask-predicts"}),
    "dspark-rnn": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8, "sequential_head": "rnn",
                                           "confidence_head": False}),
    "mtp-qwen3": ("mtp", "tiny_qwen3", {"num_mtp_modules": 1}),
}  # full-vocabulary Eagle3 and DFlash: tests/drafters/test_every_kind.py


@pytest.mark.float_exact
@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_vllm_round_trip_gives_identical_logits(case, request, probe, tmp_path):
    kind, fixture, overrides = ROUND_TRIPS[case]
    target = request.getfixturevalue(fixture)
    model = probe.make_drafter(kind, target, **overrides)
    if case == "eagle3-qwen3-reduced":
        d2t, t2d = build_draft_vocab(torch.arange(target.model.config.vocab_size) % 89, 64, always_keep=[2])
        model.set_draft_vocab(d2t, t2d)
    expected = probe.outputs(model, target)
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=target, verifier=VERIFIER)
    assert detect_layout(out) == "vllm"
    loaded = load_exported(out, target)
    assert type(loaded) is type(model)
    # Every drafter field comes back (as JSON: the target config went through the sidecar file).
    assert json.loads(loaded.config.to_json_string()) == json.loads(model.config.to_json_string())
    probe.assert_same(expected, probe.outputs(loaded, target))


def test_eagle3_speculators_config_fields(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("eagle3", tiny_qwen3, draft_vocab_size=64, target_layer_ids=[0, 1, 2])
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3, verifier=VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["draft_vocab_size"] == 64
    assert config["norm_before_residual"] is False  # explicit: vLLM's update_eagle3 defaults to true
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM counts the input of layer l: ours + 1
    layer_config = config["transformer_layer_config"]
    assert layer_config["model_type"] == "qwen3" and layer_config["num_hidden_layers"] == 1
    assert layer_config["vocab_size"] == tiny_qwen3.model.config.vocab_size
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": model.config.ttt_steps,
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": VERIFIER, "architectures": ["Qwen3ForCausalLM"]}
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["embed_tokens.weight"], tiny_qwen3.model.get_input_embeddings().weight)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_norm.weight"} <= set(tensors)
    assert not any(k.startswith("midlayer.") for k in tensors)
    assert tensors["layers.0.self_attn.k_proj.weight"].shape[1] == 2 * 64


def test_dflash_speculators_config_fields(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=2, target_layer_ids=[0, 1, 2])
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3, verifier=VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["speculators_config"]["algorithm"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["block_size"] == 7 and config["mask_token_id"] == model.config.mask_token_id
    # mask-predicts: vLLM 0.33's DFlash speculator raises on sample_from_anchor=true and drafts block_size - 1.
    assert config["sample_from_anchor"] is False and "shift_label" not in config
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 6
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight",
            "layers.1.mlp.down_proj.weight"} <= set(tensors)


@pytest.mark.parametrize("convention,drafts", [("anchor-predicts", 7), ("mask-predicts", 6)])
def test_dspark_speculators_config_fields(tiny_qwen3, probe, tmp_path, convention, drafts):
    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, block_convention=convention)
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3, verifier=VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    # Written explicitly: speculators defaults sample_from_anchor to true, vLLM's speculators updater to false.
    assert config["sample_from_anchor"] is (convention == "anchor-predicts")
    assert {k: config[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                   "confidence_head_with_markov")} == {
        "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True}
    assert config["speculators_config"]["algorithm"] == "dspark"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == drafts
    tensors = load_file(str(out / "model.safetensors"))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "embed_tokens.weight", "lm_head.weight"} <= set(tensors)


def test_mtp_speculators_layout_keys(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("mtp", tiny_qwen3, num_mtp_modules=1)
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3, verifier=VERIFIER)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "mtp" and config["architectures"] == ["MTPDraftModel"]
    assert config["num_nextn_predict_layers"] == 1
    assert config["transformer_layer_config"]["num_hidden_layers"] == 4  # h^0 = the verifier's last hidden state
    tensors = load_file(str(out / "model.safetensors"))
    assert {"mtp_layers.0.token_layernorm.weight", "mtp_layers.0.hidden_layernorm.weight",
            "mtp_layers.0.input_proj.weight", "mtp_layers.0.final_layernorm.weight",
            "mtp_layers.0.self_attn.q_norm.weight", "mtp_layers.0.mlp.down_proj.weight"} <= set(tensors)
    assert not any(k.startswith(("embed_tokens", "lm_head")) or ".enorm." in k or ".eh_proj." in k for k in tensors)
    assert torch.equal(tensors["mtp_layers.0.input_proj.weight"], model.mtp_layers[0].eh_proj.weight.detach())


def test_vllm_export_fails_with_clear_messages(tiny_qwen3, tiny_llama, tiny_gemma3, probe, tmp_path):
    eagle = probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="pass target="):  # the format stores the target embedding
        export_drafter(eagle, tmp_path / "b", "vllm", verifier=VERIFIER)
    with pytest.raises(ValueError, match=r"builds qwen3 draft layers; this drafter's are llama .*"
                                         r"drafter.layer_family=qwen3"):
        export_drafter(probe.make_drafter("dflash", tiny_llama, num_draft_layers=1), tmp_path / "c", "vllm",
                       target=tiny_llama, verifier=VERIFIER)
    with pytest.raises(ValueError, match=r"does not serve gemma3_text targets .*SupportsEagle3"):
        export_drafter(probe.make_drafter("dflash", tiny_gemma3, num_draft_layers=1, layer_family="qwen3"),
                       tmp_path / "c2", "vllm", target=tiny_gemma3, verifier=VERIFIER)
    assert not (tmp_path / "c2").exists()
    with pytest.raises(ValueError, match="sequential head"):
        export_drafter(probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=4,
                                          sequential_head="none"), tmp_path / "d", "vllm", target=tiny_qwen3,
                       verifier=VERIFIER)
    with pytest.raises(ValueError, match="RNN head over the anchor slot"):
        export_drafter(probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=4,
                                          sequential_head="rnn", block_convention="mask-predicts"),
                       tmp_path / "e", "vllm", target=tiny_qwen3, verifier=VERIFIER)
    with pytest.raises(ValueError, match="Qwen3 family only"):
        export_drafter(probe.make_drafter("mtp", tiny_llama), tmp_path / "f", "vllm", target=tiny_llama,
                       verifier=VERIFIER)
    with pytest.raises(ValueError, match="exactly one module"):
        export_drafter(probe.make_drafter("mtp", tiny_qwen3, num_mtp_modules=2), tmp_path / "g", "vllm",
                       target=tiny_qwen3, verifier=VERIFIER)
    with pytest.raises(ValueError,
                       match=r"exactly 3 target layers.*target_layer_ids=\[0, 2\].*feature_layers=low_mid_high"):
        export_drafter(probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 2]), tmp_path / "h", "vllm",
                       target=tiny_qwen3, verifier=VERIFIER)
    assert not any((tmp_path / name).exists() for name in "bcdefgh")
    for kind, extra in (("dflash", {}), ("dspark", {"markov_rank": 4})):  # the engines read the full vocabulary
        reduced = probe.make_drafter(kind, tiny_qwen3, num_draft_layers=1, draft_vocab_size=64, **extra)
        with pytest.raises(ValueError, match=rf"vLLM speculators {kind} cannot represent a reduced draft vocabulary "
                                             r"\(drafter.draft_vocab_size=64"):
            export_drafter(reduced, tmp_path / f"i-{kind}", "vllm", target=tiny_qwen3, verifier=VERIFIER)
        assert not (tmp_path / f"i-{kind}").exists()


def test_verifier_is_a_hub_id_or_a_folder_speculators_can_resolve(tiny_qwen3, probe, tmp_path):
    """speculators loads verifier.name_or_path when it reads the folder: an in-memory target has no name it could
    resolve, so the export asks for one; a folder is written as its absolute path, a hub id as given."""
    from deepspec.export.vllm_speculators import verifier_name_or_path

    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1)
    with pytest.raises(ValueError, match="exists only in memory.*verifier="):
        export_drafter(model, tmp_path / "a", "vllm", target=tiny_qwen3)
    folder = tmp_path / "target"
    tiny_qwen3.model.save_pretrained(folder)
    out = export_drafter(model, tmp_path / "b", "vllm", target=tiny_qwen3, verifier=str(folder))
    written = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert written == str(folder.resolve())
    with pytest.raises(ValueError, match="neither an existing model folder nor a hub id"):
        export_drafter(model, tmp_path / "c", "vllm", target=tiny_qwen3, verifier=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="unknown option"):
        export_drafter(model, tmp_path / "d", "sglang", target=tiny_qwen3, verifier=VERIFIER)
    config = model.config
    for name, expected in (("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"), ("Qwen/Qwen3-4B", "Qwen/Qwen3-4B"),
                           (str(folder), str(folder.resolve()))):
        config.target_name = name
        assert verifier_name_or_path(config, tiny_qwen3, None) == expected
    config.target_name = str(tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="GGUF"):
        verifier_name_or_path(config, tiny_qwen3, None)


def test_vllm_loader_rejects_edited_ids_and_a_different_embedding(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 1, 2])
    expected = probe.outputs(model, tiny_qwen3)
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3, verifier=VERIFIER)
    (out / "checksums.json").unlink()  # edited by hand below: the loader's own checks are tested
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]  # as if written in DeepSpec's convention by mistake
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"target_layer_ids\[0\]=-1 is out of range"):  # read back as id - 1
        load_exported(out, tiny_qwen3)
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    config["norm_before_residual"] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="norm_before_residual"):
        load_exported(out, tiny_qwen3)
    config["norm_before_residual"] = False
    config_path.write_text(json.dumps(config))
    probe.assert_same(expected, probe.outputs(load_exported(out, tiny_qwen3), tiny_qwen3))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] + 1.0
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="embed_tokens.weight differs"):
        load_exported(out, tiny_qwen3)
