"""Training-objective pieces shared by the chain drafters (Eagle3, MTP): per-step terms on a packed batch.

Both run on an `AutoregressiveBatch` (chain/batching.py) and return the same `StepResult` as the block
drafters, so metrics code treats them alike:
- rows are the supervised (row t, step/module s) pairs: those whose label token is an assistant token
  of the same sequence; `position_index_N` = TTT step / MTP module index (0-based), `block_index_N` =
  the flattened row t (b * T + t), so one "block" is the draft chain that starts after target row t.
- step s at row t predicts x[t + label_shift]; its target distribution is the frozen LM head on the
  cached final hidden one token earlier, restricted to the draft vocabulary and renormalised when it is
  reduced (a row whose label lies outside the draft vocabulary is then not scored: valid_N False).
The per-kind combinations live with the kinds (eagle3/objective.py, mtp/objective.py).

Shape legend: B = rows, T = tokens, H = hidden, N = supervised rows of one step, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from deepspec.drafters.chain.batching import (
    AutoregressiveBatch,
    labels_at_shift,
    shift_within_sequence,
)
from deepspec.drafters.draft_vocab import target_to_draft
from deepspec.losses.distribution import (
    IGNORE_INDEX,
    DistributionTerms,
    ReducedVocab,
    TermsOptions,
    distribution_terms,
)

STEP_TERMS = ("ce", "tv", "soft_ce")


def check_chain_batch(drafter, batch) -> None:
    if not isinstance(batch, AutoregressiveBatch):
        raise TypeError(f"{drafter.config.drafter_kind} objective needs an AutoregressiveBatch "
                        f"(collate_autoregressive), got {type(batch).__name__}")
    if batch.final_hidden_BTH is None:
        raise ValueError(f"{drafter.config.drafter_kind} trains against the target's final hidden states; this batch "
                         "comes from a top-k log-prob cache (rebuild the cache with cache.content=hidden_states)")
    if drafter.target_parts.final_logit_softcapping:
        raise ValueError("targets with final_logit_softcapping are not supported by the chunked losses")


def step_terms(batch: AutoregressiveBatch, draft_hidden_BTH: torch.Tensor, draft_head_VH: torch.Tensor,
               target_head_VH: torch.Tensor, label_shift: int, t2d_V: torch.Tensor | None,
               target_vocab_index: torch.Tensor | None,
               options: TermsOptions) -> tuple[DistributionTerms, torch.Tensor]:
    """Terms of the rows whose label x[t + label_shift] is supervised; returns them and their flat row ids."""
    labels_BT = labels_at_shift(batch.input_ids_BT, batch.loss_mask_BT, batch.sequence_ids_BT, label_shift)
    # The target distribution over x[t + label_shift] comes from the target's final hidden one token earlier.
    target_hidden_BTH, _ = shift_within_sequence(batch.final_hidden_BTH, batch.sequence_ids_BT, label_shift - 1, 0.0)
    keep_BT = labels_BT != IGNORE_INDEX
    # A host sync, kept: the supervised rows are a variable-size set, and only they pay for the [N, V] terms.
    rows_N = torch.nonzero(keep_BT.flatten()).squeeze(1)
    labels_N = labels_BT.flatten()[rows_N]
    if t2d_V is not None:
        labels_N = target_to_draft(labels_N, t2d_V, check_values=options.check_values)
        labels_N = torch.where(labels_N < 0, torch.full_like(labels_N, IGNORE_INDEX), labels_N)
    hidden_size = draft_hidden_BTH.shape[-1]
    terms = distribution_terms(
        draft_hidden_BTH.reshape(-1, hidden_size)[rows_N], draft_head_VH,
        target_hidden_BTH.reshape(-1, target_hidden_BTH.shape[-1])[rows_N].to(draft_hidden_BTH.dtype), target_head_VH,
        labels_N, reduced=None if target_vocab_index is None else ReducedVocab(target_vocab_index),
        options=replace(options, need=STEP_TERMS))
    return terms, rows_N


def merge_step_terms(terms_per_step: list[DistributionTerms], step_rows: list[torch.Tensor]):
    """One DistributionTerms over all steps, with position (step) and block (row) indices."""
    merged = DistributionTerms(**{name: torch.cat([getattr(t, name) for t in terms_per_step])
                                  for name in ("ce_N", "tv_N", "soft_ce_N", "draft_argmax_N", "target_argmax_N",
                                               "valid_N")},
                               checkpoint=terms_per_step[0].checkpoint if terms_per_step else None)
    position_index_N = torch.cat([torch.full_like(rows, step) for step, rows in enumerate(step_rows)])
    block_index_N = torch.cat(step_rows)
    return merged, position_index_N, block_index_N
