"""Training objectives: drafter + batch + loss config -> loss and per-row terms (glue over deepspec.losses).

Each drafter kind registers one objective with `@register_objective(kind)`; `compute_training_loss`
dispatches on `drafter.config.drafter_kind`. The block objectives ("dspark", "dflash") run the
drafter on a packed `BlockBatch`, then compute CE/TV against the target distribution
p_t = softmax(final_hidden @ lm_head^T) (the frozen LM head on the cached final hidden state,
temperature 1) with the chunked `distribution_terms`; DSpark's sequential bias is passed as its
low-rank pair so no [N, V] bias is materialised.

Position weights `w_k = exp(-(k-1)/gamma)`, gamma = 4.0 by default (DeepSpec's reference code; the
paper writes gamma = block size) - the value used is recorded in `LossConfig`.

Shape legend: N = block rows, H = hidden, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepspec.losses.distribution import DistributionTerms, distribution_terms
from deepspec.losses.objectives import LossOutput, dflash_objective, dspark_objective
from deepspec.losses.position_weights import DEFAULT_POSITION_GAMMA, position_weights

# Defaults per objective when a LossConfig weight is left as None (paper eq. 12 for DSpark; CE only for DFlash).
_DEFAULT_WEIGHTS = {"dspark": {"ce": 0.1, "tv": 0.9, "conf": 1.0}, "dflash": {"ce": 1.0, "tv": 0.0, "conf": 0.0}}


@dataclass
class LossConfig:
    ce_weight: float | None = None
    tv_weight: float | None = None
    conf_weight: float | None = None
    gamma: float = DEFAULT_POSITION_GAMMA
    chunk_rows: int = 512

    def __post_init__(self) -> None:
        for name in ("ce_weight", "tv_weight", "conf_weight"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"loss.{name}={value} must be >= 0")
        if self.gamma <= 0:
            raise ValueError(f"loss.gamma={self.gamma} must be > 0")
        if self.chunk_rows < 1:
            raise ValueError(f"loss.chunk_rows={self.chunk_rows} must be >= 1")

    def weight(self, objective: str, name: str) -> float:
        value = getattr(self, f"{name}_weight")
        return _DEFAULT_WEIGHTS[objective][name] if value is None else float(value)


@dataclass
class StepResult:
    loss: LossOutput
    terms: DistributionTerms
    position_index_N: torch.Tensor
    block_index_N: torch.Tensor


Objective = Callable[..., StepResult]
_OBJECTIVES: dict[str, Objective] = {}


def register_objective(kind: str) -> Callable[[Objective], Objective]:
    def wrap(fn: Objective) -> Objective:
        _OBJECTIVES[kind] = fn
        return fn
    return wrap


def compute_training_loss(drafter, batch, loss_cfg: LossConfig) -> StepResult:
    kind = drafter.config.drafter_kind
    if kind not in _OBJECTIVES:
        raise ValueError(f"no training objective registered for drafter kind {kind!r}; known: {sorted(_OBJECTIVES)}")
    return _OBJECTIVES[kind](drafter, batch, loss_cfg)


def _block_terms(drafter, batch, loss_cfg: LossConfig, need: tuple[str, ...]):
    out = drafter(batch)
    head_VH = drafter.target_parts.lm_head_weight
    if drafter.target_parts.final_logit_softcapping:
        raise ValueError("targets with final_logit_softcapping are not supported by the chunked block losses")
    terms = distribution_terms(out.hidden_NH, head_VH, batch.target_hidden_NH.to(out.hidden_NH.dtype), head_VH,
                               batch.labels_N, draft_bias=out.bias, chunk_rows=loss_cfg.chunk_rows, need=need)
    return out, terms


@register_objective("dspark")
def dspark_training_objective(drafter, batch, loss_cfg: LossConfig) -> StepResult:
    weights = {name: loss_cfg.weight("dspark", name) for name in ("ce", "tv", "conf")}
    out, terms = _block_terms(drafter, batch, loss_cfg, need=("ce", "tv"))
    weights_K = position_weights(batch.block_size, loss_cfg.gamma).to(out.hidden_NH.device)
    loss = dspark_objective(terms, out.confidence_logits_N, batch.position_index_N, weights_K,
                            ce_weight=weights["ce"], tv_weight=weights["tv"], conf_weight=weights["conf"])
    return StepResult(loss, terms, batch.position_index_N, batch.block_index_N)


@register_objective("dflash")
def dflash_training_objective(drafter, batch, loss_cfg: LossConfig) -> StepResult:
    ce, tv = loss_cfg.weight("dflash", "ce"), loss_cfg.weight("dflash", "tv")
    out, terms = _block_terms(drafter, batch, loss_cfg, need=("ce", "tv") if tv else ("ce",))
    weights_K = position_weights(batch.block_size, loss_cfg.gamma).to(out.hidden_NH.device)
    loss = dflash_objective(terms, batch.position_index_N, weights_K, ce_weight=ce, tv_weight=tv)
    return StepResult(loss, terms, batch.position_index_N, batch.block_index_N)


# Eagle3/MTP objectives live in their own module and register themselves on import (it imports
# this module's registry, hence the import at the bottom).
import deepspec.training.objective_autoregressive  # noqa: F401
