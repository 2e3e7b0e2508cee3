"""DeepSpeed set-up from the typed config: process group, ZeRO config, AdamW, warmup + cosine schedule.

One code path from a plain `python train.py` on one CPU to `torchrun`/`deepspeed` on many GPU nodes:
- `Launch` says which process this is: read once from a launcher's variables (RANK, LOCAL_RANK,
  WORLD_SIZE) or, without a launcher, a single process; `init_distributed(launch, device)` then creates the
  torch.distributed process group explicitly (a free local port for a single process, so DeepSpeed never
  looks for MPI) and DeepSpeed uses that group. The only environment variable written is LOCAL_RANK, when
  absent: DeepSpeed's engine reads it from the environment and offers no other way to be told;
- without CUDA DeepSpeed detects its CPU accelerator itself (gloo, fp32); on GPUs nccl and bf16;
- AdamW runs with `torch_adam: true`: no fused-Adam JIT compile (48 s on CPU, fragile on odd CUDA set-ups);
- one fp32 process (stage 1/2, `deepspeed.single_process_engine`) runs the engine without ZeRO, with a client
  `ClippedAdamW` and no gradient all-reduce: ZeRO-1/2 with one process partitions nothing but still copies every
  gradient into flat buffers and the updated fp32 partition back into the parameters each step;
- gradient accumulation = global batch / (micro batch x world size), so the optimizer sees the same
  global batch whatever the number of processes.
"""

from __future__ import annotations

import math

import torch

from deepspec.training.config import TrainConfig


def resolve_device(cfg: TrainConfig, local_rank: int = 0) -> torch.device:
    if cfg.trainer.device == "cpu" or (cfg.trainer.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is available")
    return torch.device("cuda", local_rank)


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    if cfg.trainer.precision != "auto":
        return cfg.trainer.precision
    return "bf16" if device.type == "cuda" else "fp32"


AUTOCAST_MODES = ("none", "bf16", "auto")


def cpu_has_bf16_matmul() -> bool:
    """AMX tiles or AVX512-BF16: bf16 matmuls run natively (about 2-3x fp32 at 1 thread on a Xeon with AMX)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check is not None and check() for check in checks)


def resolve_autocast(cfg: TrainConfig, device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of the training forward (`trainer.autocast`), None for none."""
    mode = cfg.trainer.autocast
    if mode not in AUTOCAST_MODES:
        raise ValueError(f"trainer.autocast={mode!r} must be one of {AUTOCAST_MODES}")
    if mode == "bf16":
        return torch.bfloat16
    if mode == "auto" and device.type == "cpu" and precision == "fp32" and cpu_has_bf16_matmul():
        return torch.bfloat16
    return None


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


def zero_stage(cfg: TrainConfig, world_size: int, precision: str) -> int:
    """The ZeRO stage DeepSpeed runs: 0 for one fp32 process under `deepspeed.single_process_engine` (stage 1/2, no
    offload: nothing to partition), else `deepspeed.stage`."""
    z = cfg.deepspeed
    if (z.single_process_engine and world_size == 1 and precision == "fp32" and z.stage in (1, 2)
            and not z.offload_optimizer):
        return 0
    return z.stage


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the global gradient norm before each step and records it as `_global_grad_norm`, the
    attribute DeepSpeed's engine reads after a step (`get_global_grad_norm`). The single-process engine's
    optimizer: without ZeRO DeepSpeed would clip too but keep no norm for the loop's guards."""

    def __init__(self, params, max_norm: float, **kwargs):
        super().__init__(params, **kwargs)
        self.max_norm = float(max_norm)
        self._global_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            norm = torch.nn.utils.clip_grad_norm_(grads, self.max_norm if self.max_norm > 0 else float("inf"))
            self._global_grad_norm = float(norm)
        return super().step(closure)


def deepspeed_config(cfg: TrainConfig, world_size: int, precision: str) -> dict:
    t, o, z = cfg.trainer, cfg.optim, cfg.deepspeed
    stage = zero_stage(cfg, world_size, precision)
    zero = {"stage": stage, "overlap_comm": z.overlap_comm, "contiguous_gradients": z.contiguous_gradients,
            "reduce_bucket_size": z.reduce_bucket_size}
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if z.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    zero.update(dict(z.extra))
    if stage == 0:  # the client ClippedAdamW (build_engine) clips; DeepSpeed must not clip a second time
        return {"train_batch_size": t.global_batch_size, "train_micro_batch_size_per_gpu": t.micro_batch_size,
                "gradient_accumulation_steps": t.grad_accum_steps(world_size),
                "gradient_clipping": 0.0, "bf16": {"enabled": False}, "zero_optimization": {"stage": 0},
                "steps_per_print": 10**9, "wall_clock_breakdown": False}
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum_steps(world_size),
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                                   "weight_decay": o.weight_decay, "torch_adam": True}},
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,  # our logger reports; keep DeepSpeed's own prints quiet
        "wall_clock_breakdown": False,
    }


def build_engine(module: torch.nn.Module, cfg: TrainConfig, world_size: int, precision: str, total_steps: int):
    """`deepspeed.initialize` over the drafter's trainable parameters only (the frozen target parts are not
    in its module tree). Returns the engine; its `lr_scheduler` is the warmup + cosine `LambdaLR`.
    The process group must exist (`init_distributed`)."""
    import deepspeed

    schedule = WarmupCosine(total_steps, cfg.optim.warmup_fraction, cfg.optim.min_lr_ratio)
    trainable = [p for p in module.parameters() if p.requires_grad]
    config = deepspeed_config(cfg, world_size, precision)
    optimizer = None
    if config["zero_optimization"]["stage"] == 0:
        o = cfg.optim
        optimizer = ClippedAdamW(trainable, max_norm=o.grad_clip, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                 weight_decay=o.weight_decay)
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
