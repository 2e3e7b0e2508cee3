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
from deepspec.losses.distribution import (
    IGNORE_INDEX,
    DistributionTerms,
    ReducedVocab,
    TermsOptions,
    distribution_terms,
)
from deepspec.losses.position_weights import position_weights
from deepspec.utils.phases import phase

MISSING_LSE = ("a reduced draft vocabulary (drafter.draft_vocab_size) needs the target's log-normaliser per token, "
               "which these samples do not hold (a feature cache stores it): train with drafter.draft_vocab_size=null "
               "or on samples that hold it")


def block_terms(drafter, batch: BlockBatch, options: TermsOptions, with_metrics: bool = True):
    """(drafter output, per-row `DistributionTerms`) of every packed block; `with_metrics=False` (a training
    step, which reads no argmax) lets a reduced vocabulary skip resolving target argmaxes outside it.
    `options`: the terms computed and how (`LossParams.terms_options`).

    With a reduced draft vocabulary the draft rows are the head's kept rows, the target side is exact through
    the cached log-normaliser (`ReducedVocab.target_lse_N`: TV counts the target mass outside the
    draft vocabulary) and a label outside the draft vocabulary is ignored by CE only (its CE is 0: the drafter
    cannot name it), while its row stays supervised for TV, confidence and the acceptance metrics.
    """
    with phase("forward"):
        out = drafter(batch)
    head_VH = drafter.target_parts.lm_head_weight
    if drafter.target_parts.final_logit_softcapping:
        raise ValueError("targets with final_logit_softcapping are not supported by the chunked block losses")
    labels_N, reduced = batch.labels_N, None
    if drafter.reduced_vocab:
        if batch.target_lse_N is None:
            raise ValueError(MISSING_LSE)
        draft_labels_N = drafter.draft_rows(labels_N.clamp(min=0))
        outside_N = (labels_N == IGNORE_INDEX) | (draft_labels_N == drafter.config.draft_vocab_size)
        labels_N = torch.where(outside_N, IGNORE_INDEX, draft_labels_N)
        reduced = ReducedVocab(drafter.target_vocab_index(), batch.target_lse_N, exact_target_argmax=with_metrics)
    terms: DistributionTerms = distribution_terms(
        out.hidden_NH, drafter.draft_head_weight(), batch.target_hidden_NH.to(out.hidden_NH.dtype), head_VH,
        labels_N, draft_bias=out.bias, reduced=reduced, options=options)
    terms.valid_N = batch.labels_N != IGNORE_INDEX
    return out, terms


def block_position_weights(batch: BlockBatch, gamma: float, like: torch.Tensor) -> torch.Tensor:
    """`w_K` for the batch's drafts per block, on `like`'s device."""
    return position_weights(batch.num_drafts, gamma).to(like.device)
