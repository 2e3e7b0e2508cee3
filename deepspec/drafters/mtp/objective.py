"""MTP's training objective: `module_loss_weight / D * sum_k mean_valid(CE_k)` (soft CE with `use_target_kl`).

Module k (1-based) at row t predicts x[t+k+1]; its target distribution comes from the final hidden at t+k.
"""

from __future__ import annotations

from deepspec.drafters.chain.batching import AutoregressiveBatch
from deepspec.drafters.chain.objective import check_chain_batch, merge_step_terms, step_terms
from deepspec.drafters.mtp.config import MTPLoss
from deepspec.losses.objectives import StepResult, mtp_objective
from deepspec.utils.phases import phase


def mtp_training_objective(drafter, batch: AutoregressiveBatch, loss: MTPLoss,
                           with_metrics: bool = False) -> StepResult:
    check_chain_batch(drafter, batch)
    with phase("forward"):
        module_hidden = drafter.chain_forward(batch.input_ids_BT, batch.final_hidden_BTH.to(drafter.dtype),
                                              batch.sequence_ids_BT, batch.position_ids_BT)
    head_VH = drafter.target_parts.lm_head_weight
    terms_per_module, module_rows = [], []
    for index, hidden_BTH in enumerate(module_hidden):
        terms, rows_N = step_terms(batch, drafter.head_norm(index, hidden_BTH), head_VH, head_VH, index + 2,
                                   None, None, loss.terms_options())
        terms_per_module.append(terms)
        module_rows.append(rows_N)
    total = mtp_objective(terms_per_module, module_weight=loss.module_loss_weight, kl=loss.use_target_kl)
    merged, position_index_N, block_index_N = merge_step_terms(terms_per_module, module_rows)
    return StepResult(total, merged, position_index_N, block_index_N)
