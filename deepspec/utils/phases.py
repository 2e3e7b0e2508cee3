"""Where a training step's CPU time goes: `with phase("forward"): ...` charges the process CPU time spent inside
to that phase while a `PhaseTimer` is active (`trainer.phase_times`, `deepspec bench train`), and costs one
global read otherwise.

Phases nest: an inner phase's time is charged to it alone (a parent gets its exclusive time), so the phases of a
step add up to the time spent inside any of them. The clock is `time.process_time()` (this process's user + system
CPU time): it never waits for a device, so timing adds no synchronisation; on a GPU it measures the host's side of
each phase (launching the kernels), not the kernels.

Phase names used by the training step (`STEP_PHASES`): data (reading samples and batching), target (the frozen
target's side: moving the batch, the target's logits in the loss), forward (the drafter), loss (the objective around
them), backward, optimizer (clipping, the update, the schedule), guards (finiteness checks, the step's scalars),
logging; `other` is the rest of the step (the loop itself).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict

STEP_PHASES = ("data", "target", "forward", "loss", "backward", "optimizer", "guards", "logging", "other")

_ACTIVE: PhaseTimer | None = None


class _NoPhase:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_NO_PHASE = _NoPhase()


class _Span:
    __slots__ = ("timer", "name", "start", "nested")

    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.nested = 0.0
        self.timer.stack.append(self)
        self.start = time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        elapsed = time.process_time() - self.start
        timer = self.timer
        timer.stack.pop()
        timer.totals[self.name] += elapsed - self.nested
        timer.spans += 1
        if timer.stack:
            timer.stack[-1].nested += elapsed


def phase(name: str):
    """A context manager charging its CPU time to `name` on the active timer; a shared no-op without one."""
    timer = _ACTIVE
    return _NO_PHASE if timer is None else _Span(timer, name)


class PhaseTimer:
    """Per-phase CPU seconds of the code run while it is active (`with PhaseTimer() as timer:`).

    `take()` closes an interval (a training step) and starts the next: the phases' CPU seconds since the last
    `take()` (`other`: the interval's CPU time that no phase claimed), how many phases were timed (the timer's own
    cost is that many `span_cost_s()`), and the interval's user and system CPU seconds and minor page faults (the
    kernel's share of a step: zeroing freshly mapped memory). One timer is active at a time, on the step's thread.
    """

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[_Span] = []
        self.spans = 0
        self._previous: PhaseTimer | None = None
        self._start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float, int]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.process_time(), usage.ru_utime, usage.ru_stime, usage.ru_minflt

    def __enter__(self) -> PhaseTimer:
        global _ACTIVE
        self._previous, _ACTIVE = _ACTIVE, self
        self.totals.clear()
        self.spans, self._start = 0, self._now()
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        _ACTIVE = self._previous

    def take(self) -> dict:
        """{"phase_cpu_s": {phase: CPU s}, "phase_spans", "user_s", "sys_s", "minor_faults"} since the last call."""
        now = self._now()
        (cpu0, user0, sys0, faults0), self._start = self._start, now
        totals, self.totals = dict(self.totals), defaultdict(float)
        totals["other"] = totals.get("other", 0.0) + (now[0] - cpu0) - sum(totals.values())
        order = {name: k for k, name in enumerate(STEP_PHASES)}
        phases = dict(sorted(totals.items(), key=lambda item: order.get(item[0], len(order))))
        spans, self.spans = self.spans, 0
        return {"phase_cpu_s": phases, "phase_spans": spans, "user_s": now[1] - user0, "sys_s": now[2] - sys0,
                "minor_faults": now[3] - faults0}


def span_cost_s(repeats: int = 20_000) -> float:
    """CPU seconds one timed phase costs (two clock reads and the bookkeeping), measured here and now."""
    with PhaseTimer():
        start = time.process_time()
        for _ in range(repeats):
            with phase("calibration"):
                pass
        return (time.process_time() - start) / repeats
