"""Statistical losslessness of `accept_draft` (torch reference) at T > 0 on a tiny vocabulary.

A target Markov chain (transition matrix `target_VV`, start token 0) is decoded speculatively by
50,000 requests at once for several rounds until each has emitted 3 tokens. The joint law of the
first 3 emitted tokens must equal the target chain's law, whatever the draft: (a) a deterministic
one-hot draft, (b) drafts sampled from a fixed distribution, (c) a DSpark-style sequential draft
whose distribution at position k depends on the token sampled at k-1, with ragged draft lengths.
The accepted count of the first round must follow sum over draft paths of prod min(p_d, p_t).

Shape legend: B = requests, K = draft tokens, V = vocab, N = emitted positions checked.
"""

import math

import pytest
import torch

from deepspec.decoding.acceptance import AcceptanceNoise, accept_draft
from deepspec.decoding.sampling import SamplingParams, probs_from_logits

T1 = SamplingParams(temperature=1.0)  # plain sampling at T = 1, no filter

NUM_REQUESTS = 50_000
NUM_POSITIONS = 3
VOCAB = 6
NUM_DRAFT = 3


def _chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over bins with positive expectation; bins with zero law must be empty."""
    counts, expected_probs = counts.double().flatten(), expected_probs.double().flatten()
    impossible = expected_probs <= 0
    assert counts[impossible].sum() == 0, "a token with zero target probability was emitted"
    expected = expected_probs[~impossible] * counts.sum()
    stat = ((counts[~impossible] - expected) ** 2 / expected).sum().item()
    return stat, int((~impossible).sum()) - 1


def _assert_law(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """chi-square below df + 6 sqrt(2 df), and every bin within 6 binomial sigmas."""
    stat, dof = _chi_square(counts, expected_probs)
    assert stat < dof + 6 * math.sqrt(2 * dof), f"chi2={stat:.1f} with {dof} dof"
    total = counts.sum().double()
    expected = expected_probs.double() * total
    sigma = (total * expected_probs.double() * (1 - expected_probs.double())).sqrt()
    assert ((counts.double() - expected).abs() <= 6 * sigma + 1e-9).all()


def _joint_law(transition_VV: torch.Tensor, start_token: int, num_positions: int) -> torch.Tensor:
    law = transition_VV[start_token].double()
    for _ in range(num_positions - 1):
        law = law[..., None] * transition_VV.double()  # broadcast over the last token's row
    return law


def _speculative_decode(draft_fn, target_VV, params, num_draft_fn, generator):
    """Run rounds until every request emitted NUM_POSITIONS tokens; returns tokens [B, N] and round-1 counts."""
    batch = NUM_REQUESTS
    target_logits_VV = target_VV.log()
    emitted_BN = torch.full((batch, NUM_POSITIONS + NUM_DRAFT + 1), -1, dtype=torch.long)
    filled_B = torch.zeros(batch, dtype=torch.long)
    last_token_B = torch.zeros(batch, dtype=torch.long)
    first_round_accepted_B = None
    rows_B = torch.arange(batch)
    while bool((filled_B < NUM_POSITIONS).any()):
        draft_ids_BK, draft_probs_BKV = draft_fn(last_token_B, generator)
        # Row j scores the token after prefix + draft[:j]: the chain's row for its last token.
        previous_BK1 = torch.cat([last_token_B[:, None], draft_ids_BK], dim=1)
        target_logits_BK1V = target_logits_VV[previous_BK1]
        num_draft_B = num_draft_fn(generator)
        noise = AcceptanceNoise.draw(batch, NUM_DRAFT, VOCAB, generator)
        result = accept_draft(draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise,
                              backend="torch")
        if first_round_accepted_B is None:
            first_round_accepted_B = result.num_accepted_B.clone()
        active_B = filled_B < NUM_POSITIONS  # finished requests keep decoding but are not recorded
        for slot in range(NUM_DRAFT + 1):
            write_B = active_B & (slot < result.num_emitted_B)
            emitted_BN[rows_B[write_B], filled_B[write_B] + slot] = result.output_ids_BK1[write_B, slot]
        last_token_B = result.output_ids_BK1[rows_B, result.num_accepted_B]
        filled_B = filled_B + torch.where(active_B, result.num_emitted_B, 0)
    return emitted_BN[:, :NUM_POSITIONS], first_round_accepted_B


def _accept_count_law(draft_kernel_VV: torch.Tensor, target_VV: torch.Tensor) -> torch.Tensor:
    """P(num_accepted = j) for a full-length first round from token 0 (draft kernel: p_d(x | prev))."""
    overlap_VV = torch.minimum(draft_kernel_VV, target_VV).double()
    alpha_V = overlap_VV[0]
    survival = [1.0]
    for _ in range(NUM_DRAFT):
        survival.append(alpha_V.sum().item())
        alpha_V = alpha_V @ overlap_VV
    survival.append(0.0)
    return torch.tensor([survival[j] - survival[j + 1] for j in range(NUM_DRAFT + 1)])


def _sample_rows(probs_XV: torch.Tensor, generator) -> torch.Tensor:
    return torch.multinomial(probs_XV, 1, generator=generator)[:, 0]


def _markov_draft(draft_VV):
    """DSpark-style: p_d at position k depends on the token sampled at position k-1."""

    def draft_fn(last_token_B, generator):
        ids, probs = [], []
        previous_B = last_token_B
        for _ in range(NUM_DRAFT):
            probs_BV = draft_VV[previous_B]
            previous_B = _sample_rows(probs_BV, generator)
            ids.append(previous_B)
            probs.append(probs_BV)
        return torch.stack(ids, 1), torch.stack(probs, 1)

    return draft_fn


def _full_length(generator):
    return torch.full((NUM_REQUESTS,), NUM_DRAFT, dtype=torch.long)


def _random_rows(generator, sharpness=1.0):
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=generator) * sharpness, dim=-1)


@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)


def test_one_hot_draft_is_lossless(generator):
    target_VV = _random_rows(generator, 0.5)
    # Deterministic proposal (n-gram / greedy draft): next token = (prev + 1) % V, p_d(x) = 1.
    next_V = (torch.arange(VOCAB) + 1) % VOCAB
    draft_kernel_VV = torch.nn.functional.one_hot(next_V, VOCAB).float()

    def draft_fn(last_token_B, gen):
        ids, previous_B = [], last_token_B
        for _ in range(NUM_DRAFT):
            previous_B = next_V[previous_B]
            ids.append(previous_B)
        return torch.stack(ids, 1), None

    tokens_BN, accepted_B = _speculative_decode(draft_fn, target_VV, T1, _full_length, generator)
    joint = torch.zeros([VOCAB] * NUM_POSITIONS)
    joint.index_put_(tuple(tokens_BN.T), torch.ones(NUM_REQUESTS), accumulate=True)
    _assert_law(joint, _joint_law(target_VV, 0, NUM_POSITIONS))
    _assert_law(torch.bincount(tokens_BN[:, 0], minlength=VOCAB), target_VV[0])
    _assert_law(torch.bincount(accepted_B, minlength=NUM_DRAFT + 1), _accept_count_law(draft_kernel_VV, target_VV))


def test_sampled_independent_draft_is_lossless(generator):
    target_VV = _random_rows(generator, 0.5)
    draft_V = torch.softmax(torch.randn(VOCAB, generator=generator), dim=-1)

    def draft_fn(last_token_B, gen):
        probs_BKV = draft_V.expand(NUM_REQUESTS, NUM_DRAFT, VOCAB)
        ids_BK = _sample_rows(probs_BKV.reshape(-1, VOCAB), gen).view(NUM_REQUESTS, NUM_DRAFT)
        return ids_BK, probs_BKV

    tokens_BN, accepted_B = _speculative_decode(draft_fn, target_VV, T1, _full_length, generator)
    joint = torch.zeros([VOCAB] * NUM_POSITIONS)
    joint.index_put_(tuple(tokens_BN.T), torch.ones(NUM_REQUESTS), accumulate=True)
    _assert_law(joint, _joint_law(target_VV, 0, NUM_POSITIONS))
    for position in range(NUM_POSITIONS):
        marginal = _joint_law(target_VV, 0, position + 1)
        if position > 0:  # sum(dim=()) would sum everything
            marginal = marginal.sum(dim=tuple(range(position)))
        _assert_law(torch.bincount(tokens_BN[:, position], minlength=VOCAB), marginal)
    draft_kernel_VV = draft_V.expand(VOCAB, VOCAB)
    _assert_law(torch.bincount(accepted_B, minlength=NUM_DRAFT + 1), _accept_count_law(draft_kernel_VV, target_VV))


def test_sequential_markov_draft_with_ragged_lengths_is_lossless(generator):
    target_VV = _random_rows(generator, 0.5)
    draft_VV = _random_rows(generator, 1.5)

    def ragged(gen):
        return torch.randint(0, NUM_DRAFT + 1, (NUM_REQUESTS,), generator=gen)

    tokens_BN, _ = _speculative_decode(_markov_draft(draft_VV), target_VV, T1, ragged, generator)
    joint = torch.zeros([VOCAB] * NUM_POSITIONS)
    joint.index_put_(tuple(tokens_BN.T), torch.ones(NUM_REQUESTS), accumulate=True)
    _assert_law(joint, _joint_law(target_VV, 0, NUM_POSITIONS))
    # Negative control: the same counts are far from the draft chain's law (the test has power).
    stat, dof = _chi_square(joint, _joint_law(draft_VV, 0, NUM_POSITIONS))
    assert stat > 10 * dof

    _, accepted_B = _speculative_decode(_markov_draft(draft_VV), target_VV, T1, _full_length,
                                        generator)
    _assert_law(torch.bincount(accepted_B, minlength=NUM_DRAFT + 1), _accept_count_law(draft_VV, target_VV))


def test_draft_restricted_to_a_reduced_vocabulary_is_lossless(generator):
    """A reduced draft vocabulary: the drafter samples from a subset of the vocabulary and hands over that
    distribution zero-extended to the whole vocabulary (what block drafters with d2t do). The target puts mass
    outside the subset; the emitted law is still the target's (residual sampling supplies the outside tokens)."""
    target_VV = _random_rows(generator, 0.5)
    kept = torch.tensor([0, 2, 3])  # draft vocabulary: 3 of the 6 ids
    draft_kept_VK = _random_rows(generator, 1.5)[:, : kept.shape[0]].softmax(dim=-1)
    draft_VV = torch.zeros(VOCAB, VOCAB).index_copy(1, kept, draft_kept_VK)  # zeros outside the draft vocabulary
    assert (target_VV[:, [1, 4, 5]].sum(-1) > 0.2).all(), "the target must put real mass outside the subset"

    tokens_BN, accepted_B = _speculative_decode(_markov_draft(draft_VV), target_VV, T1, _full_length,
                                                generator)
    joint = torch.zeros([VOCAB] * NUM_POSITIONS)
    joint.index_put_(tuple(tokens_BN.T), torch.ones(NUM_REQUESTS), accumulate=True)
    _assert_law(joint, _joint_law(target_VV, 0, NUM_POSITIONS))
    assert torch.isin(tokens_BN, torch.tensor([1, 4, 5])).any(), "tokens outside the draft vocabulary are emitted"
    _assert_law(torch.bincount(accepted_B, minlength=NUM_DRAFT + 1), _accept_count_law(draft_VV, target_VV))


def test_temperature_top_k_top_p_applied_to_both_sides(generator):
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    target_VV = _random_rows(generator, 1.0)
    raw_draft_logits_VV = torch.randn(VOCAB, VOCAB, generator=generator)
    # The draft samples from its own logits processed with the same params.
    draft_VV = probs_from_logits(raw_draft_logits_VV, params)
    filtered_target_VV = probs_from_logits(target_VV.log(), params)
    assert (filtered_target_VV == 0).any(), "the filters should remove some tokens in this setup"

    tokens_BN, accepted_B = _speculative_decode(_markov_draft(draft_VV), target_VV, params, _full_length, generator)
    joint = torch.zeros([VOCAB] * NUM_POSITIONS)
    joint.index_put_(tuple(tokens_BN.T), torch.ones(NUM_REQUESTS), accumulate=True)
    _assert_law(joint, _joint_law(filtered_target_VV, 0, NUM_POSITIONS))
    _assert_law(torch.bincount(accepted_B, minlength=NUM_DRAFT + 1),
                _accept_count_law(draft_VV, filtered_target_VV))
