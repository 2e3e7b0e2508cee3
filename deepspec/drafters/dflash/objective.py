"""DFlash's training objective: position-weighted CE (+ TV when `loss.tv_weight` > 0).

TV is also computed when `with_metrics` asks for it (validation's acceptance metrics read it) without
entering the loss.
"""

from __future__ import annotations

from deepspec.drafters.block.objective import block_position_weights, block_terms
from deepspec.drafters.dflash.config import DFlashLoss
from deepspec.losses.objectives import StepResult, dflash_objective


def dflash_training_objective(drafter, batch, loss: DFlashLoss, with_metrics: bool = False) -> StepResult:
    need = ("ce", "tv") if loss.tv_weight or with_metrics else ("ce",)
    out, terms = block_terms(drafter, batch, loss.terms_options(need), with_metrics=with_metrics)
    weights_K = block_position_weights(batch, loss.gamma, out.hidden_NH)
    total = dflash_objective(terms, batch.position_index_N, weights_K, ce_weight=loss.ce_weight,
                             tv_weight=loss.tv_weight, check_values=loss.check_values)
    return StepResult(total, terms, batch.position_index_N, batch.block_index_N)
