"""The DeepSpeed engine of a run: its ZeRO config (`deepspeed`), AdamW and the warmup + cosine schedule (`optim`), at
the rank's `Placement` (deepspec.training.placement).

One code path from a plain `python train.py` on one CPU to `torchrun`/`deepspeed` on many GPU nodes:
- `Launch` says which process this is: read once from a launcher's variables (RANK, LOCAL_RANK,
  WORLD_SIZE) or, without a launcher, a single process; `init_distributed(launch, device)` then creates the
  torch.distributed process group explicitly (a free local port for a single process, so DeepSpeed never
  looks for MPI) and DeepSpeed uses that group. The only environment variable written is LOCAL_RANK, when
  absent: DeepSpeed's engine reads it from the environment and offers no other way to be told;
- without CUDA DeepSpeed detects its CPU accelerator itself (gloo, fp32); on GPUs nccl and bf16;
- AdamW runs with `torch_adam: true`: no fused-Adam JIT compile (slow to build, fragile on odd CUDA set-ups);
- one fp32 process (stage 1/2, `deepspeed.single_process_engine`) runs the engine without ZeRO, with a client
  `ClippedAdamW` (torch's fused AdamW kernel, clipping, no host read) and no gradient all-reduce: ZeRO-1/2 with one
  process partitions nothing but still copies every gradient into flat buffers and the updated fp32 partition back
  into the parameters each step;
- gradient accumulation = global batch / (micro batch x world size), so the optimizer sees the same
  global batch whatever the number of processes.
"""

from __future__ import annotations

import math

import torch

from deepspec.training.config import DeepSpeedSchema, OptimSchema, TrainConfig
from deepspec.training.placement import (
    Placement,
    autocast_dtype,
    cpu_has_bf16_matmul,  # noqa: F401  (deepspec/pipeline.py imports it from here)
)


def resolve_autocast(cfg: TrainConfig, device: torch.device, precision: str) -> torch.dtype | None:
    """The training forward's autocast dtype (`trainer.autocast`, placement.autocast_dtype), for a loop that builds no
    `Placement` (`deepspec bench train`'s bare loop)."""
    return autocast_dtype(cfg.trainer.autocast, device, precision)


class WarmupCosine:
    """lr multiplier at optimizer step s: linear warmup over `warmup_steps`, then cosine to `min_ratio`.

    A plain callable object (not a lambda) so the schedule is described by its fields alone.
    """

    def __init__(self, total_steps: int, warmup_fraction: float, min_ratio: float):
        self.total_steps = max(int(total_steps), 1)
        self.warmup_steps = int(math.ceil(warmup_fraction * self.total_steps))
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ClippedAdamW(torch.optim.AdamW):
    """The single-process engine's optimizer: AdamW that clips the global gradient norm before each step, skips a step
    whose norm is not finite (the weights never see it; the loop's guard then stops the run) and records the norm as
    `_global_grad_norm`, the attribute DeepSpeed's engine reads after a step (`get_global_grad_norm`). Without ZeRO
    DeepSpeed would clip too but keep no norm for the guards.

    Nothing here reads the device: the norm stays a 0-d tensor (the loop's guard reads it, once per step), and the
    skip is the fused AdamW kernel's `found_inf` (an update with found_inf = 1 changes no weight, moment or step
    count). The fused kernel is also much cheaper than the per-parameter loop on a CPU thread; off CPU/CUDA, the loop
    runs with a host check.
    """

    def __init__(self, params, max_norm: float, **kwargs):
        params = list(params)
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        super().__init__(params, fused=fused or None, **kwargs)
        self.max_norm = float(max_norm)
        self._global_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return super().step(closure)
        norm = torch.nn.utils.clip_grad_norm_(grads, self.max_norm if self.max_norm > 0 else float("inf"))
        self._global_grad_norm = norm
        non_finite = (~torch.isfinite(norm)).float()
        if self.defaults["fused"]:
            self.found_inf = non_finite  # read by the fused kernel: 1 skips the update
            return super().step(closure)
        if not bool(non_finite):  # the per-parameter loop has no such input: decide on the host
            return super().step(closure)
        return None


