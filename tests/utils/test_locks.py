"""Exclusive folder locks: a second holder fails naming the first; a killed holder never blocks later runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deepspec.utils.locks import LockHeldError, exclusive_lock

REPO = Path(__file__).resolve().parents[2]


class LockHolder:
    """Another process holding `path` (what a running cache build or training run does)."""

    def __init__(self, path: Path):
        code = textwrap.dedent(f"""
            import sys, time
            from deepspec.utils.locks import exclusive_lock
            with exclusive_lock({str(path)!r}, "test"):
                print("locked", flush=True)
                time.sleep(600)
        """)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-c", code, "holder-marker"], env=env, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "locked"

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def lock_holder():
    holders = []
    yield lambda path: holders.append(LockHolder(path)) or holders[-1]
    for holder in holders:
        if holder.proc.poll() is None:
            holder.kill()


def test_second_holder_fails_naming_the_first(tmp_path, lock_holder):
    path = tmp_path / ".lock"
    holder = lock_holder(path)
    with pytest.raises(LockHeldError, match=rf"{path}: the thing is being written by another run: pid "
                                            rf"{holder.proc.pid} on .* \(command: -c holder-marker\)"):
        with exclusive_lock(path, "the thing"):
            pass
    holder.kill()  # killed, not exited cleanly: the kernel releases the lock all the same
    with exclusive_lock(path, "the thing"):
        assert f'"pid": {os.getpid()}' in path.read_text()


def test_lock_is_released_after_the_block_and_on_error(tmp_path):
    path = tmp_path / "sub" / ".lock"
    with pytest.raises(RuntimeError, match="boom"):
        with exclusive_lock(path, "x"):
            with pytest.raises(LockHeldError):  # held, even within the same process
                with exclusive_lock(path, "x"):
                    pass
            raise RuntimeError("boom")
    with exclusive_lock(path, "x"):
        pass
