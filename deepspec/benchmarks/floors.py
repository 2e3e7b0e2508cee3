"""Drafter-free floors on a feature cache: what a trained drafter must beat, in the drafters' own metrics.

* Bigram table (`cache_bigram_table`): anchor token -> the target's most frequent argmax next token at the
  anchors of the training split (`deepspec.decoding.lookup.bigram_table`; the target's argmax comes from the
  frozen LM head on the cached final hidden state, so it is the target's prediction, not the data's label).
* Prompt lookup (`deepspec.decoding.lookup.prompt_lookup`): n-gram match in the sequence up to the anchor.

`floor_validation` scores both on the validation blocks a block drafter is validated on (the kind's batcher,
`deepspec.drafters.block.batching`): the same anchors, slots and supervised rows, so its numbers sit next to
a drafter's `top1_agreement`, `tau_sim` and `tau_greedy_sim`. Per row (slot j of the block at anchor a):
the bigram proposes `table[x[a + j]]` from the ground-truth previous token (as DSpark's Markov head is
trained); prompt lookup proposes the j-th token of its lookup from `x[:a + 1]`. A deterministic proposal y
is accepted with probability p_t(y) at T = 1 (the TV of a one-hot is 2 (1 - p_t(y))) and matches at T = 0
when y is the target's argmax; an unknown entry (no table row, lookup too short) is a rejection.

Shape legend: T = tokens, N = block rows, H = hidden, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from deepspec.cache.reader import argmax_next_tokens
from deepspec.decoding.lookup import UNKNOWN, bigram_table, prompt_lookup
from deepspec.losses.distribution import IGNORE_INDEX, DistributionTerms
from deepspec.losses.metrics import AcceptanceMetrics

FLOORS = ("bigram", "prompt_lookup")


def anchor_positions(loss_mask_T: torch.Tensor) -> torch.Tensor:
    """Positions a block drafter drafts after (the batcher's rule): loss_mask[a] & loss_mask[a + 1]."""
    mask_T = loss_mask_T.bool()
    return torch.nonzero(mask_T[:-1] & mask_T[1:]).flatten()


def cache_bigram_table(samples: Iterable, head_VH: torch.Tensor) -> torch.Tensor:
    """LongTensor [V]: anchor token -> the target's most frequent argmax after it, over every anchor of `samples`
    (cached samples with input_ids, loss_mask, final_hidden); UNKNOWN for tokens never seen as an anchor."""
    def rows():
        for sample in samples:
            anchors = anchor_positions(sample.loss_mask)
            yield (sample.input_ids[anchors].long(), argmax_next_tokens(sample.final_hidden[anchors], head_VH),
                   torch.ones_like(anchors, dtype=torch.bool))

    return bigram_table(rows(), head_VH.shape[0])


def _floor_tokens(name: str, batch, table: list[int], sequences: list[list[int]]) -> torch.Tensor:
    """The floor's proposal at every row of a packed block batch (UNKNOWN where it has none)."""
    if name == "bigram":
        return torch.tensor([table[t] for t in batch.prev_ids_N.tolist()], dtype=torch.long)
    g = batch.block_size
    anchors, seqs = batch.anchor_positions_B.tolist(), batch.block_seq_id_B.tolist()
    tokens = []
    for anchor, seq in zip(anchors, seqs):
        proposal = prompt_lookup(sequences[seq][: anchor + 1], g)
        tokens.extend(proposal[j] if j < len(proposal) else UNKNOWN for j in range(g))
    return torch.tensor(tokens, dtype=torch.long)


@torch.no_grad()
def floor_validation(samples: Sequence, collate, table_V: torch.Tensor, head_VH: torch.Tensor,
                     seqs_per_batch: int = 4) -> dict[str, dict]:
    """Bigram and prompt-lookup metrics on the blocks `collate(samples, epoch=0)` builds (module docstring).

    Returns {floor: AcceptanceMetrics.compute() as plain lists/floats}."""
    table = table_V.tolist()
    metrics = {name: None for name in FLOORS}
    next_block = 0
    for start in range(0, len(samples), seqs_per_batch):
        group = [s for s in samples[start:start + seqs_per_batch] if anchor_positions(s.loss_mask).numel()]
        if not group:
            continue
        batch = collate(group, 0)
        logits_NV = (batch.target_hidden_NH.to(head_VH.dtype) @ head_VH.T).float()
        probs_NV = torch.softmax(logits_NV, dim=-1)
        argmax_N = logits_NV.argmax(dim=-1)
        valid_N = batch.labels_N != IGNORE_INDEX
        blocks_N = batch.block_index_N + next_block
        next_block += int(batch.anchor_positions_B.shape[0])
        sequences = [s.input_ids.long().tolist() for s in group]
        for name in FLOORS:
            tokens_N = _floor_tokens(name, batch, table, sequences)
            known_N = tokens_N != UNKNOWN
            p_N = torch.where(known_N, probs_NV.gather(1, tokens_N.clamp(min=0)[:, None])[:, 0],
                              torch.zeros_like(argmax_N, dtype=probs_NV.dtype))
            agree_N = known_N & (tokens_N == argmax_N)
            terms = DistributionTerms(ce_N=None, tv_N=2.0 * (1.0 - p_N), soft_ce_N=None,
                                      draft_argmax_N=torch.where(agree_N, argmax_N, torch.full_like(argmax_N, -1)),
                                      target_argmax_N=argmax_N, valid_N=valid_N)
            if metrics[name] is None:
                metrics[name] = AcceptanceMetrics(batch.block_size)
            metrics[name].update(terms, batch.position_index_N, blocks_N)
    return {name: _plain(m.compute()) for name, m in metrics.items() if m is not None}


def _plain(computed: dict) -> dict:
    return {k: ([round(float(x), 5) for x in v] if isinstance(v, torch.Tensor) else v) for k, v in computed.items()}
