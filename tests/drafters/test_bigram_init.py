"""DSpark's Markov head from bigrams (`drafter.markov_init=bigram`): the counts are the batcher's (previous
token, supervised next token) pairs, and the head's bias reproduces the bigram log-ratios when its rank covers them."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from deepspec.drafters.build import build_drafter
from deepspec.drafters.dspark.bigram_init import bigram_counts, bigram_log_ratio, init_markov_from_bigrams
from deepspec.drafters.spec import get_drafter_spec

SMALL = {"num_draft_layers": 1, "target_layer_ids": [0, 1, 2]}


def _samples():
    g = torch.Generator().manual_seed(0)
    samples = []
    for length in (12, 9, 15):
        ids_T = torch.randint(20, 30, (length,), generator=g)  # 10 distinct tokens: many repeated pairs
        mask_T = torch.zeros(length, dtype=torch.bool)
        mask_T[3:] = True
        samples.append(SimpleNamespace(input_ids=ids_T, loss_mask=mask_T))
    return samples


def _expected_counts(samples) -> Counter:
    counts = Counter()
    for s in samples:
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        for t in range(len(ids) - 1):
            if mask[t + 1]:
                counts[ids[t], ids[t + 1]] += 1
    return counts


def test_bigram_counts_are_the_pairs_before_each_supervised_token():
    samples = _samples()
    dense = bigram_counts(samples, 32).to_dense()  # token ids < 32
    expected = torch.zeros(32, 32, dtype=torch.float64)
    for (p, n), c in _expected_counts(samples).items():
        expected[p, n] = c
    assert torch.equal(dense, expected) and dense.sum() == sum(int(s.loss_mask[1:].sum()) for s in samples)


def test_log_ratio_is_bigram_log_probability_over_uniform():
    samples = _samples()
    counts = _expected_counts(samples)
    ratio = bigram_log_ratio(bigram_counts(samples, 32), scale=2.0).to_dense()
    totals = Counter()
    for (p, _), c in counts.items():
        totals[p] += c
    for (p, n), c in counts.items():
        assert ratio[p, n].item() == pytest.approx(2.0 * max(math.log(c / totals[p] * 32), 0.0))
    assert int((ratio != 0).sum()) <= len(counts)


def test_markov_head_starts_at_the_bigram_when_its_rank_covers_it(tiny_llama):
    samples = _samples()
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, markov_rank=16, markov_init="bigram", **SMALL)
    rng_before = torch.random.get_rng_state()
    get_drafter_spec("dspark").prepare_for_training(drafter, samples, tiny_llama.tokenizer)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the training run's random stream is untouched
    head = drafter.sequential
    vocab = head.prev_embed.weight.shape[0]
    bias_SV = head.prev_embed.weight[:32].double() @ head.out.weight.double().T  # rows of the tokens used
    ratio = bigram_log_ratio(bigram_counts(samples, vocab))
    ratio_SV = torch.sparse_coo_tensor(ratio.indices(), ratio.values(), (32, vocab), check_invariants=True).to_dense()
    # 10 distinct previous tokens <= rank 16: the truncated SVD is exact up to float32 storage
    assert torch.allclose(bias_SV, ratio_SV, atol=1e-3)
    assert torch.count_nonzero(head.prev_embed.weight[32:]) == 0  # never a previous token: no bias
    counts = _expected_counts(samples)
    for prev in {p for p, _ in counts}:
        best = max(c for (p, _), c in counts.items() if p == prev)
        assert counts[prev, int(bias_SV[prev].argmax())] == best  # the bias's argmax is a most frequent next token


def test_random_init_is_untouched_and_bigram_init_needs_a_markov_head(tiny_llama):
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, markov_rank=8, **SMALL)
    before = drafter.sequential.out.weight.clone()
    init_markov_from_bigrams(drafter, _samples())
    assert torch.equal(drafter.sequential.out.weight, before)
    with pytest.raises(ValueError, match="markov_init"):
        build_drafter("dspark", tiny_llama, markov_rank=8, sequential_head="rnn", markov_init="bigram", **SMALL)
    with pytest.raises(ValueError, match="markov_init"):
        build_drafter("dspark", tiny_llama, markov_rank=8, markov_init="unigram", **SMALL)


def test_bigram_start_with_a_reduced_draft_vocabulary_fits_the_heads_rows(tiny_llama):
    from deepspec.drafters.dspark.bigram_init import draft_row_counts

    samples = _samples()
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, markov_rank=16, markov_init="bigram", draft_vocab_size=64, **SMALL)
    get_drafter_spec("dspark").prepare_for_training(drafter, samples, tiny_llama.tokenizer)  # vocabulary, then W1/W2
    assert drafter.reduced_vocab and int(drafter.t2d[20:30].sum()) == 10  # every assistant token kept
    head = drafter.sequential
    counts = draft_row_counts(drafter, bigram_counts(samples, drafter.config.target_vocab_size),
                              head.prev_embed.weight.shape[0], head.out.weight.shape[0])
    assert counts.values().sum() == sum(_expected_counts(samples).values())
    bias_PC = head.prev_embed.weight.double() @ head.out.weight.double().T
    assert torch.allclose(bias_PC, bigram_log_ratio(counts).to_dense(), atol=1e-3)
    rows = drafter.draft_rows(torch.arange(20, 30))
    for prev, row in zip(range(20, 30), rows.tolist()):
        seen = {n: c for (p, n), c in _expected_counts(samples).items() if p == prev}
        if seen:
            best = int(drafter.target_vocab_index()[int(bias_PC[row].argmax())])
            assert seen[best] == max(seen.values())


def test_most_counted_next_breaks_ties_like_the_bigram_table():
    from deepspec.drafters.dspark.bigram_init import most_counted_next

    # row 0: columns 3 and 1 tie (2 each); row 2: column 4 wins; row 1 is never seen.
    counts = torch.sparse_coo_tensor(torch.tensor([[0, 0, 0, 2, 2], [3, 1, 2, 4, 0]]),
                                     torch.tensor([2.0, 2.0, 1.0, 5.0, 1.0]), (3, 5), check_invariants=True).coalesce()
    rows, best = most_counted_next(counts)
    assert rows.tolist() == [0, 2] and best.tolist() == [1, 4]
    order = torch.tensor([0, 9, 1, 2, 3])  # column 3 has a smaller target id than column 1
    assert most_counted_next(counts, order)[1].tolist() == [3, 4]


def _many_pair_samples(num_prev: int = 60, seed: int = 0):
    """Previous tokens 100..100+num_prev-1, each followed mostly by its own random next token (and some noise)."""
    g = torch.Generator().manual_seed(seed)
    favourite = torch.randint(200, 400, (num_prev,), generator=g)
    ids = []
    for _ in range(6):
        for p in range(num_prev):
            noise = int(torch.randint(200, 400, (1,), generator=g))
            ids += [100 + p, int(favourite[p]), 100 + p, noise]
    ids_T = torch.tensor(ids)
    mask_T = torch.ones_like(ids_T, dtype=torch.bool)
    mask_T[0] = False
    return [SimpleNamespace(input_ids=ids_T, loss_mask=mask_T)], favourite


def test_a_rank_below_the_table_still_puts_the_tables_token_on_top(tiny_llama, monkeypatch):
    """60 previous tokens with their own favourite next token do not fit in rank 8: the selector dimensions make
    each seen row's argmax its most counted next token anyway (the SVD alone does not)."""
    from deepspec.drafters.dspark import bigram_init

    samples, favourite = _many_pair_samples()
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, markov_rank=8, markov_init="bigram", **SMALL)
    fitted = []
    real = bigram_init.complete_argmax
    monkeypatch.setattr(bigram_init, "complete_argmax", lambda *a, **k: fitted.append(real(*a, **k)) or fitted[-1])
    get_drafter_spec("dspark").prepare_for_training(drafter, samples, tiny_llama.tokenizer)
    assert fitted and fitted[0] < 0.9  # the rank-6 fit alone misses rows
    head = drafter.sequential
    bias = head.prev_embed.weight[100:160] @ head.out.weight.T
    assert torch.equal(bias.argmax(dim=1), favourite)


def test_counts_use_the_targets_argmax_where_a_sample_carries_it():
    samples = _samples()
    for s in samples:
        s.target_next = torch.full_like(s.input_ids, 7)  # the target always predicts token 7
    dense = bigram_counts(samples, 32).to_dense()
    assert dense[:, 7].sum() == dense.sum() == sum(int(s.loss_mask[1:].sum()) for s in samples)
