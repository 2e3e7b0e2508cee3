"""DSpark's training objective (paper eq. 12): `ce_weight L_ce + tv_weight L_tv + conf_weight L_conf`."""

from __future__ import annotations

from deepspec.drafters.block.objective import block_position_weights, block_terms
from deepspec.drafters.dspark.config import DSparkLoss
from deepspec.losses.objectives import StepResult, dspark_objective


def dspark_training_objective(drafter, batch, loss: DSparkLoss, with_metrics: bool = False) -> StepResult:
    out, terms = block_terms(drafter, batch, loss.terms_options(("ce", "tv")), with_metrics=with_metrics)
    weights_K = block_position_weights(batch, loss.gamma, out.hidden_NH)
    total = dspark_objective(terms, out.confidence_logits_N, batch.position_index_N, weights_K,
                             ce_weight=loss.ce_weight, tv_weight=loss.tv_weight, conf_weight=loss.conf_weight,
                             check_values=loss.check_values)
    return StepResult(total, terms, batch.position_index_N, batch.block_index_N)
