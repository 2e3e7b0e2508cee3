"""Fault injection, one convention for every resumable job (tests only): stop after N units, as if killed.

A job takes an explicit `FaultInjection` (its config's `faults:` section, `faults.stop_after=N` on the
command line; never an environment variable) and asks `should_stop(units_done)` after each unit it makes
durable - a training step, a cache shard. What "stopping" does is the job's: training returns as if the
process died (only the periodic checkpoints on disk), the cache writer raises `InjectedFault` between shards.

A full disk has its own switch, `full_disk(folder, free_bytes)` (a test's context, for this process): the
project's writers under `folder` (deepspec.utils.io's atomic writers, a checkpoint, a regenerated line) ask
`claim_space` before they make a write final, and one needing more than is left fails with the OSError a write()
gets on a full disk. Writers outside DeepSpec's own do not ask: a real small disk (a tmpfs) tests those.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class InjectedFault(RuntimeError):
    """Raised by a job that stops on a `FaultInjection` (the message says "injected failure")."""


@dataclass
class FaultInjection:
    stop_after: Optional[int] = None  # units of work (steps, shards) after which the job stops as if killed

    def __post_init__(self) -> None:
        if self.stop_after is not None and (isinstance(self.stop_after, bool) or int(self.stop_after) != self.stop_after
                                            or self.stop_after < 0):
            raise ValueError(f"faults.stop_after={self.stop_after!r} must be a non-negative integer or null")

    def should_stop(self, units_done: int) -> bool:
        return self.stop_after is not None and units_done >= self.stop_after


_FULL_DISKS: dict[Path, list[int]] = {}  # folder -> [the bytes still free under it]


@contextmanager
def full_disk(folder, free_bytes: int = 0) -> Iterator[None]:
    """Tests only: writes under `folder` behave as on a disk with `free_bytes` left (see the module docstring)."""
    folder = Path(folder).resolve()
    _FULL_DISKS[folder] = [int(free_bytes)]
    try:
        yield
    finally:
        _FULL_DISKS.pop(folder, None)


def _full_disk_of(path) -> Path | None:
    path = Path(path).resolve()
    return next((folder for folder in _FULL_DISKS if path == folder or folder in path.parents), None)


def claim_space(path, num_bytes: int) -> None:
    """Take `num_bytes` of a simulated full disk holding `path`; ENOSPC when fewer are left. Nothing otherwise."""
    folder = _full_disk_of(path) if _FULL_DISKS else None
    if folder is None:
        return
    left = _FULL_DISKS[folder]
    if num_bytes > left[0]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    left[0] -= num_bytes


def simulated_free_bytes(path) -> int | None:
    """The bytes left on a simulated full disk holding `path`; None where no disk is simulated."""
    folder = _full_disk_of(path) if _FULL_DISKS else None
    return None if folder is None else _FULL_DISKS[folder][0]
