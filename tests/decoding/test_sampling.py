"""Tests for deepspec.decoding.sampling: parameter validation, the temperature/top-k/top-p filters and the draft
sampler (it returns the processed distribution a draft token was drawn from)."""

import math

import pytest
import torch

from deepspec.decoding.sampling import (
    SamplingParams,
    draft_sampler,
    probs_from_logits,
    process_logits,
    sample_from_logits,
)

NEG_INF = float("-inf")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{"temperature": 1.0, **kwargs})


def test_temperature_has_no_default_and_fields_are_keywords():
    """One class serves regeneration (greedy or the target's recommendation) and decoding (T = 1 by default):
    every caller states its temperature, and no value lands in the wrong field by position."""
    with pytest.raises(TypeError):
        SamplingParams()
    with pytest.raises(TypeError):
        SamplingParams(1.0)


def test_greedy_flag():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert not SamplingParams(temperature=1.0).filters_vocab
    assert SamplingParams(temperature=1.0, top_k=3).filters_vocab
    assert SamplingParams(temperature=1.0, top_p=0.5).filters_vocab


def test_temperature_divides_logits():
    logits_XV = torch.tensor([[1.0, 2.0, -3.0]])
    out = process_logits(logits_XV, SamplingParams(temperature=0.5))
    assert torch.equal(out, torch.tensor([[2.0, 4.0, -6.0]]))


def test_greedy_leaves_logits_unchanged():
    logits_XV = torch.tensor([[1.0, 2.0, -3.0]])
    assert torch.equal(process_logits(logits_XV, SamplingParams(temperature=0.0, top_k=1)), logits_XV)
    assert torch.equal(probs_from_logits(logits_XV, SamplingParams(temperature=0.0)), torch.tensor([[0.0, 1.0, 0.0]]))


def test_top_k_keeps_k_largest_and_ties():
    logits_XV = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = process_logits(logits_XV, SamplingParams(temperature=1.0, top_k=2))
    # Row 0: the 2nd largest value (2.0) is tied, so both 2.0 entries stay.
    assert torch.equal(out[0], torch.tensor([NEG_INF, 3.0, 2.0, NEG_INF, 2.0]))
    assert torch.equal(out[1], torch.tensor([5.0, 4.0, NEG_INF, NEG_INF, NEG_INF]))


@pytest.mark.parametrize("top_p, kept", [(0.3, [0]), (0.7, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, kept):
    probs_V = torch.tensor([0.5, 0.3, 0.15, 0.05])
    order = torch.tensor([2, 0, 3, 1])  # shuffled vocabulary: the filter must not depend on position
    logits_XV = probs_V.log()[order][None]
    out = process_logits(logits_XV, SamplingParams(temperature=1.0, top_p=top_p))
    kept_original = sorted(order[torch.isfinite(out[0])].tolist())
    assert kept_original == kept


def test_top_k_then_top_p_order():
    logits_XV = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # top-k=3 renormalises to [0.526, 0.316, 0.158]; top_p=0.8 then keeps tokens 0 and 1.
    out = process_logits(logits_XV, SamplingParams(temperature=1.0, top_k=3, top_p=0.8))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_probs_from_logits_matches_softmax_of_filtered():
    generator = torch.Generator().manual_seed(0)
    logits_XV = torch.randn(3, 11, generator=generator)
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    probs_XV = probs_from_logits(logits_XV, params)
    torch.testing.assert_close(probs_XV.sum(-1), torch.ones(3))
    torch.testing.assert_close(probs_XV, torch.softmax(process_logits(logits_XV, params), -1))
    assert ((probs_XV > 0).sum(-1) <= 5).all()


def test_sample_from_logits_follows_filtered_law():
    generator = torch.Generator().manual_seed(1)
    logits_V = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5])
    params = SamplingParams(temperature=1.3, top_k=4)
    num_samples = 40_000
    tokens = sample_from_logits(logits_V.expand(num_samples, -1), params, generator)
    counts = torch.bincount(tokens, minlength=5).double()
    expected_V = probs_from_logits(logits_V, params).double()
    assert counts[3] == 0  # removed by top-k
    sigma = (num_samples * expected_V * (1 - expected_V)).sqrt()
    assert ((counts - num_samples * expected_V).abs() <= 6 * sigma).all()
    assert math.isclose(counts.sum().item(), num_samples)
    assert torch.equal(sample_from_logits(logits_V[None], SamplingParams(temperature=0.0)), torch.tensor([2]))


def test_sampler_returns_processed_probs_it_drew_from():
    gen = torch.Generator().manual_seed(0)
    logits_BV = torch.randn(3, 50, generator=gen)
    params = SamplingParams(temperature=0.7, top_k=5)
    sampler = draft_sampler(params, torch.Generator().manual_seed(1))
    token_B, probs_BV = sampler(logits_BV, 0)
    expected = torch.softmax(process_logits(logits_BV, params), dim=-1)
    torch.testing.assert_close(probs_BV, expected)
    assert torch.all(probs_BV.gather(1, token_B[:, None]) > 0)
    torch.testing.assert_close(probs_BV.sum(-1), torch.ones(3))
    assert torch.all((probs_BV > 0).sum(-1) == 5)  # top-k applied identically
    # Empirical law of the sampler on one row follows its returned probs.
    counts = torch.zeros(50)
    for _ in range(3000):
        tok, _ = sampler(logits_BV[:1], 0)
        counts[tok] += 1
    freq = counts / 3000
    sigma = (expected[0] * (1 - expected[0]) / 3000).sqrt()
    assert torch.all((freq - expected[0]).abs() <= 6 * sigma + 1e-9)
    greedy_tok, greedy_probs = draft_sampler(SamplingParams(temperature=0.0), None)(logits_BV, 0)
    assert greedy_probs is None and torch.equal(greedy_tok, logits_BV.argmax(-1))
