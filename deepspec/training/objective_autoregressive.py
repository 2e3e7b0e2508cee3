"""Training objectives of the autoregressive drafters: Eagle3 (TTT, soft CE) and MTP (per-module CE or KL).

Both run on an `AutoregressiveBatch` (deepspec.drafters.batching_autoregressive) and return the same
`StepResult` as the block drafters, so metrics code treats them alike:
- rows are the supervised (row t, step/module s) pairs: those whose label token is an assistant token
  of the same sequence; `position_index_N` = TTT step / MTP module index (0-based), `block_index_N` =
  the flattened row t (b * T + t), so one "block" is the draft chain that starts after target row t.
- Eagle3 step s at row t predicts x[t+2+s]; its target distribution is the frozen LM head on the cached
  final hidden at t+1+s (which predicts x[t+2+s]), restricted to the draft vocabulary and renormalised
  when it is reduced. Loss: `sum_s decay^s * mean(soft_ce_s)` (decay = config.ttt_decay, 0.8). With a
  reduced vocabulary a row whose label lies outside the draft vocabulary is not scored (valid_N False).
- MTP module k (1-based) at row t predicts x[t+k+1]; its target distribution comes from the final hidden
  at t+k. Loss: `lambda / D * sum_k mean(CE_k)` (or soft CE against p_t with config.use_target_kl).

Shape legend: B = rows, T = tokens, H = hidden, N = supervised rows of one step, V = vocabulary.
"""

from __future__ import annotations

import torch

from deepspec.drafters.batching_autoregressive import (
    IGNORE_INDEX,
    AutoregressiveBatch,
    labels_at_shift,
    shift_within_sequence,
)
from deepspec.drafters.draft_vocab import target_to_draft
from deepspec.losses.distribution import DistributionTerms, distribution_terms
from deepspec.losses.objectives import eagle3_objective, mtp_objective
from deepspec.losses.position_weights import ttt_step_weights
from deepspec.training.objective import LossConfig, StepResult, register_objective

_NEED = ("ce", "tv", "soft_ce")


def _check_batch(drafter, batch) -> None:
    if not isinstance(batch, AutoregressiveBatch):
        raise TypeError(f"{drafter.config.drafter_kind} objective needs an AutoregressiveBatch "
                         f"(collate_autoregressive), got {type(batch).__name__}")
    if drafter.target_parts.final_logit_softcapping:
        raise ValueError("targets with final_logit_softcapping are not supported by the chunked losses")


def _step_terms(batch: AutoregressiveBatch, draft_hidden_BTH: torch.Tensor, draft_head_VH: torch.Tensor,
                target_head_VH: torch.Tensor, label_shift: int, t2d_V: torch.Tensor | None,
                target_vocab_index: torch.Tensor | None, chunk_rows: int) -> tuple[DistributionTerms, torch.Tensor]:
    """Terms of the rows whose label x[t + label_shift] is supervised; returns them and their flat row ids."""
    labels_BT = labels_at_shift(batch.input_ids_BT, batch.loss_mask_BT, batch.sequence_ids_BT, label_shift)
    # The target distribution over x[t + label_shift] comes from the target's final hidden one token earlier.
    target_hidden_BTH, _ = shift_within_sequence(batch.final_hidden_BTH, batch.sequence_ids_BT, label_shift - 1, 0.0)
    keep_BT = labels_BT != IGNORE_INDEX
    rows_N = torch.nonzero(keep_BT.flatten()).squeeze(1)
    labels_N = labels_BT.flatten()[rows_N]
    if t2d_V is not None:
        labels_N = target_to_draft(labels_N, t2d_V)
        labels_N = torch.where(labels_N < 0, torch.full_like(labels_N, IGNORE_INDEX), labels_N)
    hidden_size = draft_hidden_BTH.shape[-1]
    terms = distribution_terms(
        draft_hidden_BTH.reshape(-1, hidden_size)[rows_N], draft_head_VH,
        target_hidden_BTH.reshape(-1, target_hidden_BTH.shape[-1])[rows_N].to(draft_hidden_BTH.dtype), target_head_VH,
        labels_N, target_vocab_index=target_vocab_index, chunk_rows=chunk_rows, need=_NEED)
    return terms, rows_N


def _merge(step_terms: list[DistributionTerms], step_rows: list[torch.Tensor]):
    """One DistributionTerms over all steps, with position (step) and block (row) indices."""
    merged = DistributionTerms(**{name: torch.cat([getattr(t, name) for t in step_terms])
                                  for name in ("ce_N", "tv_N", "soft_ce_N", "draft_argmax_N", "target_argmax_N",
                                               "valid_N")})
    position_index_N = torch.cat([torch.full_like(rows, step) for step, rows in enumerate(step_rows)])
    block_index_N = torch.cat(step_rows)
    return merged, position_index_N, block_index_N


@register_objective("eagle3")
def eagle3_training_objective(drafter, batch: AutoregressiveBatch, loss_cfg: LossConfig) -> StepResult:
    _check_batch(drafter, batch)
    config = drafter.config
    step_hidden = drafter.ttt_forward(batch.input_ids_BT, batch.features_BTF, batch.sequence_ids_BT,
                                      batch.position_ids_BT)
    t2d_V = drafter.t2d if drafter.reduced_vocab else None
    step_terms, step_rows = [], []
    for step, hidden_BTH in enumerate(step_hidden):
        terms, rows_N = _step_terms(batch, drafter.norm(hidden_BTH), drafter.draft_head_weight(),
                                    drafter.target_parts.lm_head_weight, 2 + step, t2d_V,
                                    drafter.target_vocab_index(), loss_cfg.chunk_rows)
        step_terms.append(terms)
        step_rows.append(rows_N)
    weights_S = ttt_step_weights(len(step_terms), config.ttt_decay)
    loss = eagle3_objective(step_terms, weights_S)
    merged, position_index_N, block_index_N = _merge(step_terms, step_rows)
    return StepResult(loss, merged, position_index_N, block_index_N)


@register_objective("mtp")
def mtp_training_objective(drafter, batch: AutoregressiveBatch, loss_cfg: LossConfig) -> StepResult:
    _check_batch(drafter, batch)
    config = drafter.config
    module_hidden = drafter.chain_forward(batch.input_ids_BT, batch.final_hidden_BTH.to(drafter.dtype),
                                          batch.sequence_ids_BT, batch.position_ids_BT)
    head_VH = drafter.target_parts.lm_head_weight
    module_terms, module_rows = [], []
    for index, hidden_BTH in enumerate(module_hidden):
        terms, rows_N = _step_terms(batch, drafter.head_norm(index, hidden_BTH), head_VH, head_VH, index + 2,
                                    None, None, loss_cfg.chunk_rows)
        module_terms.append(terms)
        module_rows.append(rows_N)
    loss = mtp_objective(module_terms, module_weight=config.module_loss_weight, kl=config.use_target_kl)
    merged, position_index_N, block_index_N = _merge(module_terms, module_rows)
    return StepResult(loss, merged, position_index_N, block_index_N)
