"""The standalone drafter's distillation objective: every supervised token is one row, whatever its position.

Row t of a packed batch (chain/batching.py) predicts x[t+1] when x[t+1] is an assistant token of the same
sequence. Its target distribution is the target's next-token law after x[0..t]: `softmax(final_hidden[t] @
lm_head^T)` from a hidden-state cache, or the cached top-k log-probs at t (`top_k_target_terms`: the law
coarsened to top-k + rest). Loss: `kl_weight * mean(soft CE) + tv_weight * mean(TV) + ce_weight * mean(CE)`
over the batch's rows (soft CE = KL(p_t || p_d) + the constant target entropy: the same gradient).

Metrics (`with_metrics`, validation): the drafter proposes K = num_speculative_tokens tokens per round, so a
chain is "K consecutive supervised rows of one sequence" teacher-forced; every supervised row starts one,
its rows are taken again at positions 0..K-1 (`DistributionTerms.take`) and validation's simulated tau reads
them like any chain drafter's. Without metrics every row is its own chain at position 0.

Shape legend: B = rows, T = tokens, W = draft width, N = supervised rows, K = draft positions, M = chain rows.
"""

from __future__ import annotations

import torch

from deepspec.drafters.chain.batching import AutoregressiveBatch, labels_at_shift
from deepspec.drafters.standalone.config import StandaloneLoss
from deepspec.losses.distribution import IGNORE_INDEX, DistributionTerms, distribution_terms, top_k_target_terms
from deepspec.losses.objectives import LossOutput, StepResult
from deepspec.utils.phases import phase

TERM_OF_WEIGHT = {"kl_weight": "soft_ce", "tv_weight": "tv", "ce_weight": "ce"}
LOGGED_NAME = {"soft_ce": "kl", "tv": "tv", "ce": "ce"}


def _mean(term_N: torch.Tensor, valid_N: torch.Tensor) -> torch.Tensor:
    return torch.where(valid_N, term_N.float(), torch.zeros_like(term_N, dtype=torch.float32)).sum() \
        / valid_N.sum().clamp(min=1).float()


def chain_rows(rows_N: torch.Tensor, sequence_ids_BT: torch.Tensor, num_positions: int):
    """(term index M, position M, chain M): supervised row t at position k of the chain started at row t - k."""
    num_tokens = sequence_ids_BT.shape[1]
    term_of_flat = torch.full((sequence_ids_BT.numel(),), -1, dtype=torch.long, device=rows_N.device)
    term_of_flat[rows_N] = torch.arange(rows_N.shape[0], device=rows_N.device)
    sequence_F = sequence_ids_BT.flatten()
    index, position, chain = [], [], []
    for k in range(num_positions):
        inside = (rows_N % num_tokens) + k < num_tokens  # the same packed row
        flat = torch.where(inside, rows_N + k, rows_N)
        keep = inside & (term_of_flat[flat] >= 0) & (sequence_F[flat] == sequence_F[rows_N])
        index.append(term_of_flat[flat][keep])
        position.append(torch.full_like(index[-1], k))
        chain.append(rows_N[keep])
    return torch.cat(index), torch.cat(position), torch.cat(chain)


def standalone_objective(drafter, batch: AutoregressiveBatch, loss: StandaloneLoss,
                         with_metrics: bool = False) -> StepResult:
    if not isinstance(batch, AutoregressiveBatch):
        raise TypeError(f"the standalone objective needs an AutoregressiveBatch, got {type(batch).__name__}")
    if drafter.logit_softcap or drafter.target_parts.final_logit_softcapping:
        raise ValueError("draft or target logits with final_logit_softcapping are not supported by the chunked losses")
    with phase("forward"):
        hidden_BTW = drafter.sequence_hidden(batch.input_ids_BT, batch.sequence_ids_BT, batch.position_ids_BT)
    labels_BT = labels_at_shift(batch.input_ids_BT, batch.loss_mask_BT, batch.sequence_ids_BT, 1)
    # A host sync, kept: the supervised rows are a variable-size set, and only they pay for the [N, V] terms.
    rows_N = torch.nonzero(labels_BT.flatten() != IGNORE_INDEX).squeeze(1)
    labels_N = labels_BT.flatten()[rows_N]
    draft_rows_N, draft_head_VW = drafter.head(hidden_BTW.reshape(-1, hidden_BTW.shape[-1])[rows_N])
    vocab = drafter.config.target_vocab_size
    if draft_head_VW.shape[0] < vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_head_VW.shape[0]} rows) is smaller than the target's "
                         f"{vocab}: distillation needs the draft to cover every target token")
    draft_head_VW = draft_head_VW[:vocab]  # padding rows of a wrapped model's embedding are never drafted
    weights = {TERM_OF_WEIGHT[name]: getattr(loss, name) for name in TERM_OF_WEIGHT}
    need = tuple(term for term, weight in weights.items() if weight or (with_metrics and term == "tv"))
    if batch.top_k_ids_BTK is not None:
        def gather(x_BTK):
            return x_BTK.reshape(-1, x_BTK.shape[-1])[rows_N]

        terms = top_k_target_terms(draft_rows_N, draft_head_VW, gather(batch.top_k_ids_BTK),
                                   gather(batch.top_k_logprobs_BTK), labels_N, options=loss.terms_options(need))
    else:
        target_rows_N = batch.final_hidden_BTH.reshape(-1, batch.final_hidden_BTH.shape[-1])[rows_N]
        head_VH = drafter.target_parts.lm_head_weight
        terms = distribution_terms(draft_rows_N, draft_head_VW, target_rows_N.to(draft_rows_N.dtype), head_VH,
                                   labels_N, options=loss.terms_options(need))
    total = torch.zeros((), dtype=torch.float32, device=hidden_BTW.device)
    parts: dict[str, float | torch.Tensor] = {}  # tensors: read when logged (LossOutput)
    for term in need:
        value = _mean(terms.term(term), terms.valid_N)
        if weights[term]:
            total = total + weights[term] * value
        parts[LOGGED_NAME[term]] = value.detach()
    parts["total"] = total.detach()
    parts["num_rows"] = float(rows_N.shape[0])
    result_terms, position_M, chain_M = _metric_rows(terms, rows_N, batch, drafter, with_metrics)
    return StepResult(LossOutput(total=total, parts=parts), result_terms, position_M, chain_M)


def _metric_rows(terms: DistributionTerms, rows_N: torch.Tensor, batch: AutoregressiveBatch, drafter,
                 with_metrics: bool) -> tuple[DistributionTerms, torch.Tensor, torch.Tensor]:
    if not with_metrics:
        return terms, torch.zeros_like(rows_N), rows_N
    index_M, position_M, chain_M = chain_rows(rows_N, batch.sequence_ids_BT, drafter.config.num_speculative_tokens)
    return terms.take(index_M), position_M, chain_M
