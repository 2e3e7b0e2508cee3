"""SIGTERM inside `stop_on_sigterm` is recorded, not fatal; the handler is restored after the block or on release;
a `Terminated` job is reported with exit 143. The real jobs are tested as subprocesses (tests/training/test_resume.py,
tests/cache/test_cache_cli.py)."""

from __future__ import annotations

import os
import signal

from deepspec.utils.errors import exit_code_of
from deepspec.utils.termination import Terminated, stop_on_sigterm


def test_a_sigterm_in_the_block_is_recorded_and_the_handler_put_back(capfd):
    before = signal.getsignal(signal.SIGTERM)
    with stop_on_sigterm("finishing the step") as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # said once
        assert stop.requested and stop.signum == signal.SIGTERM
        stop.release()
        assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGTERM) is before
    assert capfd.readouterr().err == "SIGTERM received: finishing the step\n"


def test_a_terminated_job_exits_143():
    assert exit_code_of(Terminated("stopped by SIGTERM")) == 143 == 128 + signal.SIGTERM
