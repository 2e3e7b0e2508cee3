"""Stop a training run at the first non-finite loss or gradient, before it reaches the weights, naming the step and
the cached samples.

Two checks per optimizer step, on every rank with the same numbers (the data order is known on every rank, see
deepspec.training.data), so all ranks stop together and each names the same samples:
- `check_losses_finite`, before the update: the step's per-(rank, micro step) loss flags, read from the device
  once per optimizer step with the step's logging scalars (the loop's `_step_scalars`);
- `check_grad_norm_finite`, after it: the global gradient norm of the step. The single-process engine's
  optimizer (engine.ClippedAdamW) skips an update whose norm is not finite, as DeepSpeed's fp32 ZeRO optimizers do
  (as an fp16-style overflow, without a word); in bf16 DeepSpeed would apply it, but the run stops here either way,
  before that step is logged or saved.
"""

from __future__ import annotations

import math

from deepspec.utils.errors import ReportedFailure


class NonFiniteTrainingError(ReportedFailure, FloatingPointError):
    """A loss or gradient was NaN/inf: the run stops before logging or saving that step."""


def _describe(data, sample_ids: list[int]) -> str:
    return ", ".join(f"{i} (id {data.reader.samples[i]['id']!r})" for i in sample_ids)


def _where(step: int, epoch: int, data) -> str:
    return f"step {step} (epoch {epoch}, cache {data.settings.cache_dir})"


ADVICE = ("the run stops here, before this step is logged or saved; check the cache "
          "(deepspec cache mode=verify cache.out_dir=...) and the learning rate")


def check_losses_finite(*, step: int, epoch: int, bad_loss_flags: list[float], data, order: list[int],
                        batch_in_epoch: int, grad_accum: int, world_size: int) -> None:
    """Raise `NonFiniteTrainingError` when a rank saw a non-finite loss in optimizer step `step` (before its update).

    `bad_loss_flags[r * grad_accum + m]` is 1 where rank r's micro step m had a non-finite loss (summed over ranks).
    """
    bad = [k for k, flag in enumerate(bad_loss_flags) if flag]
    if bad:
        parts = []
        for k in bad:
            rank, micro_step = divmod(k, grad_accum)
            ids = data.micro_batch_ids(order, batch_in_epoch, micro_step, rank, world_size)
            parts.append(f"rank {rank} micro step {micro_step}: cache samples {_describe(data, ids)}")
        raise NonFiniteTrainingError(f"{_where(step, epoch, data)}: non-finite loss on " + "; ".join(parts)
                                     + f"; {ADVICE}")


def check_grad_norm_finite(*, step: int, epoch: int, grad_norm, data, order: list[int], batch_in_epoch: int,
                           grad_accum: int, world_size: int) -> None:
    """Raise `NonFiniteTrainingError` when the step's global gradient norm (a float or a 0-d tensor, read here: one
    device-to-host copy; None when not computed) is not finite."""
    norm = float(grad_norm) if grad_norm is not None else None
    if norm is not None and not math.isfinite(norm):
        ids = [i for micro_step in range(grad_accum) for rank in range(world_size)
               for i in data.micro_batch_ids(order, batch_in_epoch, micro_step, rank, world_size)]
        raise NonFiniteTrainingError(f"{_where(step, epoch, data)}: non-finite gradient norm ({norm}) with a finite "
                                     f"loss; the step's cache samples: {_describe(data, ids)}; {ADVICE}")
