"""Reduced draft vocabulary: SGLang/vLLM d2t offsets and t2d mask, counting, round trips, bad input."""

from __future__ import annotations

import pytest
import torch

from deepspec.cache.reader import CachedSample
from deepspec.drafters.draft_vocab import (
    build_draft_vocab,
    check_draft_vocab,
    count_assistant_tokens,
    draft_to_target,
    kept_target_ids,
    target_to_draft,
)


def test_top_counts_kept_sorted_with_offsets():
    counts = torch.tensor([0, 5, 0, 9, 1, 7, 0, 2, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    # Most frequent: 3 (9), 5 (7), 1 (5), 9 (3) -> ascending [1, 3, 5, 9]; offsets = id - draft index.
    assert d2t.tolist() == [1 - 0, 3 - 1, 5 - 2, 9 - 3]
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert torch.nonzero(t2d).squeeze(1).tolist() == [1, 3, 5, 9]
    assert kept_target_ids(d2t).tolist() == [1, 3, 5, 9]
    check_draft_vocab(d2t, t2d)


def test_special_tokens_always_kept_and_ties_by_lower_id():
    counts = torch.tensor([4, 4, 0, 4, 4, 0])
    d2t, t2d = build_draft_vocab(counts, 3, always_keep=[2])
    # eos-like id 2 (never counted) is kept; ties among 0,1,3,4 keep the lowest ids.
    assert kept_target_ids(d2t).tolist() == [0, 1, 2]
    assert bool(t2d[2])


def test_round_trip_draft_target_draft_and_outside_ids():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 100, (500,), generator=g)
    d2t, t2d = build_draft_vocab(counts, 64, always_keep=[0, 1, 2])
    draft_ids = torch.arange(64)
    target_ids = draft_to_target(draft_ids, d2t)
    assert torch.equal(target_to_draft(target_ids, t2d), draft_ids)
    assert bool(t2d[target_ids].all())
    outside = torch.nonzero(~t2d).squeeze(1)[:10]
    assert target_to_draft(outside, t2d).tolist() == [-1] * 10
    # Target -> draft -> target is exact on kept ids (2-D input keeps its shape).
    kept_2d = target_ids.reshape(8, 8)
    assert torch.equal(draft_to_target(target_to_draft(kept_2d, t2d), d2t), kept_2d)


def test_counts_only_assistant_tokens_from_samples():
    samples = [
        CachedSample("a", torch.tensor([5, 6, 7, 7]), torch.tensor([False, False, True, True]),
                     torch.zeros(4, 2), torch.zeros(4, 2)),
        CachedSample("b", torch.tensor([6, 8]), torch.tensor([True, True]), torch.zeros(2, 2), torch.zeros(2, 2)),
    ]
    counts = count_assistant_tokens(samples, 10)
    assert counts.tolist() == [0, 0, 0, 0, 0, 0, 1, 2, 1, 0]  # the prompt's 5 and 6 are not counted
    d2t, _ = build_draft_vocab(samples, 3, vocab_size=10, always_keep=[2])
    assert kept_target_ids(d2t).tolist() == [2, 6, 7]


def test_bad_input_raises():
    counts = torch.ones(10, dtype=torch.long)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 11)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 0)
    with pytest.raises(ValueError, match="always_keep"):
        build_draft_vocab(counts, 3, always_keep=[12])
    with pytest.raises(ValueError, match="vocab_size is required"):
        build_draft_vocab([], 3)
    d2t, t2d = build_draft_vocab(counts, 3)
    with pytest.raises(ValueError, match="draft ids"):
        draft_to_target(torch.tensor([3]), d2t)
    with pytest.raises(ValueError, match="disagree"):
        check_draft_vocab(d2t + 1, t2d)
