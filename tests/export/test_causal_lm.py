"""causal_lm layout: a standalone drafter as a plain transformers causal LM (what vLLM's draft_model method and
SGLang's STANDALONE algorithm load), its materialised embedding/head, and the round trip."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deepspec.decoding.loop import speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.proposers import make_proposer
from deepspec.export import detect_layout, export_drafter, formats_for, load_exported

from .conftest import make_drafter

IDS = torch.tensor([[1, 5, 77, 912, 33, 4001, 17, 250]])


def drafter_logits(drafter, ids=IDS):
    positions = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        return drafter.logits(drafter.hidden_states(drafter.embed(ids), torch.ones_like(ids), positions)[0])


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
@pytest.mark.parametrize("overrides,exact", [({}, True), ({"share_target_embeddings": False}, True),
                                             ({"draft_hidden_size": 32}, False)], ids=["shared", "own", "narrow"])
def test_transformers_loads_the_folder_and_computes_the_drafters_logits(request, tmp_path, family, overrides, exact):
    target = request.getfixturevalue(family)
    drafter = make_drafter("standalone", target, **overrides)
    out = export_drafter(drafter, tmp_path / "draft", "causal_lm", target=target)
    config = json.loads((out / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    # What the engines read: a registered *ForCausalLM architecture and the target's vocabulary size.
    assert config["architectures"] == [type(target.model).__name__] == [type(model).__name__]
    assert config["vocab_size"] == target.model.config.vocab_size and config["deepspec_layout"] == "causal_lm"
    assert config["num_hidden_layers"] == 2 and not config["model_type"].startswith("deepspec")
    assert AutoTokenizer.from_pretrained(out).get_vocab() == target.tokenizer.get_vocab()
    with torch.no_grad():
        exported = model(IDS).logits[0].float()
    tolerance = 0.0 if exact else 1e-5  # the projections folded into the embedding/head round differently
    torch.testing.assert_close(exported, drafter_logits(drafter), rtol=0, atol=tolerance)
    # At the target's width the shared embedding/head are the target's own tensors (tied like the target's).
    if overrides == {}:
        assert torch.equal(model.get_output_embeddings().weight, target.model.get_output_embeddings().weight)
        assert config["tie_word_embeddings"] == bool(target.model.config.tie_word_embeddings)
    assert detect_layout(out) == "causal_lm"
    reloaded = load_exported(out, target)
    torch.testing.assert_close(drafter_logits(reloaded), drafter_logits(drafter), rtol=0, atol=tolerance)


def test_round_trip_decodes_the_same_tokens_and_keeps_calibration(tiny_qwen3, tmp_path):
    drafter = make_drafter("standalone", tiny_qwen3, num_speculative_tokens=3)
    drafter.config.calibration_temperatures = [1.5, 2.0, 2.5]
    reloaded = load_exported(export_drafter(drafter, tmp_path / "draft", "causal_lm", target=tiny_qwen3), tiny_qwen3)
    assert reloaded.config.calibration_temperatures == [1.5, 2.0, 2.5] and reloaded.config.num_speculative_tokens == 3
    sampling = SamplingParams(temperature=1.0)
    runs = [speculative_generate(TargetVerifier(tiny_qwen3.model, []), make_proposer(d), [1, 9, 8, 7], 20, sampling,
                                 generator=torch.Generator().manual_seed(4)) for d in (drafter, reloaded)]
    assert runs[0].token_ids == runs[1].token_ids
    assert [(r.proposed, r.accepted) for r in runs[0].rounds] == [(r.proposed, r.accepted) for r in runs[1].rounds]


def test_a_wrapped_model_with_padding_rows_is_cut_to_the_target_vocabulary(tiny_llama, tmp_path):
    from deepspec.drafters.build import build_drafter
    from deepspec.targets.tiny import build_tiny_model

    padded = build_tiny_model("qwen3", vocab_size=len(tiny_llama.tokenizer) + 128, seed=3)
    padded.save_pretrained(tmp_path / "source")
    tiny_llama.tokenizer.save_pretrained(tmp_path / "source")
    drafter = build_drafter("standalone", tiny_llama, base_model=str(tmp_path / "source")).eval()
    out = export_drafter(drafter, tmp_path / "draft", "causal_lm", target=tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.get_input_embeddings().weight.shape[0] == tiny_llama.model.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits[0], padded(IDS).logits[0, :, : tiny_llama.model.config.vocab_size],
                                   rtol=0, atol=1e-5)


def test_refusals(tiny_llama, tmp_path):
    drafter = make_drafter("standalone", tiny_llama)
    with pytest.raises(ValueError, match="the causal_lm layout holds the target's tokenizer"):
        export_drafter(drafter, tmp_path / "a", "causal_lm")
    with pytest.raises(ValueError, match=r"the causal_lm layout holds standalone drafters .* this drafter is 'dspark'"):
        export_drafter(make_drafter("dspark", tiny_llama, block_size=4), tmp_path / "b", "causal_lm", target=tiny_llama)
    assert formats_for("standalone", "llama") == ["hf", "causal_lm"]
    assert "causal_lm" not in formats_for("dspark", "qwen3")
