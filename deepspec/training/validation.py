"""Held-out validation on the cache's validation split: loss terms and acceptance metrics, all-reduced.

Metrics (deepspec.losses.metrics.AcceptanceMetrics): per-position top-1 agreement with the target, expected
acceptance 1 - TV/2 per position, simulated acceptance length tau (bonus token included) from the
TV-based and the greedy (top-1) acceptance. Loss parts are averaged over validation micro-batches.

TV is needed for the acceptance metrics even where the objective does not train on it (DFlash's default
tv_weight 0): validation asks the objective for it (`with_metrics=True`), which computes it without
weighting it into the loss.

Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively inside forward): a
rank without a batch of its own re-runs the first one and discards the result.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from deepspec.losses.metrics import AcceptanceMetrics


@torch.no_grad()
def run_validation(model, data, num_positions: int, rank: int, world: int, device: torch.device,
                   dtype: torch.dtype) -> dict:
    """`model(batch, with_metrics=True) -> (loss, StepResult)` (the engine over session.TrainingModule); `data`
    a `TrainingData`."""
    val_ids = data.val_ids
    if not val_ids:
        return {}
    micro = data.cfg.trainer.micro_batch_size
    per_round = micro * world
    num_rounds = math.ceil(len(val_ids) / per_round)
    metrics = AcceptanceMetrics(num_positions)
    part_sums: dict[str, float] = {}
    num_batches = 0
    was_training = model.module.training
    model.eval()
    for round_index in range(num_rounds):
        start = round_index * per_round + rank * micro
        ids = val_ids[start:start + micro]
        real = bool(ids)
        batch = data.collate(ids if real else val_ids[:micro], epoch=0).to(device, dtype)
        _, result = model(batch, with_metrics=True)
        if not real:
            continue
        metrics.update(result.terms, result.position_index_N, result.block_index_N)
        for name, value in result.loss.parts.items():
            part_sums[name] = part_sums.get(name, 0.0) + float(value)
        num_batches += 1
    if was_training:
        model.train()
    names = sorted(part_sums)
    state = torch.cat([metrics.state_tensor(), torch.tensor([part_sums[n] for n in names] + [num_batches],
                                                            dtype=torch.float64)])
    if world > 1:
        dist.all_reduce(state)
    metrics.load_state_tensor(state[: metrics.state_size])
    totals = state[metrics.state_size:]
    batches = max(float(totals[-1]), 1.0)
    out = {f"loss_{n}": float(totals[i]) / batches for i, n in enumerate(names)}
    out.update(metrics.compute())
    out["num_samples"] = len(val_ids)
    return out
