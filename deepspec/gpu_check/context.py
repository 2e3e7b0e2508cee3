"""What a check function gets (`CheckContext`) and how its figures are written: shared by the runner, which
creates one per child process, and the checks (checks.py), which fill it.
"""

from __future__ import annotations

import math
import subprocess
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from deepspec.gpu_check.profile import Profile
from deepspec.utils.io import atomic_write_json

LOG_TAIL_CHARS = 3000
MAX_FAILURES_SHOWN = 12


class StepFailed(RuntimeError):
    """A command a check ran exited non-zero (message: the command and the tail of its log)."""


@dataclass
class CheckContext:
    """What a check function gets: its profile, a work folder, and where its figures go."""

    name: str
    profile: Profile
    work_dir: Path
    result_path: Path
    deadline: float  # time.monotonic() value at which the parent stops this check
    figures: dict = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def device(self) -> str:
        return self.profile.device

    def record(self, key: str, value) -> None:
        self.figures[key] = compact(value)
        self.flush("running")

    def expect(self, condition: bool, message: str) -> bool:
        """A property of the check; a false one makes the status `failed` (the check goes on). The first
        MAX_FAILURES_SHOWN messages are kept whole, later ones only counted (the report stays readable)."""
        if not condition:
            if len(self.failures) < MAX_FAILURES_SHOWN:
                self.failures.append(message)
            elif len(self.failures) == MAX_FAILURES_SHOWN:
                self.failures.append("(further failures counted in figures.failures_not_shown)")
            if len(self.failures) > MAX_FAILURES_SHOWN:
                self.figures["failures_not_shown"] = self.figures.get("failures_not_shown", 0) + 1
            self.flush("running")
        return bool(condition)

    def attempt(self, label: str, fn, *args, **kwargs):
        """`fn(*args, **kwargs)`, or None when it raises: the failure is recorded (label and the end of the
        traceback) and the check goes on, so one broken part does not hide the parts after it."""
        try:
            return fn(*args, **kwargs)
        except subprocess.TimeoutExpired:
            raise  # out of time: the check ends here
        except Exception as err:
            detail = str(err) if isinstance(err, StepFailed) else traceback.format_exc()
            self.expect(False, f"{label}: {detail[-LOG_TAIL_CHARS // 2:]}")
            return None

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def flush(self, status: str, error: str | None = None) -> None:
        atomic_write_json(self.result_path, {"status": status, "figures": self.figures, "failures": self.failures,
                                             "error": error})

    def run(self, command: list[str], log_name: str, env: dict | None = None) -> tuple[str, float]:
        """Run a command (an entry point) to completion within this check's time; (stdout, seconds).

        Its output goes to logs/<log_name>.log in the work folder; a non-zero exit raises StepFailed
        with the tail of that log."""
        log_path = self.work_dir / "logs" / f"{log_name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(command) + "\n")
            log.flush()
            proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                  timeout=max(self.remaining(), 1.0), cwd=self.work_dir)
            log.write(proc.stdout)
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise StepFailed(f"{log_name}: exit {proc.returncode} after {seconds:.1f}s: {' '.join(command)}\n"
                             f"--- tail of {log_path} ---\n{log_path.read_text()[-LOG_TAIL_CHARS:]}")
        return proc.stdout, seconds


def compact(value, digits: int = 4):
    """Floats rounded to `digits` significant digits (the report stays short); non-finite floats as strings."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {str(k): compact(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [compact(v, digits) for v in value]
    return value
