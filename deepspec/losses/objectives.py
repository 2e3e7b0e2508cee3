"""Per-drafter training objectives built from per-row ``DistributionTerms`` (DSpark paper §3.3).

Normalisation (block drafters, DSpark/DFlash): each term is the paper's per-block sum
``sum_k w_k * term_k`` averaged over blocks, i.e. ``sum over valid rows of w_{k(row)} * term_row /
num_blocks``. ``num_blocks`` defaults to the number of supervised rows at slot 0: anchors are only
sampled where the next token is a response token (CONTRACTS block convention), so every real block
has slot 0 supervised and padding blocks have none. Data-parallel trainers may pass the global
block count instead so every rank's loss is on the same scale. The losses therefore do not scale
with batch size, and a block whose tail is unsupervised just contributes fewer terms.

Eagle3 (TTT) and MTP: per step/module the mean over supervised rows, then ``sum_s 0.8^s * L_s``
(Eagle3, SpecForge) or ``lambda / D * sum_k L_k`` (MTP, DeepSeek-V3).

Shape legend: N = rows (flattened draft positions), K = block positions, S = TTT steps / MTP modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from deepspec.losses.confidence import confidence_bce, confidence_targets
from deepspec.losses.distribution import DistributionTerms


@dataclass
class LossOutput:
    """``total`` carries the gradient; ``parts`` and ``per_position`` are detached, for logging/metrics."""

    total: torch.Tensor
    parts: dict[str, float] = field(default_factory=dict)
    per_position: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepResult:
    """What one training objective returns for a batch: the loss and the per-row terms with each row's place
    (draft position and chain/block id), so validation metrics never recompute anything."""

    loss: LossOutput
    terms: DistributionTerms
    position_index_N: torch.Tensor  # draft position of each row (block slot, TTT step, MTP module)
    block_index_N: torch.Tensor  # chain each row belongs to (any integer id per block/chain)


def _check_position_index(position_index_N: torch.Tensor, num_rows: int, num_positions: int) -> None:
    if position_index_N.dim() != 1 or position_index_N.shape[0] != num_rows:
        raise ValueError(f"position_index_N must be [{num_rows}]; got {tuple(position_index_N.shape)}")
    if position_index_N.dtype not in (torch.long, torch.int32):
        raise ValueError(f"position_index_N must be an integer tensor, got {position_index_N.dtype}")
    if num_rows and (int(position_index_N.min()) < 0 or int(position_index_N.max()) >= num_positions):
        raise ValueError(f"position_index_N values must lie in [0, {num_positions}) (len(weights_K))")


def count_valid_blocks(valid_N: torch.Tensor, position_index_N: torch.Tensor) -> torch.Tensor:
    """Number of blocks with a supervised first slot (see module docstring), as a float scalar."""
    return (valid_N & (position_index_N == 0)).sum().float()


def per_position_mean(
    term_N: torch.Tensor, valid_N: torch.Tensor, position_index_N: torch.Tensor, num_positions: int
) -> torch.Tensor:
    """Detached fp32 mean of ``term_N`` over valid rows at each position; NaN where a position has none."""
    term_N = term_N.detach().float()
    index_N = position_index_N.long()
    sums_K = torch.zeros(num_positions, dtype=torch.float32, device=term_N.device)
    counts_K = torch.zeros_like(sums_K)
    sums_K.index_add_(0, index_N, torch.where(valid_N, term_N, torch.zeros_like(term_N)))
    counts_K.index_add_(0, index_N, valid_N.float())
    return torch.where(counts_K > 0, sums_K / counts_K.clamp(min=1), torch.full_like(sums_K, float("nan")))


def _weighted_block_sum(
    term_N: torch.Tensor,
    valid_N: torch.Tensor,
    position_index_N: torch.Tensor,
    weights_K: torch.Tensor,
    num_blocks: torch.Tensor,
) -> torch.Tensor:
    weight_N = weights_K.to(device=term_N.device, dtype=torch.float32)[position_index_N.long()]
    weighted_N = torch.where(valid_N, weight_N * term_N.float(), torch.zeros_like(weight_N))
    return weighted_N.sum() / num_blocks


def _block_objective(
    terms: DistributionTerms,
    confidence_logits_N: torch.Tensor | None,
    position_index_N: torch.Tensor,
    weights_K: torch.Tensor,
    loss_weights: dict[str, float],
    num_blocks: float | torch.Tensor | None,
) -> LossOutput:
    if weights_K.dim() != 1 or weights_K.shape[0] < 1:
        raise ValueError(f"weights_K must be a non-empty 1-D tensor; got {tuple(weights_K.shape)}")
    num_positions = weights_K.shape[0]
    _check_position_index(position_index_N, terms.num_rows, num_positions)
    valid_N = terms.valid_N
    device = valid_N.device
    if num_blocks is None:
        blocks = count_valid_blocks(valid_N, position_index_N).clamp(min=1.0)
    else:
        blocks = torch.as_tensor(num_blocks, dtype=torch.float32, device=device)
        if float(blocks) <= 0:
            raise ValueError(f"num_blocks must be positive, got {float(blocks)}")
    per_row: dict[str, torch.Tensor] = {}
    for name in ("ce", "tv"):
        if loss_weights[name] != 0:
            per_row[name] = terms.term(name)
        elif getattr(terms, f"{name}_N") is not None:
            per_row[name] = getattr(terms, f"{name}_N").detach()
    if confidence_logits_N is not None:
        if confidence_logits_N.shape != valid_N.shape:
            raise ValueError(f"confidence_logits_N must be [{terms.num_rows}]; got {tuple(confidence_logits_N.shape)}")
        per_row["conf"] = confidence_bce(confidence_logits_N, confidence_targets(terms.term("tv")))
    total = torch.zeros((), dtype=torch.float32, device=device)
    parts: dict[str, float] = {}
    per_position: dict[str, torch.Tensor] = {}
    for name, term_N in per_row.items():
        value = _weighted_block_sum(term_N, valid_N, position_index_N, weights_K, blocks)
        if loss_weights.get(name, 0.0) != 0:
            total = total + loss_weights[name] * value
        parts[name] = float(value.detach())
        per_position[name] = per_position_mean(term_N, valid_N, position_index_N, num_positions)
    parts["total"] = float(total.detach())
    parts["num_blocks"] = float(blocks)
    return LossOutput(total=total, parts=parts, per_position=per_position)


def dspark_objective(
    terms: DistributionTerms,
    confidence_logits_N: torch.Tensor | None,
    position_index_N: torch.Tensor,
    weights_K: torch.Tensor,
    *,
    ce_weight: float = 0.1,
    tv_weight: float = 0.9,
    conf_weight: float = 1.0,
    num_blocks: float | torch.Tensor | None = None,
) -> LossOutput:
    """``ce_weight * L_ce + tv_weight * L_tv + conf_weight * L_conf`` (paper eq. 12; conf only with logits)."""
    loss_weights = {"ce": ce_weight, "tv": tv_weight, "conf": conf_weight}
    return _block_objective(terms, confidence_logits_N, position_index_N, weights_K, loss_weights, num_blocks)


def dflash_objective(
    terms: DistributionTerms,
    position_index_N: torch.Tensor,
    weights_K: torch.Tensor,
    *,
    ce_weight: float = 1.0,
    tv_weight: float = 0.0,
    num_blocks: float | torch.Tensor | None = None,
) -> LossOutput:
    """DFlash: position-weighted CE (optionally + TV)."""
    loss_weights = {"ce": ce_weight, "tv": tv_weight}
    return _block_objective(terms, None, position_index_N, weights_K, loss_weights, num_blocks)


def _valid_mean(term_N: torch.Tensor, valid_N: torch.Tensor) -> torch.Tensor:
    term_N = term_N.float()
    return torch.where(valid_N, term_N, torch.zeros_like(term_N)).sum() / valid_N.sum().clamp(min=1).float()


def _stepwise_objective(
    step_terms: Sequence[DistributionTerms], step_weights: torch.Tensor, train_term: str, prefix: str, field_name: str
) -> LossOutput:
    if len(step_terms) == 0:
        raise ValueError(f"{field_name} must hold at least one DistributionTerms")
    if step_weights.dim() != 1 or step_weights.shape[0] != len(step_terms):
        raise ValueError(f"step weights must be [{len(step_terms)}] (one per entry of {field_name}); got {tuple(step_weights.shape)}")
    device = step_terms[0].valid_N.device
    total = torch.zeros((), dtype=torch.float32, device=device)
    parts: dict[str, float] = {}
    logged: dict[str, list[float]] = {}
    for step, terms in enumerate(step_terms):
        step_loss = _valid_mean(terms.term(train_term), terms.valid_N)
        total = total + float(step_weights[step]) * step_loss
        for name in ("ce", "soft_ce", "tv"):
            term_N = getattr(terms, f"{name}_N")
            if term_N is not None:
                value = float(_valid_mean(term_N.detach(), terms.valid_N))
                parts[f"{name}_{prefix}{step}"] = value
                logged.setdefault(name, []).append(value)
    per_position = {name: torch.tensor(values, dtype=torch.float32) for name, values in logged.items() if len(values) == len(step_terms)}
    parts["total"] = float(total.detach())
    return LossOutput(total=total, parts=parts, per_position=per_position)


def eagle3_objective(step_terms: Sequence[DistributionTerms], step_weights: torch.Tensor) -> LossOutput:
    """Eagle3 TTT: ``sum_s step_weights[s] * mean_valid(soft_ce_s)``; CE (and TV if computed) logged per step."""
    return _stepwise_objective(step_terms, step_weights, "soft_ce", "step", "step_terms")


def mtp_objective(
    module_terms: Sequence[DistributionTerms], module_weight: float = 0.3, *, kl: bool = False
) -> LossOutput:
    """MTP: ``lambda / D * sum_k L_k``, L_k the mean CE of module k (or soft CE against p_t when ``kl``:
    KL(p_t || p_d) minus the constant target entropy, so the same gradient)."""
    if module_weight <= 0:
        raise ValueError(f"module_weight (lambda) must be positive, got {module_weight}")
    num_modules = len(module_terms)
    weights_S = torch.full((num_modules,), module_weight / max(num_modules, 1), dtype=torch.float32)
    return _stepwise_objective(module_terms, weights_S, "soft_ce" if kl else "ce", "module", "module_terms")
