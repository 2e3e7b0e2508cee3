"""Eagle3's training objective (TTT): `sum_s ttt_decay^s * mean_valid(soft_ce_s)`.

Step s at row t predicts x[t+2+s]; its target distribution is the frozen LM head on the cached final
hidden at t+1+s, restricted to the draft vocabulary (and renormalised) when it is reduced.
"""

from __future__ import annotations

from deepspec.drafters.chain.batching import AutoregressiveBatch
from deepspec.drafters.chain.objective import check_chain_batch, merge_step_terms, step_terms
from deepspec.drafters.eagle3.config import Eagle3Loss
from deepspec.losses.objectives import StepResult, eagle3_objective
from deepspec.losses.position_weights import ttt_step_weights
from deepspec.utils.phases import phase


def eagle3_training_objective(drafter, batch: AutoregressiveBatch, loss: Eagle3Loss,
                              with_metrics: bool = False) -> StepResult:
    check_chain_batch(drafter, batch)
    with phase("forward"):
        step_hidden = drafter.ttt_forward(batch.input_ids_BT, batch.features_BTF, batch.sequence_ids_BT,
                                          batch.position_ids_BT)
    t2d_V = drafter.t2d if drafter.reduced_vocab else None
    terms_per_step, step_rows = [], []
    for step, hidden_BTH in enumerate(step_hidden):
        terms, rows_N = step_terms(batch, drafter.norm(hidden_BTH), drafter.draft_head_weight(),
                                   drafter.target_parts.lm_head_weight, 2 + step, t2d_V,
                                   drafter.target_vocab_index(), loss.terms_options())
        terms_per_step.append(terms)
        step_rows.append(rows_N)
    total = eagle3_objective(terms_per_step, ttt_step_weights(len(terms_per_step), loss.ttt_decay))
    merged, position_index_N, block_index_N = merge_step_terms(terms_per_step, step_rows)
    return StepResult(total, merged, position_index_N, block_index_N)
