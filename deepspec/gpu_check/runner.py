"""Run the checks one after another, each in its own process with a time limit; write one JSON report.

Each check runs in a child process (`python -m deepspec.gpu_check --child NAME ...`, its own process
group), so a CUDA fault, a hung kernel or a crash ends that check only: the next one starts in a fresh
process. The child writes its result file after every figure it records, so a check stopped at its
time limit still reports what it measured. Statuses: `ok` (every property held), `failed` (it ran and a
property did not hold: see `failures`), `error` (an exception: see `error`, the traceback), `timeout`
(stopped at its limit), `skipped` (a check it needs did not end ok).

Time: check i may run until `deadline - sum(budgets of the checks after it)`, and at least its own
budget (never past the deadline): time an early check leaves unused goes to the later ones.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from deepspec.gpu_check.context import CheckContext
from deepspec.gpu_check.profile import PROFILES, Profile, with_time_limit
from deepspec.utils.io import atomic_write_json

CHECKS = ("acceptance", "tv_loss", "target", "training", "decoding")
NEEDS = {"training": "target", "decoding": "target"}  # check -> the check whose output it uses
INTERPRETED_ON_CPU = ("acceptance", "tv_loss")  # Triton kernels: TRITON_INTERPRET=1 in the dry run
REPORT_NAME = "gpu_check.json"
PACKAGES = ("torch", "triton", "transformers", "deepspeed", "hydra-core", "omegaconf", "pydantic", "numpy")


def check_timeout(name: str, order: list[str], profile: Profile, started: float, now: float) -> float:
    """Seconds check `name` may run (see module docstring)."""
    deadline = started + profile.time_limit_s
    later = order[order.index(name) + 1:]
    share = deadline - now - sum(profile.budgets_s[c] for c in later)
    return max(min(max(share, profile.budgets_s[name]), deadline - now), 0.0)


def child_env(name: str, profile: Profile) -> dict:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    if profile.dry_run:
        # One thread per process: on a shared few-core machine torch's thread pool spins against other
        # processes, and small layers run far slower than on one thread.
        env["OMP_NUM_THREADS"] = "1"
        if name in INTERPRETED_ON_CPU:
            env["TRITON_INTERPRET"] = "1"  # read when triton is imported: the child is a fresh process
    return env


def run_child(name: str, profile: Profile, work_dir: Path, timeout: float) -> dict:
    """Run one check in its own process group; kill the group at the time limit."""
    result_path = work_dir / "results" / f"{name}.json"
    result_path.parent.mkdir(parents=True, exist_ok=True)
    result_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "deepspec.gpu_check", "--child", name, "--device", profile.device,
               "--work-dir", str(work_dir), "--result", str(result_path), "--seconds", str(timeout)]
    start = time.monotonic()
    proc = subprocess.Popen(command, env=child_env(name, profile), start_new_session=True,
                            stdout=sys.stderr, stderr=sys.stderr)
    try:
        returncode = proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the check and every command it started
        proc.wait()
        returncode, timed_out = proc.returncode, True
    result = json.loads(result_path.read_text()) if result_path.is_file() else {"figures": {}, "failures": []}
    if timed_out:
        result["status"] = "timeout"
        result["error"] = f"stopped at its time limit ({timeout:.0f} s)"
    elif returncode != 0 and result.get("status") not in ("error", "timeout"):
        result["status"] = "error"
        result["error"] = result.get("error") or f"check process exited {returncode} (see the log)"
    result["wall_s"] = round(time.monotonic() - start, 1)
    result["limit_s"] = round(timeout, 1)
    return result


def run_in_child(name: str, device: str, work_dir: Path, result_path: Path, seconds: float) -> int:
    """The child's side: run check `name`, write its result file (also on an exception)."""
    from deepspec.gpu_check import checks

    ctx = CheckContext(name, PROFILES[device], work_dir, result_path, time.monotonic() + seconds)
    ctx.flush("running")
    try:
        getattr(checks, f"check_{name}")(ctx)
    except subprocess.TimeoutExpired as err:  # a command outlived the check's time: the parent's limit is next
        ctx.flush("timeout", f"{err.cmd[:3]}... did not finish within the check's time")
        return 1
    except Exception:  # recorded with its traceback; the parent goes on with the next check
        ctx.flush("error", traceback.format_exc()[-6000:])
        return 1
    ctx.flush("failed" if ctx.failures else "ok")
    return 0


def environment(profile: Profile) -> dict:
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    return {"profile": profile.name, "device": profile.device, "dry_run": profile.dry_run,
            "python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "packages": packages, "time_limit_s": profile.time_limit_s}


def run_all(profile: Profile, out_dir: Path, work_dir: Path, only: list[str] | None = None) -> dict:
    order = [c for c in CHECKS if only is None or c in only]
    started = time.monotonic()
    report = {"gpu_check": {**environment(profile), "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                            "work_dir": str(work_dir)}, "checks": {}}
    for name in order:
        needed = NEEDS.get(name)
        if needed and report["checks"].get(needed, {}).get("status", "ok") != "ok":
            report["checks"][name] = {"status": "skipped", "error": f"needs check {needed!r}, which did not end ok",
                                      "figures": {}, "failures": []}
            continue
        timeout = check_timeout(name, order, profile, started, time.monotonic())
        print(f"[gpu_check] {name}: start (limit {timeout:.0f} s)", file=sys.stderr, flush=True)
        report["checks"][name] = result = run_child(name, profile, work_dir, timeout)
        print(f"[gpu_check] {name}: {result['status']} in {result['wall_s']} s", file=sys.stderr, flush=True)
        atomic_write_json(out_dir / REPORT_NAME, report)  # a run cut short from outside still leaves a report
    report["gpu_check"]["wall_s"] = round(time.monotonic() - started, 1)
    report["gpu_check"]["all_ok"] = all(r["status"] == "ok" for r in report["checks"].values())
    atomic_write_json(out_dir / REPORT_NAME, report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepspec.gpu_check",
                                     description="The GPU half, checked (see deepspec/gpu_check/README.md).")
    parser.add_argument("--device", choices=sorted(PROFILES), default="cuda",
                        help="cuda: the real check; cpu: the dry run (tiny sizes, interpreted kernels)")
    parser.add_argument("--out", help="folder for gpu_check.json and the log (required)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="the whole run's time limit, every check's share scaled with it (default: "
                             + ", ".join(f"{p.time_limit_s:.0f} on {d}" for d, p in sorted(PROFILES.items())) + ")")
    parser.add_argument("--work-dir", default=None, help="scratch folder (default: <tmp>/deepspec-gpu-check)")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=None, help="run only these checks")
    parser.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return run_in_child(args.child, args.device, Path(args.work_dir), Path(args.result), args.seconds)
    if not args.out:
        parser.error("--out is required")
    profile = PROFILES[args.device]
    if args.time_limit is not None:
        if args.time_limit <= 0:
            parser.error(f"--time-limit must be positive, got {args.time_limit:g}")
        profile = with_time_limit(profile, args.time_limit)
    import tempfile

    work_dir = Path(args.work_dir or Path(tempfile.gettempdir()) / "deepspec-gpu-check").resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = run_all(profile, out_dir, work_dir, args.only)
    print(json.dumps(report, separators=(",", ":")))
    return 0 if report["gpu_check"]["all_ok"] else 1