def adamw_settings(optim: OptimSchema) -> dict:
    """AdamW's hyper-parameters (`optim`), as both optimizers take them."""
    return {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay}


def lr_schedule(optim: OptimSchema, total_steps: int) -> WarmupCosine:
    return WarmupCosine(total_steps, optim.warmup_fraction, optim.min_lr_ratio)


def zero_optimization(zero: DeepSpeedSchema, stage: int) -> dict:
    """DeepSpeed's `zero_optimization` section: `deepspeed.*` at the stage it runs."""
    section = {"stage": stage, "overlap_comm": zero.overlap_comm, "contiguous_gradients": zero.contiguous_gradients,
               "reduce_bucket_size": zero.reduce_bucket_size}
    if zero.offload_optimizer:
        section["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if zero.offload_param:
        section["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    section.update(dict(zero.extra))
    return section


def deepspeed_config(zero: DeepSpeedSchema, optim: OptimSchema, placement: Placement, micro_batch_size: int,
                     grad_accum_steps: int) -> dict:
    """DeepSpeed's config: the global batch is micro batch x accumulation x world size (`trainer.*`, checked by
    `TrainerSchema.grad_accum_steps`)."""
    config = {"train_batch_size": micro_batch_size * grad_accum_steps * placement.world_size,
              "train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps}
    if placement.zero_stage == 0:  # the client ClippedAdamW (build_engine) clips; DeepSpeed must not clip a second time
        config.update({"gradient_clipping": 0.0, "bf16": {"enabled": False}, "zero_optimization": {"stage": 0}})
    else:
        adamw = {**adamw_settings(optim), "betas": list(optim.betas), "torch_adam": True}
        config.update({"optimizer": {"type": "AdamW", "params": adamw}, "gradient_clipping": optim.grad_clip,
                       "bf16": {"enabled": placement.precision == "bf16"},
                       "zero_optimization": zero_optimization(zero, placement.zero_stage)})
    config.update({"steps_per_print": 10**9, "wall_clock_breakdown": False})  # our logger reports, DeepSpeed not
    return config


def build_engine(module: torch.nn.Module, zero: DeepSpeedSchema, optim: OptimSchema, placement: Placement, *,
                 micro_batch_size: int, grad_accum_steps: int, total_steps: int):
    """`deepspeed.initialize` over the module's trainable parameters only (the frozen target parts are not in its
    module tree). Returns the engine; its `lr_scheduler` is the warmup + cosine `LambdaLR`. The process group must
    exist (`init_distributed`)."""
    import deepspeed

    schedule = lr_schedule(optim, total_steps)
    trainable = [p for p in module.parameters() if p.requires_grad]
    config = deepspeed_config(zero, optim, placement, micro_batch_size, grad_accum_steps)
    optimizer = None
    if placement.zero_stage == 0:
        optimizer = ClippedAdamW(trainable, max_norm=optim.grad_clip, **adamw_settings(optim))
    engine, _, _, _ = deepspeed.initialize(
        model=module, model_parameters=None if optimizer is not None else trainable, optimizer=optimizer,
        config=config, lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
    )
    if optimizer is not None:
        # One process: the gradient all-reduce would flatten every gradient into a bucket and back for nothing.
        engine.enable_backward_allreduce = False
    return engine


def set_schedule_position(engine, optimizer_step: int) -> None:
    """Put the LR schedule (and DeepSpeed's counters) at `optimizer_step` completed steps (resume)."""
    scheduler = engine.lr_scheduler
    scheduler.last_epoch = optimizer_step - 1
    scheduler.step()  # sets every group's lr to base_lr * schedule(optimizer_step)
    engine.global_steps = optimizer_step
    engine.global_samples = optimizer_step * engine.train_batch_size()
