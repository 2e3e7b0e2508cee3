"""MTP -> DeepSeek NextN keys: refused for every family but DeepSeek-V3's (the only one SGLang reads as NextN);
the NextN mapping itself (names at model.layers.{L + k}, shared head copies, round trip) through `write_nextn`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from deepspec.export import detect_layout, export_drafter, load_exported
from deepspec.export.mtp_nextn import write_nextn


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_gemma3"])
def test_nextn_is_refused_for_families_sglang_does_not_read_as_nextn(fixture, request, probe, tmp_path):
    target = request.getfixturevalue(fixture)
    model = probe.make_drafter("mtp", target, num_mtp_modules=1)
    with pytest.raises(ValueError, match="DeepSeek-V3 targets.*model_config.py:1032-1036.*format='vllm'"):
        export_drafter(model, tmp_path / "nextn", "nextn", target=target)
    assert not (tmp_path / "nextn").exists()


@pytest.mark.float_exact
@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_gemma3"])
def test_nextn_round_trip_gives_identical_logits(fixture, request, probe, tmp_path):
    target = request.getfixturevalue(fixture)
    model = probe.make_drafter("mtp", target, num_mtp_modules=2)
    expected = probe.outputs(model, target)
    out = write_nextn(model, tmp_path / "nextn", target)
    assert detect_layout(out) == "nextn"
    probe.assert_same(expected, probe.outputs(load_exported(out, target), target))


def test_nextn_keys_sit_after_the_target_layers(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("mtp", tiny_qwen3, num_mtp_modules=2)
    out = write_nextn(model, tmp_path / "nextn", tiny_qwen3)
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 4
    sidecar = json.loads((out / "deepspec_export.json").read_text())
    assert sidecar["first_nextn_layer_index"] == 4 and sidecar["final_hidden_norm"] == "post_norm"
    tensors = load_file(str(out / "model.safetensors"))
    hidden = 64
    for layer in (4, 5):  # L + k-1 for chained modules k = 1, 2
        prefix = f"model.layers.{layer}."
        assert tensors[prefix + "eh_proj.weight"].shape == (hidden, 2 * hidden)
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight", "self_attn.q_proj.weight", "mlp.down_proj.weight"):
            assert prefix + name in tensors
        assert torch.equal(tensors[prefix + "shared_head.head.weight"], tiny_qwen3.model.get_output_embeddings().weight)
        assert torch.equal(tensors[prefix + "embed_tokens.weight"], tiny_qwen3.model.get_input_embeddings().weight)
    assert torch.equal(tensors["model.layers.5.eh_proj.weight"], model.mtp_layers[1].eh_proj.weight.detach())
    assert not any(k.startswith(("model.layers.3.", "model.layers.6.", "mtp_layers")) for k in tensors)


def test_nextn_without_shared_copies_and_refusals(tiny_qwen3, probe, tmp_path):
    model = probe.make_drafter("mtp", tiny_qwen3, num_mtp_modules=1)
    expected = probe.outputs(model, tiny_qwen3)
    out = write_nextn(model, tmp_path / "lean", None, include_shared=False)
    tensors = load_file(str(out / "model.safetensors"))
    assert not any(k.endswith(("shared_head.head.weight", "embed_tokens.weight")) for k in tensors)
    probe.assert_same(expected, probe.outputs(load_exported(out, tiny_qwen3), tiny_qwen3))
    with pytest.raises(ValueError, match="pass target="):
        write_nextn(model, tmp_path / "needs-target", None)
    with pytest.raises(ValueError, match="holds MTP modules"):
        export_drafter(probe.make_drafter("dflash", tiny_qwen3, num_draft_layers=1), tmp_path / "x", "nextn")
    with pytest.raises(ValueError, match="unknown option"):
        export_drafter(model, tmp_path / "y", "nextn", target=tiny_qwen3, shared=True)


def test_nextn_standalone_numbers_modules_from_zero(tiny_llama, probe, tmp_path):
    model = probe.make_drafter("mtp", tiny_llama, num_mtp_modules=2)
    expected = probe.outputs(model, tiny_llama)
    out = write_nextn(model, tmp_path / "standalone", tiny_llama, standalone=True)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == config["num_nextn_predict_layers"] == 2
    tensors = load_file(str(out / "model.safetensors"))
    assert {k.split(".")[2] for k in tensors} == {"0", "1"}
    probe.assert_same(expected, probe.outputs(load_exported(out, tiny_llama), tiny_llama))
