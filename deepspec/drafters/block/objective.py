"""Training-objective pieces shared by the block drafters: run the drafter on a `BlockBatch`, then the
per-row CE/TV terms against the target distribution p_t = softmax(final_hidden @ lm_head^T) (the frozen LM
head on the cached final hidden state, temperature 1) with the chunked `distribution_terms`. A sequential
head's bias is passed as its low-rank pair, so no [N, V] bias is materialised.

Position weights `w_k = exp(-(k-1)/gamma)` over the drafts of a block (k = 1..K, K = `num_drafts`: draft 1
is slot 0 for anchor-predicts, slot 1 for mask-predicts), gamma = `loss.gamma` (4.0 by default: DeepSpec's
reference code; the paper writes gamma = block size).

Shape legend: N = draft rows, H = hidden, K = drafts per block.
"""

from __future__ import annotations

import torch

from deepspec.drafters.block.batching import BlockBatch
from deepspec.losses.distribution import DistributionTerms, distribution_terms
from deepspec.losses.position_weights import position_weights


def block_terms(drafter, batch: BlockBatch, chunk_rows: int, need: tuple[str, ...]):
    """(drafter output, per-row `DistributionTerms`) of every packed block."""
    out = drafter(batch)
    head_VH = drafter.target_parts.lm_head_weight
    if drafter.target_parts.final_logit_softcapping:
        raise ValueError("targets with final_logit_softcapping are not supported by the chunked block losses")
    terms: DistributionTerms = distribution_terms(
        out.hidden_NH, head_VH, batch.target_hidden_NH.to(out.hidden_NH.dtype), head_VH, batch.labels_N,
        draft_bias=out.bias, chunk_rows=chunk_rows, need=need)
    return out, terms


def block_position_weights(batch: BlockBatch, gamma: float, like: torch.Tensor) -> torch.Tensor:
    """`w_K` for the batch's drafts per block, on `like`'s device."""
    return position_weights(batch.num_drafts, gamma).to(like.device)
