"""Exclusive per-folder locks: a second writer into the same folder fails at once, naming the holder.

`exclusive_lock(path, what)` takes a non-blocking `fcntl.flock` on `path` and writes who holds it (pid,
host, start time, command line) into the file. The kernel releases the lock when the holder exits, even
when it is killed, so a lock file left behind never blocks a later run: only a live holder does.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deepspec.utils.errors import ReportedFailure


class LockHeldError(ReportedFailure, RuntimeError):
    """Another live process holds the lock."""


def _holder_description(path: Path) -> str:
    try:
        holder = json.loads(path.read_text(encoding="utf-8"))
        return (f"pid {holder['pid']} on {holder['host']}, since {holder['started']} "
                f"(command: {holder['command']})")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet recorded itself"


@contextmanager
def exclusive_lock(path: str | os.PathLike, what: str) -> Iterator[Path]:
    """Hold an exclusive lock on `path` for the block; `what` says what it protects (for the error)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LockHeldError(f"{path}: {what} is being written by another run: {_holder_description(path)}. "
                                "Wait for it to finish or stop it; nothing was changed") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
