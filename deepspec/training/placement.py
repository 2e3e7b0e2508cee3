"""Where and in what numerics one rank trains, resolved once from `trainer` and `deepspeed` after the config is
validated: every component that needs it (the engine, the batch's device copy, validation) gets the `Placement`.

- device: `trainer.device` (auto: the rank's GPU where CUDA is available, else the CPU);
- precision: `trainer.precision` (auto: bf16 on GPUs, fp32 on the CPU), and `dtype`, the batch's float dtype;
- autocast_dtype: `trainer.autocast`, bf16 matmuls over fp32 weights (auto: where the CPU multiplies bf16 natively;
  nothing to do over bf16 weights);
- zero_stage: the ZeRO stage DeepSpeed runs: 0 for one fp32 process under `deepspeed.single_process_engine` (stage
  1/2 without optimizer offload: nothing to partition), else `deepspeed.stage`;
- world_size and rank: the launch's.

`deepspec plan` resolves the same for a device it need not have (`placement_on`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepspec.training.config import DeepSpeedSchema, TrainerSchema
from deepspec.utils.dist import Launch


@dataclass(frozen=True)
class Placement:
    device: torch.device
    precision: str  # fp32 | bf16
    dtype: torch.dtype  # of the batch's float tensors on the device
    autocast_dtype: torch.dtype | None  # of the drafter's forward and loss; None: no autocast
    zero_stage: int  # the stage DeepSpeed runs (0: no ZeRO)
    world_size: int = 1
    rank: int = 0


def resolve_placement(trainer: TrainerSchema, deepspeed: DeepSpeedSchema, launch: Launch) -> Placement:
    """This rank's placement on this machine."""
    return placement_on(training_device(trainer.device, launch.local_rank), trainer, deepspeed, launch.world_size,
                        launch.rank)


def placement_on(device: torch.device, trainer: TrainerSchema, deepspeed: DeepSpeedSchema, world_size: int,
                 rank: int = 0) -> Placement:
    """The placement of a rank on `device` (module docstring), whether or not this machine has one."""
    precision = trainer.precision if trainer.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    return Placement(device=device, precision=precision, dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                     autocast_dtype=autocast_dtype(trainer.autocast, device, precision),
                     zero_stage=zero_stage_run(deepspeed, world_size, precision), world_size=world_size, rank=rank)


def training_device(requested: str, local_rank: int = 0) -> torch.device:
    """`trainer.device` on this machine."""
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but no CUDA device is available")
    return torch.device("cuda", local_rank)


def cpu_has_bf16_matmul() -> bool:
    """AMX tiles or AVX512-BF16: the CPU multiplies bf16 natively, faster than fp32."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(check is not None and check() for check in checks)


def autocast_dtype(mode: str, device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of `trainer.autocast=mode` on `device` at `precision`, None for none."""
    if mode == "bf16":
        return torch.bfloat16
    if mode == "auto" and device.type == "cpu" and precision == "fp32" and cpu_has_bf16_matmul():
        return torch.bfloat16
    return None


def zero_stage_run(deepspeed: DeepSpeedSchema, world_size: int, precision: str) -> int:
    """The ZeRO stage DeepSpeed runs (module docstring)."""
    if (deepspeed.single_process_engine and world_size == 1 and precision == "fp32" and deepspeed.stage in (1, 2)
            and not deepspeed.offload_optimizer):
        return 0
    return deepspeed.stage
