"""The GPU check's harness: time shares, one failing check does not stop the others, statuses, the dry run."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepspec.gpu_check import runner
from deepspec.gpu_check.context import compact
from deepspec.gpu_check.profile import DRY_RUN, GPU, Profile, with_time_limit
from deepspec.gpu_check.runner import CHECKS, check_timeout, run_all, run_in_child

REPO = Path(__file__).resolve().parents[2]


def test_profiles_budget_every_check_within_the_time_limit():
    for profile in (GPU, DRY_RUN):
        assert set(profile.budgets_s) == set(CHECKS)
        assert sum(profile.budgets_s.values()) <= profile.time_limit_s


def test_a_time_limit_scales_every_budget_and_keeps_them_inside_it():
    for seconds in (60.0, 2000.0):
        scaled = with_time_limit(GPU, seconds)
        assert scaled.time_limit_s == seconds and sum(scaled.budgets_s.values()) <= seconds
        ratios = {name: scaled.budgets_s[name] / GPU.budgets_s[name] for name in CHECKS}
        assert max(ratios.values()) == pytest.approx(min(ratios.values()))
        assert (scaled.tv_rows, scaled.device) == (GPU.tv_rows, GPU.device)  # only the time changes
    with pytest.raises(ValueError, match="positive"):
        with_time_limit(GPU, 0)


def test_the_output_folder_is_required_and_never_read_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("OUT", "/nonexistent-out")
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["--device", "cpu"])
    assert exit_info.value.code == 2 and "--out is required" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        runner.main(["--device", "cpu", "--out", "x", "--time-limit", "0"])
    assert "--time-limit must be positive" in capsys.readouterr().err


def test_a_time_limit_reaches_the_run(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(runner, "run_all", lambda profile, out, work, only: seen.update(profile=profile) or
                        {"gpu_check": {"all_ok": True}})
    assert runner.main(["--device", "cpu", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "w"),
                        "--time-limit", "42"]) == 0
    assert seen["profile"].time_limit_s == 42 and seen["profile"].tv_rows == DRY_RUN.tv_rows


def script(tmp_path, *args, wheels=None):
    """scripts/gpu_check.sh with a stand-in interpreter that prints the arguments it gets, one call a line."""
    fake = tmp_path / "fake-python"
    fake.write_text('#!/usr/bin/env bash\necho "ARGS $*"\necho "PYTHONPATH ${PYTHONPATH:-}"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), OUT=str(tmp_path / "from-the-environment"))
    return subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_script_needs_the_output_folder_first_and_names_what_it_refuses(tmp_path):
    for args in ([], ["--", "--device", "cpu"], [str(tmp_path / "o"), "--device", "cpu"],
                 [str(tmp_path / "o"), "--wheels", str(tmp_path / "empty")]):
        (tmp_path / "empty").mkdir(exist_ok=True)
        proc = script(tmp_path, *args)
        assert proc.returncode == 2 and ("usage" in proc.stderr or "no wheels" in proc.stderr), args
    assert not (tmp_path / "from-the-environment").exists()


def test_the_script_passes_the_time_limit_and_the_check_arguments_and_installs_given_wheels(tmp_path):
    out = tmp_path / "o"
    proc = script(tmp_path, str(out), "--time-limit", "900", "--", "--device", "cpu", "--only", "target")
    assert proc.returncode == 0, proc.stderr
    call = [line for line in proc.stdout.splitlines() if line.startswith("ARGS -m deepspec.gpu_check")]
    assert call == [f"ARGS -m deepspec.gpu_check --out {out} --time-limit 900 --device cpu --only target"]
    assert "pip install" not in proc.stdout and (out / "gpu_check.log").is_file()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "example-1.0-py3-none-any.whl").write_bytes(b"")
    proc = script(tmp_path, str(out), "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stderr
    install = [line for line in proc.stdout.splitlines() if line.startswith("ARGS -m pip install")]
    assert len(install) == 1 and "--no-index" in install[0] and f"{wheels}/example-1.0-py3-none-any.whl" in install[0]
    path = proc.stdout.splitlines()[-1].removeprefix("PYTHONPATH ").split(":")
    assert "deepspec-gpu-check-site" in path[1]  # the installed folder first after the checkout itself
    assert not Path(path[1]).exists()  # and gone after the run


def test_unused_time_goes_to_later_checks_and_nothing_runs_past_the_deadline():
    profile = Profile(name="t", device="cpu", time_limit_s=110,
                      budgets_s={"acceptance": 10, "tv_loss": 10, "target": 10, "training": 50, "decoding": 20})
    order = list(CHECKS)
    # budgets sum to 100 of 110 s: 10 s of slack from the start
    assert check_timeout("acceptance", order, profile, started=0, now=0) == 20
    assert check_timeout("training", order, profile, started=0, now=5) == 85  # early checks left time over
    assert check_timeout("training", order, profile, started=0, now=70) == 40  # late: its budget, up to the deadline
    assert check_timeout("training", order, profile, started=0, now=45) == 50  # its own budget at least
    assert check_timeout("decoding", order, profile, started=0, now=95) == 15  # never past the deadline
    assert check_timeout("decoding", order, profile, started=0, now=120) == 0


def test_compact_rounds_floats_and_keeps_non_finite_readable():
    assert compact({"a": 1.23456789, "b": [float("nan"), 2], "c": None}) == {"a": 1.235, "b": ["nan", 2], "c": None}


def test_a_failed_check_skips_its_dependents_only(monkeypatch, tmp_path):
    statuses = {"acceptance": "ok", "tv_loss": "failed", "target": "error", "training": "ok", "decoding": "ok"}
    ran = []

    def fake_child(name, profile, work_dir, timeout):
        ran.append(name)
        return {"status": statuses[name], "figures": {}, "failures": [], "error": None, "wall_s": 0.0,
                "limit_s": timeout}

    monkeypatch.setattr(runner, "run_child", fake_child)
    report = run_all(DRY_RUN, tmp_path, tmp_path / "work")
    assert ran == ["acceptance", "tv_loss", "target"]
    checks = report["checks"]
    assert [checks[c]["status"] for c in CHECKS] == ["ok", "failed", "error", "skipped", "skipped"]
    assert "target" in checks["training"]["error"]
    assert report["gpu_check"]["all_ok"] is False
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report


def test_an_exception_in_a_check_is_recorded_with_its_traceback(monkeypatch, tmp_path):
    from deepspec.gpu_check import checks

    def check_acceptance(ctx):
        ctx.record("before", 1.0)
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(checks, "check_acceptance", check_acceptance)
    result_path = tmp_path / "acceptance.json"
    assert run_in_child("acceptance", "cpu", tmp_path, result_path, seconds=10) == 1
    result = json.loads(result_path.read_text())
    assert result["status"] == "error" and result["figures"] == {"before": 1.0}
    assert "RuntimeError: kernel exploded" in result["error"] and "Traceback" in result["error"]


def test_a_broken_part_of_a_check_is_recorded_and_the_rest_still_runs(monkeypatch, tmp_path):
    from deepspec.gpu_check import checks

    def check_training(ctx):
        def zero3():
            raise RuntimeError("ZeRO-3 hung up")

        assert ctx.attempt("train.py zero3", zero3) is None
        ctx.record("after", 2)

    monkeypatch.setattr(checks, "check_training", check_training)
    result_path = tmp_path / "training.json"
    assert run_in_child("training", "cpu", tmp_path, result_path, seconds=10) == 0
    result = json.loads(result_path.read_text())
    assert result["status"] == "failed" and result["figures"] == {"after": 2}
    assert result["failures"][0].startswith("train.py zero3: Traceback") and "ZeRO-3 hung up" in result["failures"][0]


def test_a_check_over_its_limit_is_stopped_with_its_figures_so_far(monkeypatch, tmp_path):
    """A real child process (sleeping past its limit after one figure) is killed with its process group."""
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{REPO}")
    # The child imports deepspec.gpu_check.checks; a sitecustomize replaces one check with a slow one.
    (tmp_path / "sitecustomize.py").write_text(
        "import time\n"
        "import deepspec.gpu_check.checks as checks\n"
        "def check_target(ctx):\n"
        "    ctx.record('written', 1)\n"
        "    time.sleep(60)\n"
        "checks.check_target = check_target\n")
    result = runner.run_child("target", DRY_RUN, tmp_path, timeout=8)
    assert result["status"] == "timeout" and result["figures"] == {"written": 1}


@pytest.mark.slow
def test_dry_run_of_the_whole_script(tmp_path):
    """scripts/gpu_check.sh --device cpu: every check runs its real code path at tiny sizes and ends ok;
    figures only a GPU can give are null, the others are there."""
    env = dict(os.environ, PYTHON=sys.executable)
    out = tmp_path / "out"
    start = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(out), "--", "--device", "cpu",
                           "--work-dir", str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - start
    report = json.loads((out / "gpu_check.json").read_text())
    assert proc.returncode == 0, json.dumps({k: (v["status"], v["failures"], v.get("error")) for k, v in
                                             report["checks"].items()})[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == report  # the last line printed is the report
    assert (out / "gpu_check.log").read_text().strip().endswith(proc.stdout.strip().splitlines()[-1])
    checks = report["checks"]
    assert list(checks) == list(CHECKS) and all(c["status"] == "ok" for c in checks.values())
    assert report["gpu_check"]["dry_run"] and report["gpu_check"]["all_ok"]
    print(f"dry run: {seconds:.0f} s; " + ", ".join(f"{k} {v['wall_s']} s" for k, v in checks.items()))

    acceptance = checks["acceptance"]["figures"]
    equality = acceptance["equality"]
    assert equality["cases"] == 4 * (len(DRY_RUN.accept_vocab_sizes) * len(DRY_RUN.accept_batch_sizes) + 1)
    assert equality["mismatched_cases"] == 0 and equality["errored_cases"] == 0
    timing = [dict(zip(acceptance["timing"]["columns"], row)) for row in acceptance["timing"]["rows"]]
    assert timing and all(r["torch_ms"] > 0 and r["triton_ms"] is None for r in timing)
    assert acceptance["goal_3x"]["met"] is None  # a GPU-only figure

    tv = checks["tv_loss"]["figures"]
    for dtype in ("float32", "bfloat16"):
        assert set(tv[dtype]["max_abs_diff"]) == {"ce", "tv", "soft_ce", "grad"}
        assert tv[dtype]["fused_fwd_bwd_ms"] is None and tv[dtype]["fused_peak_mb"] is None
    assert tv["loss_memory_entry_point"]["naive_peak_mb"] >= 0

    training = checks["training"]["figures"]
    assert training["cache"]["samples"] > 0
    assert set(training["runs"]) == {f"zero2/{k}" for k in ("dspark", "dflash", "eagle3", "mtp")} | {"zero3/eagle3",
                                                                                                  "zero3/mtp"}
    for run in training["runs"].values():
        assert run["steps"] == DRY_RUN.train_steps and run["loss_decreased"] and run["finite"]
        assert run["tokens_per_s_median"] > 0 and run["peak_mem_mb"] is None

    decoding = checks["decoding"]["figures"]
    for label in (f"{DRY_RUN.target_shape}/float32", f"{DRY_RUN.second_shape}/float32"):
        per_kind = {k: v for k, v in decoding["greedy_identity"][label].items() if k != "tokens"}
        assert len(per_kind) == 4 and all(v["identical"] for v in per_kind.values()), label
    assert set(decoding["bench_speed"]["drafters"]) == {"dspark", "dflash", "eagle3", "mtp"}
    assert all(row["T=0"]["verify_cost_ratio"] > 0 for row in decoding["bench_speed"]["drafters"].values())
    assert set(decoding["batched"]["tokens_per_s"]) == {str(c) for c in DRY_RUN.concurrency}
    assert decoding["batched"]["verify_cost_by_tokens"]["1"] == 1.0
