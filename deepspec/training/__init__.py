"""Drafter training under DeepSpeed ZeRO: `run(cfg)` (loop.py) from a Hydra-composed config (config.py)."""

from deepspec.training.loop import run

__all__ = ["finish_process", "run"]


def finish_process(stage: int, exit_code: int = 0) -> None:
    """End a train.py process: tear down the process group. ZeRO-3 on CPU can abort at interpreter exit after
    finishing ("terminate called without an active exception"); flushing and `os._exit(exit_code)` avoids it.
    Other stages exit normally."""
    import os
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if stage == 3:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
