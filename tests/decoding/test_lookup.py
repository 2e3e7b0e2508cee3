"""Floors: prompt lookup and bigram proposers, and the bigram table."""

import torch

from deepspec.decoding.lookup import (
    UNKNOWN,
    BigramProposer,
    PromptLookupProposer,
    bigram_table,
    prompt_lookup,
)
from deepspec.decoding.loop import autoregressive_generate, speculative_generate
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.verifier import TargetVerifier


def test_prompt_lookup_prefers_longest_ngram_then_first_occurrence():
    history = [5, 1, 2, 9, 9, 3, 1, 2, 7, 8, 4, 1, 2]
    # no earlier [4, 1, 2]; the bigram [1, 2] first occurs at 1 -> its continuation
    assert prompt_lookup(history, 3) == [9, 9, 3]
    # the trigram [0, 1, 2] first occurs at 3 (the bigram [1, 2] earlier, at 0)
    assert prompt_lookup([1, 2, 6, 0, 1, 2, 5, 0, 1, 2], 2) == [5, 0]


def test_prompt_lookup_trigram_beats_earlier_bigram():
    history = [1, 2, 4, 4, 0, 1, 2, 5, 5, 0, 1, 2]
    assert prompt_lookup(history, 2, max_ngram=3) == [5, 5]
    assert prompt_lookup(history, 2, max_ngram=2) == [4, 4]


def test_prompt_lookup_without_match_proposes_nothing():
    assert prompt_lookup([1, 2, 3, 4], 5) == []
    assert prompt_lookup([7], 5) == []


def test_bigram_table_picks_most_frequent_next_with_smallest_id_on_ties():
    tokens = torch.tensor([3, 3, 3, 4, 4, 5, 5, 6])
    nexts = torch.tensor([1, 2, 2, 9, 8, 0, 0, 1])
    counted = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0])
    table = bigram_table([(tokens, nexts, counted)], vocab_size=10)
    assert table[3] == 2  # 2 seen twice, 1 once
    assert table[4] == 8  # tie 9/8 -> smaller id
    assert table[5] == 0
    assert table[6] == UNKNOWN  # never counted
    assert table[0] == UNKNOWN


def test_bigram_proposer_chains_until_unknown():
    table = torch.full((10,), UNKNOWN, dtype=torch.long)
    table[1], table[2], table[3] = 2, 3, 1
    proposer = BigramProposer(table, num_draft_tokens=5)
    proposer.reset(torch.tensor([4, 4]))
    assert proposer.propose(1, 2).token_ids_BK.tolist() == [[2, 3, 1, 2, 3]]
    proposer.on_accept(torch.tensor([1, 2]))
    assert proposer.propose(9, 4).num_tokens == 0


def test_floor_proposers_are_lossless_greedy(tiny_llama):
    model = tiny_llama.model
    verifier = TargetVerifier(model, [0])
    prompt = [1, 5, 7, 5, 7, 5, 7, 9, 11]
    greedy = SamplingParams(temperature=0.0)
    reference = autoregressive_generate(verifier, prompt, 24, greedy).token_ids
    table = torch.randint(0, model.config.vocab_size, (model.config.vocab_size,))
    for proposer in (PromptLookupProposer(num_draft_tokens=4), BigramProposer(table, num_draft_tokens=4)):
        out = speculative_generate(verifier, proposer, prompt, 24, greedy)
        assert out.token_ids == reference
        assert sum(r.proposed for r in out.rounds) > 0


def test_bigram_table_of_the_greedy_chain_is_accepted_in_full(tiny_llama):
    """A table holding the target's own greedy transitions proposes its continuation: every draft accepted."""
    model = tiny_llama.model
    verifier = TargetVerifier(model, [0])
    greedy = SamplingParams(temperature=0.0)
    prompt = [10, 20, 30]  # the tiny random target's greedy continuation repeats one token
    out = autoregressive_generate(verifier, prompt, 16, greedy).token_ids
    chain = torch.tensor(prompt[-1:] + out)
    successors = {}
    for a, b in zip(chain[:-1].tolist(), chain[1:].tolist()):
        successors.setdefault(a, set()).add(b)
    assert all(len(s) == 1 for s in successors.values()), \
        "tiny target's greedy chain is not a function of the last token"
    table = bigram_table([(chain[:-1], chain[1:], torch.ones(len(chain) - 1))], model.config.vocab_size)
    result = speculative_generate(verifier, BigramProposer(table, num_draft_tokens=4), prompt, 16, greedy)
    assert result.token_ids == out
    assert all(r.accepted == r.proposed for r in result.rounds)
    assert len(result.rounds) < len(out)
