"""Fixtures of the export tests: tiny drafters of every kind and their logits on fixed inputs.

The logits are what an engine would compute from the exported tensors: block drafters' per-slot
distributions (with the sequential bias) and confidences, Eagle3's and MTP's chain-draft distributions.

Shape legend: B = batch, C = context tokens, F = features, G = block size, K = drafts, V = vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from deepspec.drafters.build import build_drafter


def softmax_argmax(logits_BV: torch.Tensor, slot: int):
    """Deterministic sampler that also returns the full distribution it drew from."""
    return logits_BV.argmax(dim=-1), torch.softmax(logits_BV.float(), dim=-1)


def make_drafter(kind: str, target, seed: int = 0, **overrides):
    """A tiny drafter with every weight randomised (norms too), so a swapped tensor changes the logits."""
    torch.manual_seed(seed)
    model = build_drafter(kind, target, **overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def drafter_outputs(model, target, seed: int = 1) -> dict[str, torch.Tensor]:
    """Every number an engine would reproduce from the drafter on fixed random inputs."""
    config = model.config
    hidden = config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    batch, context = 2, 5
    vocab = config.target_vocab_size
    kind = type(config).drafter_kind
    with torch.no_grad():
        if kind in ("dflash", "dspark"):
            features_BCF = torch.randn(batch, context, len(config.target_layer_ids) * hidden, generator=generator)
            positions_BC = torch.arange(context).expand(batch, context)
            cache = model.extend_context(model.new_decode_state(), features_BCF, positions_BC)
            anchors_B = torch.randint(0, vocab, (batch,), generator=generator)
            anchor_pos_B = torch.full((batch,), context)
            hidden_BGH = model.draft_hidden(cache, anchors_B, anchor_pos_B)
            proposal = model.propose(cache, anchors_B, anchor_pos_B, softmax_argmax)
            out = {"base_logits": model.base_logits(hidden_BGH), "probs": proposal.probs_BKV,
                   "tokens": proposal.token_ids_BK}
            if proposal.confidence_BK is not None:
                out["confidence"] = proposal.confidence_BK
            return out
        if kind == "eagle3":
            features = torch.randn(batch, context, len(config.target_layer_ids) * hidden, generator=generator)
            next_ids = torch.randint(0, vocab, (batch, context), generator=generator)
            draft = model.propose(model.new_decode_state(), features, next_ids, softmax_argmax, num_draft=3)
            return {"probs": draft.probs_BKV, "tokens": draft.token_ids_BK}
        if kind == "mtp":
            final_hidden = torch.randn(batch, context, hidden, generator=generator)
            next_ids = torch.randint(0, vocab, (batch, context), generator=generator)
            draft = model.propose(model.new_decode_state(), final_hidden, next_ids, softmax_argmax)
            return {"probs": draft.probs_BKV, "tokens": draft.token_ids_BK}
    raise ValueError(kind)


def assert_same_outputs(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    for key, value in expected.items():
        assert torch.equal(value, actual[key]), f"{key} differs after the round trip"


class Probe:
    """The helpers above as one fixture object (tests run with --import-mode=importlib: no helper imports)."""

    make_drafter = staticmethod(make_drafter)
    outputs = staticmethod(drafter_outputs)
    assert_same = staticmethod(assert_same_outputs)


@pytest.fixture
def probe() -> Probe:
    return Probe()
