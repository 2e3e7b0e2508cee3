"""vLLM speculators layout: Eagle3 and DFlash schema (+1 layer ids, explicit norm_before_residual) and round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.drafters.draft_vocab import build_draft_vocab
from deepspec.export import detect_layout, export_drafter, load_exported

ROUND_TRIPS = {
    "eagle3-qwen3-reduced": ("eagle3", "tiny_qwen3", {"draft_vocab_size": 64, "target_layer_ids": [0, 1, 2]}),
    "eagle3-llama-full": ("eagle3", "tiny_llama", {"target_layer_ids": [0, 1, 2]}),
    "dflash-qwen3": ("dflash", "tiny_qwen3", {"num_draft_layers": 2}),
}


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
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=target)
    assert detect_layout(out) == "vllm"
    probe.assert_same(expected, probe.outputs(load_exported(out, target), target))


def test_eagle3_speculators_config_fields(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("eagle3", tiny_qwen3, draft_vocab_size=64, target_layer_ids=[0, 1, 2])
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3)
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
    assert spec["verifier"] == {"name_or_path": "tiny-random-qwen3", "architectures": ["Qwen3ForCausalLM"]}
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["embed_tokens.weight"], tiny_qwen3.model.get_input_embeddings().weight)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_norm.weight"} <= set(tensors)
    assert not any(k.startswith("midlayer.") for k in tensors)
    assert tensors["layers.0.self_attn.k_proj.weight"].shape[1] == 2 * 64


def test_dflash_speculators_config_fields(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=2, target_layer_ids=[0, 1, 2])
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["speculators_config"]["algorithm"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["block_size"] == 7 and config["mask_token_id"] == model.config.mask_token_id
    assert config["shift_label"] is True and config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 7
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight",
            "layers.1.mlp.down_proj.weight"} <= set(tensors)


def test_vllm_export_fails_with_clear_messages(tiny_qwen3, tiny_llama, probe, tmp_path):
    with pytest.raises(ValueError, match="DSpark is not implemented"):
        export_drafter(probe.make_drafter("dspark", tiny_qwen3, num_draft_layers=1, markov_rank=4), tmp_path / "a", "vllm")
    eagle = probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="pass target="):  # the format stores the target embedding
        export_drafter(eagle, tmp_path / "b", "vllm")
    with pytest.raises(ValueError, match="k_norm"):
        export_drafter(probe.make_drafter("dflash", tiny_llama, num_draft_layers=1), tmp_path / "c", "vllm", target=tiny_llama)
    reduced = probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1, draft_vocab_size=64)
    with pytest.raises(ValueError, match=r"vLLM DFlash \(qwen3_dflash\) cannot represent a reduced draft vocabulary "
                                         r"\(drafter.draft_vocab_size=64"):
        export_drafter(reduced, tmp_path / "d", "vllm", target=tiny_qwen3)
    with pytest.raises(ValueError, match=r"exactly 3 target layers.*target_layer_ids=\[0, 2\].*feature_layers=low_mid_high"):
        export_drafter(probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 2]), tmp_path / "e", "vllm",
                       target=tiny_qwen3)


def test_vllm_loader_rejects_edited_ids_and_a_different_embedding(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("eagle3", tiny_qwen3, target_layer_ids=[0, 1, 2])
    expected = probe.outputs(model, tiny_qwen3)
    out = export_drafter(model, tmp_path / "vllm", "vllm", target=tiny_qwen3)
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
