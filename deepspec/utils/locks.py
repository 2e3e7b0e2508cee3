"""Exclusive per-folder locks: a second writer into the same folder fails at once, naming the holder.

`exclusive_lock(path, what)` takes a non-blocking `fcntl.flock` on `path` and writes who holds it (pid,
host, start time, command line) into the file. The kernel releases the lock when the holder exits, even
when it is killed, so a lock file left behind never blocks a later run: only a live holder does.
`remove_free_lock` deletes a lock file nobody holds (the folder of a run that never started goes with it); a
lock taken on a file that was deleted meanwhile is taken again on the file now at the path.
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
from deepspec.utils.redact import redact_urls


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
    fd = _locked_fd(path, what)
    try:
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  "command": redact_urls(" ".join(sys.argv))}  # a --base-url's password stays out
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _locked_fd(path: Path, what: str) -> int:
    """An open descriptor of the file at `path` holding its exclusive lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LockHeldError(f"{path}: {what} is being written by another run: {_holder_description(path)}. "
                                "Wait for it to finish or stop it; nothing was changed") from None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # removed by `remove_free_lock` between open and lock: lock the file at the path now


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def remove_free_lock(path: str | os.PathLike) -> bool:
    """Delete the lock file `path` unless a live process holds it; True when it is gone."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if _same_file(fd, Path(path)):
            os.unlink(path)  # while holding it: a process that opened it meanwhile sees it gone and retries
        return True
    finally:
        os.close(fd)
