"""Stop a long job at a safe point on SIGTERM, what SLURM and Kubernetes send before SIGKILL.

`stop_on_sigterm(what)` installs a SIGTERM handler for the block that only records the signal and says once on
stderr what the job does now (`what`). The job asks `requested` at its safe points (training: between optimizer
steps, the ranks agreeing; the cache: between batches), makes durable what it has or drops the unfinished part,
and raises `Terminated`, whose message says what was kept and how to resume. A command reports it in one line and
exits 143 (128 + SIGTERM), the status of a process SIGTERM killed, so a scheduler or a script sees the same.
Outside the main thread (Python installs handlers there only) the block keeps the default handler.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from deepspec.utils.errors import ReportedFailure

TERMINATED_EXIT = 128 + signal.SIGTERM


class Terminated(ReportedFailure, RuntimeError):
    """The job stopped on SIGTERM at a safe point; the message says what was kept and how to resume."""

    exit_code = TERMINATED_EXIT


class StopRequest:
    """Whether a SIGTERM arrived during the `stop_on_sigterm` block."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._restore = None  # puts back the handler the block replaced

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def release(self) -> None:
        """From here on SIGTERM does what it did before the block (by default: end the process at once), for a
        last phase that has no safe point worth waiting for."""
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()


@contextmanager
def stop_on_sigterm(what: str) -> Iterator[StopRequest]:
    """A `StopRequest` set by SIGTERM inside the block (the signal no longer kills the process there)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def record(signum, frame) -> None:
        if request.signum is None:  # os.write: a handler may run while the main thread is inside print()
            os.write(2, f"SIGTERM received: {what}\n".encode())
        request.signum = signum

    previous = signal.signal(signal.SIGTERM, record)
    request._restore = lambda: signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    try:
        yield request
    finally:
        request.release()
