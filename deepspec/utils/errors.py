"""How every command line reports a refusal: one line `<prog>: error: <message>` on stderr and an exit status,
no traceback. A bug keeps its traceback.

Exit 2: the command line or its configuration is wrong (argparse's own errors, `UsageError`: an unknown config
key or a wrong type, Hydra's report of a bad override: deepspec.utils.hydra_command). Exit 1: the command could
not be carried out with what it was given (a missing, damaged or refused file, a full disk, a failed generation,
a held lock, a diverged run). Exit 143 (128 + SIGTERM): a long job (train, cache) stopped on SIGTERM at a safe
point, its line saying what was kept and how to resume (deepspec.utils.termination).

Which exceptions are refusals, not bugs: the project raises ValueError for bad input or settings (naming the
file, line or field) and `assert`, TypeError or RuntimeError for its own invariants, so
- a ValueError raised by DeepSpec's own code is a refusal; one raised inside another library (torch, numpy,
  json) is a bug or an unnamed failure and keeps its traceback;
- an OSError (a missing or refused file, a permission, a model hub that has no such repo) is a refusal
  wherever it was raised: its message names the path;
- `ReportedFailure` subclasses (LockHeldError, GenerationFailed, NonFiniteTrainingError) are refusals;
- a stage run as a subprocess that failed (CalledProcessError) already reported its own error;
- a write that found the disk full, whatever wrapped it (safetensors' SafetensorError): the project's writers
  raise it as a `DiskFullError` naming the path, what it needed and what survives (deepspec.utils.io); one
  that got past them is still one line.
`--debug` (any command) or DEEPSPEC_DEBUG=1 shows the traceback of every refusal too.

Only the process's own command line is reported so: an entry point called from Python with an explicit
`argv` (tests, a program driving a stage) gets the exception to catch.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from deepspec.utils.io import is_disk_full
from deepspec.utils.redact import redact_urls

DEBUG_ENV = "DEEPSPEC_DEBUG"
DEBUG_FLAG = "--debug"
USAGE_EXIT, FAILURE_EXIT = 2, 1
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


class UsageError(ValueError):
    """The command line or the configuration is wrong (exit 2); a ValueError, so callers catching that still do."""


class ReportedFailure(Exception):
    """Mixin of the non-ValueError failures whose message says everything a user needs (exit 1, no traceback)."""


def debug_requested() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def take_debug_flag(argv: list[str]) -> list[str]:
    """`argv` without `--debug`; when it was there, DEEPSPEC_DEBUG=1 is set (stages run as subprocesses inherit it)."""
    if DEBUG_FLAG in argv:
        os.environ[DEBUG_ENV] = "1"
    if debug_requested():
        os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra jobs: the complete traceback, not Hydra's stripped one
    return [arg for arg in argv if arg != DEBUG_FLAG]


def _raised_by_deepspec(error: BaseException) -> bool:
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE_DIR)


def exit_code_of(error: BaseException) -> int | None:
    """The exit status a refusal reports, or None for a bug (its traceback is printed)."""
    if isinstance(error, UsageError):
        return USAGE_EXIT
    if isinstance(error, ReportedFailure):
        return getattr(error, "exit_code", FAILURE_EXIT)  # a job stopped by SIGTERM: 143 (deepspec.utils.termination)
    if isinstance(error, (OSError, subprocess.CalledProcessError)):
        return FAILURE_EXIT
    if isinstance(error, ValueError) and _raised_by_deepspec(error):
        return FAILURE_EXIT
    if is_disk_full(error):
        return FAILURE_EXIT
    return None


def one_line(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):  # the stage printed its own error above
        command = error.cmd if isinstance(error.cmd, str) else " ".join(map(str, error.cmd))
        return f"{command} failed (exit {error.returncode}); its error is above"
    if is_disk_full(error) and not (isinstance(error, OSError) and error.filename):
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return (f"no space left on device ({type(error).__name__}: {first}); which file was being written is not "
                f"known here ({DEBUG_FLAG} shows where); free some space, then rerun")
    return str(error).strip() or type(error).__name__


@contextmanager
def reported_errors(prog: str) -> Iterator[None]:
    """Report a refusal raised in the block as `prog: error: message` and exit with its status; let a bug through."""
    try:
        yield
    except Exception as error:
        code = exit_code_of(error)
        if code is None or debug_requested():
            raise
        sys.stdout.flush()
        # A URL in a message (a server's address) never shows its credentials.
        print(f"{prog}: error: {redact_urls(one_line(error))}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None


def command_line(prog: str) -> Callable:
    """Decorate an argparse entry point `main(argv=None) -> int`: `--debug` is taken out of argv and, when argv
    is the process's (None), refusals are reported by `reported_errors`. The same function serves
    `deepspec <stage>` (which reports for it) and the stage's script."""

    def decorate(main: Callable) -> Callable:
        @functools.wraps(main)
        def wrapper(argv: list[str] | None = None, *args, **kwargs):
            if argv is not None:  # a caller in Python: it gets the exception
                return main(take_debug_flag(list(argv)), *args, **kwargs)
            with reported_errors(prog):
                return main(take_debug_flag(sys.argv[1:]), *args, **kwargs)

        return wrapper

    return decorate
