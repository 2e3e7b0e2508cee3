"""Floors on a cache: the bigram table counts the target's argmax, and the floor metrics score exactly the rows
a block drafter is validated on (checked against brute-force loops over the same anchors)."""

from __future__ import annotations

from collections import Counter

import torch

from deepspec.benchmarks.floors import anchor_positions, cache_bigram_table, floor_validation
from deepspec.cache.reader import CacheReader, argmax_next_tokens
from deepspec.decoding.lookup import UNKNOWN, prompt_lookup
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.spec import ANCHOR_PREDICTS


def _head(tiny_llama):
    return tiny_llama.model.get_output_embeddings().weight.detach()


def test_bigram_table_holds_the_most_frequent_target_argmax_after_each_anchor_token(tiny_cache, tiny_llama):
    reader = CacheReader(tiny_cache)
    samples = [reader[i] for i in reader.split("train")]
    head = _head(tiny_llama)
    table = cache_bigram_table(samples, head)
    counts: dict[int, Counter] = {}
    for s in samples:
        argmax = argmax_next_tokens(s.final_hidden, head)
        for a in anchor_positions(s.loss_mask).tolist():
            counts.setdefault(int(s.input_ids[a]), Counter())[int(argmax[a])] += 1
    assert counts
    for token, seen in counts.items():
        best = max(seen.values())
        assert int(table[token]) == min(t for t, c in seen.items() if c == best)
    assert all(int(table[t]) == UNKNOWN for t in range(head.shape[0]) if t not in counts)


def test_floor_metrics_score_the_validation_blocks_of_the_block_batcher(tiny_cache, tiny_llama):
    reader = CacheReader(tiny_cache)
    head = _head(tiny_llama)
    samples = [reader[i] for i in reader.split("validation")]
    table = cache_bigram_table((reader[i] for i in reader.split("train")), head)
    block_size = 4
    builder = BlockBatchBuilder(block_size, 3, max_anchors_per_seq=5, seed=0, block_convention=ANCHOR_PREDICTS)
    result = floor_validation(samples, builder.collate, table, head, seqs_per_batch=3)
    # per floor and slot: [argmax matches, sum of p_t(proposal), rows]
    agree = {name: [[0, 0.0, 0] for _ in range(block_size)] for name in ("bigram", "prompt_lookup")}
    for s in samples:
        ids, mask, argmax = s.input_ids.long().tolist(), s.loss_mask.bool(), argmax_next_tokens(s.final_hidden, head)
        probs = torch.softmax(s.final_hidden @ head.T, dim=-1)
        for a in builder.sample_anchors(s, 0).tolist():
            lookup = prompt_lookup(ids[: a + 1], block_size)
            for j in range(block_size):
                if a + j + 1 >= len(ids) or not mask[a + j + 1]:
                    break  # the block is cut at its first unsupervised slot (the batcher's label rule)
                proposals = {"bigram": int(table[ids[a + j]]),
                             "prompt_lookup": lookup[j] if j < len(lookup) else UNKNOWN}
                for name, token in proposals.items():
                    agree[name][j][0] += token == int(argmax[a + j])
                    agree[name][j][1] += float(probs[a + j, token]) if token != UNKNOWN else 0.0
                    agree[name][j][2] += 1
    for name, per_slot in agree.items():
        top1 = [hits / rows for hits, _, rows in per_slot]
        accepted = [p / rows for _, p, rows in per_slot]  # a one-hot proposal y is accepted w.p. p_t(y) at T=1
        assert torch.allclose(torch.tensor(result[name]["top1_agreement"]), torch.tensor(top1), atol=1e-5), name
        assert torch.allclose(torch.tensor(result[name]["expected_acceptance"]), torch.tensor(accepted),
                              atol=1e-5), name
        assert all(p > 0 for p in accepted) and 1.0 <= result[name]["tau_greedy_sim"] <= block_size + 1
        assert 1.0 < result[name]["tau_sim"] <= block_size + 1
