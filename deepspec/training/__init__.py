"""Drafter training under DeepSpeed ZeRO: `run(cfg)` from a Hydra-composed config (config.py).

A run reads in one direction: the config is checked (config.py) and the rank placed (placement.py) while the session
is assembled (session.py), which builds each component from its own section (data.py, engine.py, checkpoint.py);
then the loop trains it (loop.py) and the end-of-training hooks run (hooks.py).
"""

from __future__ import annotations

from typing import Callable

from deepspec.drafters.spec import capabilities_of
from deepspec.training.hooks import calibrate_confidence
from deepspec.training.loop import train
from deepspec.training.session import Session, build_session
from deepspec.utils.termination import stop_on_sigterm

__all__ = ["finish_process", "run"]


def run(cfg, out_dir: str | None = None, on_train_end: list[Callable] | None = None,
        on_start: list[Callable[[Session], None]] | None = None) -> dict:
    """Train from a composed config (DictConfig / dict / TrainConfig). Returns a summary dict. `on_start`: called
    with the session once it is built, holding the output folder's lock (e.g. to record the run there)."""
    session = build_session(cfg, out_dir=out_dir, on_train_end=on_train_end)
    if session.cfg.calibration.enabled and capabilities_of(session.drafter).confidence_head:
        session.on_train_end.append(calibrate_confidence)  # after the caller's hooks
    try:
        for callback in on_start or []:
            callback(session)
        with stop_on_sigterm("saving a checkpoint after the current optimizer step, then exiting") as stop:
            return train(session, stop)
    finally:
        session.engine.destroy()
        session.lock.close()  # releases this rank's lock on the output folder


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
