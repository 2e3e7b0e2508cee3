"""Prompt lookup or the drafter, chosen per round: the acceptance table counts what prompt lookup would have kept,
the choice follows the expected accepted lengths (at T > 0 from the first confidence only), and decoding with it
stays the target's greedy output token for token."""

from __future__ import annotations

import pytest
import torch

from deepspec.decoding.combined import LookupOrDrafterProposer, expected_accepted
from deepspec.decoding.lookup import LookupAcceptance, prompt_lookup_match
from deepspec.decoding.loop import autoregressive_generate, speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.build import build_drafter
from deepspec.drafters.proposers import make_proposer

GREEDY = SamplingParams(temperature=0.0)


def _brute_force(tokens, target_next, anchors, num_tokens, max_ngram):
    accepted = [[0] * num_tokens for _ in range(max_ngram)]
    reached = [[0] * num_tokens for _ in range(max_ngram)]
    for a in range(len(tokens)):
        if not anchors[a]:
            continue
        drafts, n = prompt_lookup_match(tokens[: a + 1], num_tokens, max_ngram)
        for j, token in enumerate(drafts):
            if a + j >= len(tokens) or not anchors[a + j]:
                break
            reached[n - 1][j] += 1
            if token != target_next[a + j]:
                break
            accepted[n - 1][j] += 1
    return accepted, reached


def test_lookup_acceptance_counts_what_prompt_lookup_would_have_kept():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (80,), generator=g)  # 5 symbols: many n-gram matches
    target_next = torch.cat([tokens[1:], tokens[:1]])
    target_next[::7] = 9  # the target disagrees with the data now and then
    anchors = torch.ones(80, dtype=torch.bool)
    anchors[:5] = False
    anchors[-1] = False
    table = LookupAcceptance.fit([(tokens, target_next, anchors)], num_tokens=4, max_ngram=3)
    accepted, reached = _brute_force(tokens.tolist(), target_next.tolist(), anchors.tolist(), 4, 3)
    assert (table.accepted, table.reached) == (accepted, reached)
    assert sum(map(sum, reached)) > 0 and sum(map(sum, accepted)) > 0
    assert table.conditional(3, 2) == [(accepted[2][j] + 1) / (reached[2][j] + 2) for j in range(2)]
    assert LookupAcceptance.from_dict(table.to_dict()) == table
    with pytest.raises(ValueError, match="accepted counts"):
        LookupAcceptance(1, 1, [[3]], [[2]])


def test_expected_accepted_reads_only_the_first_confidence_when_sampling():
    c = torch.tensor([0.5, 0.9, 0.1])
    assert expected_accepted(c, greedy=True) == pytest.approx(0.5 + 0.45 + 0.045)
    assert expected_accepted(c, greedy=False) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(torch.tensor([0.5, 0.0, 0.0]), greedy=False) == expected_accepted(c, greedy=False)


def _table(rate: float, num_tokens: int = 4) -> dict:
    """A table whose every conditional acceptance is about `rate` (1000 lookups per cell)."""
    return LookupAcceptance(3, num_tokens, [[int(rate * 1000)] * num_tokens] * 3, [[1000] * num_tokens] * 3).to_dict()


@pytest.mark.float_exact
@pytest.mark.parametrize("rate", [0.02, 0.5, 0.98])
def test_greedy_output_is_the_targets_whichever_proposal_is_chosen(tiny_llama, rate):
    model = tiny_llama.model
    prompt = [1, 5, 7, 5, 7, 5, 7, 9, 11, 5, 7]
    reference = autoregressive_generate(TargetVerifier(model, []), prompt, 24, GREEDY).token_ids
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=1, markov_rank=16, block_size=5)
    drafter.config.prompt_lookup_acceptance = _table(rate)
    proposer = make_proposer(drafter, model, with_prompt_lookup=True)
    assert isinstance(proposer, LookupOrDrafterProposer)
    result = speculative_generate(TargetVerifier(model, drafter.config.target_layer_ids), proposer, prompt, 24, GREEDY)
    assert result.token_ids == reference
    assert proposer.rounds == len(result.rounds)
    if rate == 0.98:
        assert proposer.lookup_rounds > 0
    if rate == 0.02:
        assert proposer.lookup_rounds == 0  # an untrained drafter's confidences ~0.5 beat a 2% lookup


def test_an_uncalibrated_drafter_is_refused(tiny_llama):
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=1, markov_rank=16, block_size=5)
    with pytest.raises(ValueError, match="calibrate it first"):
        make_proposer(drafter, tiny_llama.model, with_prompt_lookup=True)


@pytest.mark.float_exact
def test_the_batched_loop_serves_it_per_request_and_stays_greedy_equal(tiny_llama):
    from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
    from deepspec.drafters.proposers import make_batch_proposer

    model = tiny_llama.model
    prompts = [[1, 5, 7, 5, 7, 5, 7, 9, 11, 5, 7], [2, 4, 6, 8, 4, 6], [3, 3, 3, 3, 3, 3, 3, 3]]
    references = [autoregressive_generate(TargetVerifier(model, []), p, 20, GREEDY).token_ids for p in prompts]
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=1, markov_rank=16, block_size=5)
    drafter.config.prompt_lookup_acceptance = _table(0.98)
    proposer = make_batch_proposer(drafter, model, with_prompt_lookup=True)
    made, factory = [], proposer.factory  # finished rows leave the proposer: keep each request's for its counts
    proposer.factory = lambda: made.append(factory()) or made[-1]
    out = batched_speculative_generate(model, proposer, [BatchRequest(p, 20) for p in prompts], GREEDY,
                                       settings=ServingSettings(max_concurrency=2,
                                                                layer_ids=drafter.config.target_layer_ids))
    assert [r.token_ids for r in out.requests] == references
    assert len(made) == 3 and all(isinstance(p, LookupOrDrafterProposer) for p in made)
    assert sum(p.lookup_rounds for p in made) > 0  # rounds that drafted with prompt lookup
