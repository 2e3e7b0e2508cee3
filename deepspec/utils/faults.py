"""Fault injection, one convention for every resumable job (tests only): stop after N units, as if killed.

A job takes an explicit `FaultInjection` (its config's `faults:` section, `faults.stop_after=N` on the
command line; never an environment variable) and asks `should_stop(units_done)` after each unit it makes
durable - a training step, a cache shard. What "stopping" does is the job's: training returns as if the
process died (only the periodic checkpoints on disk), the cache writer raises `InjectedFault` between shards.
"""

from __future__ import annotations

from dataclasses import dataclass
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
