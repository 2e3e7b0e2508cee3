"""Stop a training run at the first non-finite loss or gradient, naming the step and the cached samples.

DeepSpeed's fp32 ZeRO optimizers treat a non-finite gradient norm as an fp16-style overflow and skip the
step without a word; in bf16 the NaN reaches the weights. Either way the run would go on logging
`loss: null` and saving checkpoints. `check_step_finite` is called once per optimizer step, after the
step's logging all-reduce, with every rank's per-micro-step flags, so all ranks stop together and each
names the same samples (the data order is known on every rank, see deepspec.training.data).
"""

from __future__ import annotations

import math

import torch

from deepspec.utils.errors import ReportedFailure


class NonFiniteTrainingError(ReportedFailure, FloatingPointError):
    """A loss or gradient was NaN/inf: the run stops before logging or saving that step."""


def loss_is_finite(loss: torch.Tensor) -> bool:
    return bool(torch.isfinite(loss.detach()).all())


def _describe(data, sample_ids: list[int]) -> str:
    return ", ".join(f"{i} (id {data.reader.samples[i]['id']!r})" for i in sample_ids)


def check_step_finite(*, step: int, epoch: int, bad_loss_flags: list[float], grad_norm, data, order: list[int],
                      batch_in_epoch: int, grad_accum: int, world_size: int) -> None:
    """Raise `NonFiniteTrainingError` when a rank saw a non-finite loss or the global gradient norm is not finite.

    `bad_loss_flags[r * grad_accum + m]` is 1 where rank r's micro step m had a non-finite loss (summed over
    ranks); `grad_norm` is DeepSpeed's global gradient norm of the step (None when not computed).
    """
    where = f"step {step} (epoch {epoch}, cache {data.cfg.data.cache_dir})"
    advice = ("the run stops here, before this step is logged or saved; check the cache "
              "(deepspec cache mode=verify cache.out_dir=...) and the learning rate")
    bad = [k for k, flag in enumerate(bad_loss_flags) if flag]
    if bad:
        parts = []
        for k in bad:
            rank, micro_step = divmod(k, grad_accum)
            ids = data.micro_batch_ids(order, batch_in_epoch, micro_step, rank, world_size)
            parts.append(f"rank {rank} micro step {micro_step}: cache samples {_describe(data, ids)}")
        raise NonFiniteTrainingError(f"{where}: non-finite loss on " + "; ".join(parts) + f"; {advice}")
    norm = float(grad_norm) if grad_norm is not None else None
    if norm is not None and not math.isfinite(norm):
        ids = [i for micro_step in range(grad_accum) for rank in range(world_size)
               for i in data.micro_batch_ids(order, batch_in_epoch, micro_step, rank, world_size)]
        raise NonFiniteTrainingError(f"{where}: non-finite gradient norm ({norm}) with a finite loss; the step's "
                                     f"cache samples: {_describe(data, ids)}; {advice}")
