"""SGLang layout: Eagle3 (LlamaForCausalLMEagle3), DFlash (DFlashDraftModel), DSpark; schema, block conventions,
round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.drafters.draft_vocab import build_draft_vocab, kept_target_ids
from deepspec.export import detect_layout, export_drafter, load_exported

ROUND_TRIPS = {
    "eagle3-reduced-vocab": ("eagle3", "tiny_llama", {"draft_vocab_size": 64, "target_layer_ids": [0, 1, 2]}),
    "dspark-markov": ("dspark", "tiny_qwen3", {"num_draft_layers": 2, "markov_rank": 8,
                                               "calibration_temperatures": [0.5 + 0.25 * i for i in range(7)]}),
    "dspark-markov-mask": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8,
                                                    "block_convention": "mask-predicts",
                                                    "calibration_temperatures": [0.5 + 0.25 * i for i in range(6)]}),
    "dspark-rnn": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8, "sequential_head": "rnn"}),
    "dspark-rnn-mask": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8, "sequential_head": "rnn",
                                                 "block_convention": "mask-predicts"}),
}  # full-vocabulary Eagle3 and DFlash (its default convention): tests/drafters/test_every_kind.py


def _eagle3_with_vocab(probe, target, vocab_d=64):
    model = probe.make_drafter("eagle3", target, draft_vocab_size=vocab_d, target_layer_ids=[0, 1, 2])
    counts = torch.arange(target.model.config.vocab_size).flip(0) % 1013  # a non-prefix kept set
    d2t, t2d = build_draft_vocab(counts, vocab_d, always_keep=[2])
    model.set_draft_vocab(d2t, t2d)
    with torch.no_grad():
        model.lm_head.weight.add_(0.1)  # a trained head differs from the target rows it started from
    return model, d2t, t2d


@pytest.mark.float_exact
@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_sglang_round_trip_gives_identical_logits(case, request, probe, tmp_path):
    kind, fixture, overrides = ROUND_TRIPS[case]
    target = request.getfixturevalue(fixture)
    if case == "eagle3-reduced-vocab":
        model, _, _ = _eagle3_with_vocab(probe, target)
    else:
        model = probe.make_drafter(kind, target, **overrides)
    expected = probe.outputs(model, target)
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=target)
    assert detect_layout(out) == "sglang"
    loaded = load_exported(out, target)
    assert type(loaded) is type(model)
    assert getattr(loaded.config, "block_convention", None) == getattr(model.config, "block_convention", None)
    assert (getattr(loaded.config, "calibration_temperatures", None)
            == getattr(model.config, "calibration_temperatures", None))
    probe.assert_same(expected, probe.outputs(loaded, target))


def test_eagle3_schema_follows_llama_eagle3(tiny_llama, probe, tmp_path):
    model, d2t, t2d = _eagle3_with_vocab(probe, tiny_llama)
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_llama)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == 64 and isinstance(config["draft_vocab_size"], int)
    # SGLang's aux ids are "output of layer k" like DeepSpec's: no shift.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    tensors = load_file(str(out / "model.safetensors"))
    hidden, vocab = 64, tiny_llama.model.config.vocab_size
    layer = {"input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
    assert set(tensors) == ({"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
                            | {f"midlayer.{n}" for n in layer})
    assert tensors["fc.weight"].shape == (hidden, 3 * hidden)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden  # [embedding; hidden]
    assert tensors["lm_head.weight"].shape == (64, hidden)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (vocab,)
    # d2t holds offsets: target id = draft id + d2t[draft id]; not absolute ids.
    assert torch.equal(tensors["d2t"], d2t) and not torch.equal(tensors["d2t"], kept_target_ids(d2t))
    assert torch.equal(torch.arange(64) + tensors["d2t"], torch.nonzero(t2d).squeeze(1))
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], model.midlayer.hidden_norm.weight.detach())


def test_eagle3_full_vocab_is_an_explicit_identity_draft_vocabulary(tiny_llama, probe, tmp_path):
    """SpecForge needs a numeric draft_vocab_size and lm_head/d2t/t2d; SGLang reads d2t = 0 as identity hot ids."""
    model = probe.make_drafter("eagle3", tiny_llama, target_layer_ids=[0, 1, 2])
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_llama)
    config = json.loads((out / "config.json").read_text())
    vocab = tiny_llama.model.config.vocab_size
    assert config["draft_vocab_size"] == vocab and config["tie_word_embeddings"] is False
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["lm_head.weight"], tiny_llama.model.get_output_embeddings().weight)
    assert torch.equal(tensors["d2t"], torch.zeros(vocab, dtype=torch.long)) and bool(tensors["t2d"].all())
    assert load_exported(out, tiny_llama).config.draft_vocab_size is None  # read back as the full vocabulary
    with pytest.raises(ValueError, match="pass target="):  # the head copy needs the target
        export_drafter(model, tmp_path / "no-target", "sglang")


def test_dflash_schema_and_context_projection(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=2)
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 7 and dflash["mask_token_id"] == model.config.mask_token_id
    assert dflash["target_layer_ids"] == model.config.target_layer_ids
    assert "sample_from_anchor" not in dflash and "sample_from_anchor" not in config  # no DFlash engine reads it
    assert dflash["mask_token"] == tiny_qwen3.tokenizer.convert_ids_to_tokens(model.config.mask_token_id)
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= set(tensors)
    assert {k.split(".")[1] for k in tensors if k.startswith("layers.")} == {"0", "1"}
    assert "layers.0.self_attn.k_norm.weight" in tensors
    # The engine computes H_ctx = RMSNorm_hidden_norm(fc(features)): recompute it from the stored tensors.
    features = torch.randn(3, tensors["fc.weight"].shape[1])
    projected = features @ tensors["fc.weight"].T
    eps = config["rms_norm_eps"]
    h_ctx = projected * torch.rsqrt(projected.pow(2).mean(-1, keepdim=True) + eps) * tensors["hidden_norm.weight"]
    with torch.no_grad():
        torch.testing.assert_close(h_ctx, model.backbone.fusion(features), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("convention", ["anchor-predicts", "mask-predicts"])
def test_dspark_writes_head_tensors_and_fields(tiny_qwen3, probe, tmp_path, convention):
    temps = [0.5 + 0.25 * i for i in range(7 if convention == "anchor-predicts" else 6)]
    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, calibration_temperatures=temps,
                               block_convention=convention)
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"]
    heads = {"markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
             "confidence_head_with_markov": True}
    # SGLang builds the heads from the top level, SpecForge from dflash_config: both are written.
    assert {k: config[k] for k in heads} == heads and {k: config["dflash_config"][k] for k in heads} == heads
    assert config["sample_from_anchor"] is (convention == "anchor-predicts")  # SGLang's flag, top level
    assert "dspark_config" not in config
    sidecar = json.loads((out / "deepspec_export.json").read_text())
    assert sidecar["drafter_config"]["calibration_temperatures"] == pytest.approx(temps)
    tensors = load_file(str(out / "model.safetensors"))
    vocab = tiny_qwen3.model.config.vocab_size
    assert tensors["markov_head.markov_w1.weight"].shape == (vocab, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (vocab, 8)
    assert tensors["confidence_head.proj.weight"].shape == (1, 64 + 8)


def test_sglang_refuses_what_its_loaders_cannot_represent(tiny_llama, tiny_qwen3, tiny_gemma3, probe, tmp_path):
    # LlamaForCausalLMEagle3 builds Llama layers (no q/k norms), DFlashDraftModel Qwen3-shaped ones: the fix is named.
    with pytest.raises(ValueError, match=r"builds llama or mistral draft layers; this drafter's are qwen3 \(the "
                                         r"target's family\): train it with drafter.layer_family=llama"):
        export_drafter(probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 1, 2]), tmp_path / "a", "sglang")
    with pytest.raises(ValueError, match="exactly 3 target layers.*drafter.feature_layers=low_mid_high"):
        export_drafter(probe.make_drafter("eagle3", tiny_llama, target_layer_ids=[0, 2]), tmp_path / "b", "sglang")
    with pytest.raises(ValueError, match=r"builds qwen3 draft layers; this drafter's are llama .*"
                                         r"drafter.layer_family=qwen3"):
        export_drafter(probe.make_drafter("dflash", tiny_llama, num_draft_layers=1), tmp_path / "c", "sglang")
    # The right layers on a target SGLang does not serve with that class: refused naming why.
    with pytest.raises(ValueError, match=r"does not serve gemma3_text targets \(only LlamaForCausalLM .*"
                                         r"set_dflash_layers_to_capture"):
        export_drafter(probe.make_drafter("dflash", tiny_gemma3, num_draft_layers=1, layer_family="qwen3"),
                       tmp_path / "c2", "sglang")
    with pytest.raises(ValueError, match=r"does not serve gemma3_text targets .*sqrt\(hidden\) scale"):
        export_drafter(probe.make_drafter("eagle3", tiny_gemma3, target_layer_ids=[0, 1, 2], layer_family="llama"),
                       tmp_path / "c3", "sglang", target=tiny_gemma3)
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c", "c2", "c3"))
    with pytest.raises(ValueError, match="nextn"):
        export_drafter(probe.make_drafter("mtp", tiny_llama), tmp_path / "d", "sglang")
    for kind, extra in (("dflash", {}), ("dspark", {"markov_rank": 4})):  # the engines read the full vocabulary
        reduced = probe.make_drafter(kind, tiny_qwen3, num_draft_layers=1, draft_vocab_size=64, **extra)
        with pytest.raises(ValueError, match=r"SGLang D\w+DraftModel cannot represent a reduced draft vocabulary "
                                             r"\(drafter.draft_vocab_size=64, tensors d2t/t2d\)"):
            export_drafter(reduced, tmp_path / f"e-{kind}", "sglang")
    with pytest.raises(ValueError, match="sequential head"):  # SGLang's DSpark requires markov_rank > 0
        export_drafter(probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=4,
                                          sequential_head="none"), tmp_path / "e", "sglang")


def test_anchor_predicts_dflash_is_refused_never_written(tiny_qwen3, probe, tmp_path):
    """Every DFlash engine reads slot j >= 1 as x[a + j]: an anchor-predicts DFlash would draft every slot one
    position off there, so the export refuses it (and leaves nothing behind)."""
    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1, block_convention="anchor-predicts")
    for fmt in ("sglang", "vllm"):
        with pytest.raises(ValueError, match="mask-predicts.*dflash_worker_v2.py:2798-2812"):
            export_drafter(model, tmp_path / fmt, fmt, target=tiny_qwen3,
                           **({"verifier": "org/x"} if fmt == "vllm" else {}))
        assert not (tmp_path / fmt).exists()
    assert load_exported(export_drafter(model, tmp_path / "hf", "hf", target=tiny_qwen3),
                         tiny_qwen3).config.block_convention == "anchor-predicts"


def test_sglang_loader_reads_the_convention_and_checks_the_target(tiny_qwen3, tiny_llama, probe, tmp_path):
    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=4)
    out = export_drafter(model, tmp_path / "d", "sglang", target=tiny_qwen3)
    (out / "checksums.json").unlink()  # edited by hand below: the loader's own checks are tested
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["sample_from_anchor"] = False  # the file now claims mask-predicts: read as such
    config_path.write_text(json.dumps(config))
    assert load_exported(out, tiny_qwen3).config.block_convention == "mask-predicts"
    config["sample_from_anchor"] = "yes"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sample_from_anchor"):
        load_exported(out, tiny_qwen3)
    out = export_drafter(probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1), tmp_path / "s", "sglang")
    assert load_exported(out, tiny_qwen3).config.block_convention == "mask-predicts"
    with pytest.raises(ValueError, match="target_fingerprint.config_hash"):
        load_exported(out, tiny_llama)
    (out / "checksums.json").unlink()
    (out / "deepspec_export.json").unlink()
    with pytest.raises(FileNotFoundError, match="deepspec_export.json"):
        load_exported(out, tiny_qwen3)


def test_prefix_map_is_an_exact_inverse_and_refuses_unknown_tensors():
    from deepspec.export.sglang import BLOCK_MAP

    state = {"backbone.fusion.proj.weight": torch.ones(2), "backbone.layers.0.mlp.up_proj.weight": torch.zeros(1),
             "sequential.gates.bias": torch.full((3,), 2.0)}
    engine = BLOCK_MAP.to_format(state)
    assert set(engine) == {"fc.weight", "layers.0.mlp.up_proj.weight", "markov_head.joint_proj.bias"}
    assert BLOCK_MAP.from_format(engine).keys() == state.keys()
    with pytest.raises(ValueError, match=r"no mapping for tensor\(s\) \['backbone.extra.weight'\]"):
        BLOCK_MAP.to_format({"backbone.extra.weight": torch.ones(1)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        BLOCK_MAP.from_format({"lm_head.weight": torch.ones(1)})


@pytest.mark.parametrize("layout", ["sglang", "hf"])  # our safetensors writer; save_pretrained's (0o600 by itself)
def test_exported_files_are_readable_by_a_serving_container_under_umask_022(tiny_qwen3, probe, tmp_path, layout):
    """A serving container running as another user reads the export: files 0o644, folders 0o755 under umask 022."""
    import os
    import stat

    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8)
    old = os.umask(0o022)
    try:
        out = export_drafter(model, tmp_path / layout, layout, target=tiny_qwen3)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(out)): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*")}
    assert "model.safetensors" in modes and "config.json" in modes
    assert modes == {name: 0o755 if (out / name).is_dir() else 0o644 for name in modes}
    assert stat.S_IMODE(out.stat().st_mode) == 0o755


@pytest.mark.parametrize("convention", ["anchor-predicts", "mask-predicts"])
def test_specforge_caveat_of_an_anchor_predicts_dspark_is_said_at_export_and_in_the_model_card(
        tiny_qwen3, probe, tmp_path, caplog, convention):
    """SpecForge 0.2.0 reads slots 1..g-1 whatever `sample_from_anchor` says: an anchor-predicts DSpark drafts other
    tokens there. The export warns and the model card says so, naming the convention to train with."""
    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, block_convention=convention)
    with caplog.at_level("WARNING", logger="deepspec.export.sglang"):
        export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_qwen3)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    card = (export_drafter(model, tmp_path / "hf", "hf", target=tiny_qwen3) / "README.md").read_text()
    assert f"| block convention | {convention} |" in card
    if convention == "mask-predicts":
        assert warnings == [] and "SpecForge" not in card
        return
    assert len(warnings) == 1 and "SpecForge 0.2.0" in warnings[0] and "sample_from_anchor" in warnings[0]
    assert warnings[0].endswith("To serve with SpecForge, train with drafter.block_convention=mask-predicts")
    assert "## Serving" in card and "train with drafter.block_convention=mask-predicts" in card
