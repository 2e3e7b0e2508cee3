"""Which process this is, and its torch.distributed process group, made explicit.

`Launch` is read once from a launcher's variables (torchrun / deepspeed set RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) or, without a launcher, describes a single process. `init_distributed(launch,
device)` creates the process group from it: env:// rendezvous under a launcher, a free local TCP port for a
single process (so DeepSpeed adopts that group and never looks for MPI). The only environment variable it
writes is LOCAL_RANK, when absent: DeepSpeed's engine reads it from the environment and has no argument
for it.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Launch:
    """This process's place in the job: from a launcher (torchrun / deepspeed) or a plain single process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    launched: bool = False  # True: the launcher set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (env:// rendezvous)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "Launch":
        environ = os.environ if environ is None else environ
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            return cls()
        rank = int(environ["RANK"])
        return cls(rank=rank, local_rank=int(environ.get("LOCAL_RANK", rank)), world_size=int(environ["WORLD_SIZE"]),
                   launched=True)


def init_distributed(launch: Launch, device: torch.device) -> None:
    """Create this process's torch.distributed group (idempotent); DeepSpeed adopts an existing group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    # DeepSpeed's engine reads LOCAL_RANK from the environment (runtime/engine.py) and has no argument for it.
    os.environ.setdefault("LOCAL_RANK", str(launch.local_rank))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launch.launched:
        dist.init_process_group(backend, init_method="env://", rank=launch.rank, world_size=launch.world_size)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
