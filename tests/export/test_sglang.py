"""SGLang layout: Eagle3 (LlamaForCausalLMEagle3), DFlash (DFlashDraftModel), DSpark; schema + round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.drafters.draft_vocab import build_draft_vocab, kept_target_ids
from deepspec.export import detect_layout, export_drafter, load_exported

ROUND_TRIPS = {
    "eagle3-reduced-vocab": ("eagle3", "tiny_llama", {"draft_vocab_size": 64, "target_layer_ids": [0, 1, 2]}),
    "eagle3-full-vocab": ("eagle3", "tiny_llama", {"target_layer_ids": [0, 1, 2]}),
    "dflash": ("dflash", "tiny_qwen3", {"num_draft_layers": 2}),
    "dspark-markov": ("dspark", "tiny_qwen3", {"num_draft_layers": 2, "markov_rank": 8,
                                                   "calibration_temperatures": [0.5 + 0.25 * i for i in range(7)]}),
    "dspark-rnn": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 8, "sequential_head": "rnn"}),
    "dspark-confidence-only": ("dspark", "tiny_qwen3", {"num_draft_layers": 1, "markov_rank": 4, "sequential_head": "none"}),
}


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
    assert set(tensors) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {f"midlayer.{n}" for n in layer}
    assert tensors["fc.weight"].shape == (hidden, 3 * hidden)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden  # [embedding; hidden]
    assert tensors["lm_head.weight"].shape == (64, hidden)
    assert tensors["t2d"].dtype == torch.bool and tensors["t2d"].shape == (vocab,)
    # d2t holds offsets: target id = draft id + d2t[draft id]; not absolute ids.
    assert torch.equal(tensors["d2t"], d2t) and not torch.equal(tensors["d2t"], kept_target_ids(d2t))
    assert torch.equal(torch.arange(64) + tensors["d2t"], torch.nonzero(t2d).squeeze(1))
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], model.midlayer.hidden_norm.weight.detach())


def test_eagle3_full_vocab_lets_sglang_take_the_target_head(tiny_llama, probe, tmp_path):
    model = probe.make_drafter("eagle3", tiny_llama, target_layer_ids=[0, 1, 2])
    out = export_drafter(model, tmp_path / "sglang", "sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] is None and config["tie_word_embeddings"] is False
    assert not {"lm_head.weight", "d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))


def test_dflash_schema_and_context_projection(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=2)
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 4
    dflash = config["dflash_config"]
    assert dflash["block_size"] == 7 and dflash["mask_token_id"] == model.config.mask_token_id
    assert dflash["target_layer_ids"] == model.config.target_layer_ids and dflash["sample_from_anchor"] is True
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


def test_dspark_writes_head_tensors_and_fields(tiny_qwen3, probe, tmp_path):
    temps = [0.5 + 0.25 * i for i in range(7)]
    model = probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=8, calibration_temperatures=temps)
    out = export_drafter(model, tmp_path / "sglang", "sglang", target=tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"]
    assert config["dspark_config"]["markov_head_type"] == "vanilla" and config["dspark_config"]["markov_rank"] == 8
    assert config["dspark_config"]["calibration_temperatures"] == pytest.approx(temps)
    tensors = load_file(str(out / "model.safetensors"))
    vocab = tiny_qwen3.model.config.vocab_size
    assert tensors["markov_head.markov_w1.weight"].shape == (vocab, 8)
    assert tensors["markov_head.markov_w2.weight"].shape == (vocab, 8)
    assert tensors["confidence_head.proj.weight"].shape == (1, 64 + 8)


def test_sglang_refuses_what_its_loaders_cannot_represent(tiny_llama, tiny_qwen3, probe, tmp_path):
    with pytest.raises(ValueError, match="q_norm"):  # LlamaForCausalLMEagle3 has no q/k norms
        export_drafter(probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 1, 2]), tmp_path / "a", "sglang")
    with pytest.raises(ValueError, match="exactly 3 target layers.*drafter.feature_layers=low_mid_high"):
        export_drafter(probe.make_drafter("eagle3", tiny_llama, target_layer_ids=[0, 2]), tmp_path / "b", "sglang")
    with pytest.raises(ValueError, match="k_norm"):  # DFlashDraftModel layers are Qwen3-shaped
        export_drafter(probe.make_drafter("dflash", tiny_llama, num_draft_layers=1), tmp_path / "c", "sglang")
    with pytest.raises(ValueError, match="nextn"):
        export_drafter(probe.make_drafter("mtp", tiny_llama), tmp_path / "d", "sglang")
    for kind, extra in (("dflash", {}), ("dspark", {"markov_rank": 4})):  # the engines read the full vocabulary
        reduced = probe.make_drafter(kind, tiny_qwen3, num_draft_layers=1, draft_vocab_size=64, **extra)
        with pytest.raises(ValueError, match=r"SGLang D\w+DraftModel cannot represent a reduced draft vocabulary "
                                             r"\(drafter.draft_vocab_size=64, tensors d2t/t2d\)"):
            export_drafter(reduced, tmp_path / f"e-{kind}", "sglang")


def test_sglang_loader_checks_anchor_convention_and_target(tiny_qwen3, tiny_llama, probe, tmp_path):
    out = export_drafter(probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1), tmp_path / "s", "sglang")
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["dflash_config"]["sample_from_anchor"] = False
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sample_from_anchor"):
        load_exported(out, tiny_qwen3)
    config["dflash_config"]["sample_from_anchor"] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="target_fingerprint.config_hash"):
        load_exported(out, tiny_llama)
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
