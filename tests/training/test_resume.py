"""Resume: a run killed after step k and resumed matches the uninterrupted run; resume with fewer processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deepspec.training.checkpoint import list_checkpoints


def test_killed_then_resumed_run_matches_uninterrupted(tt, tiny_cache, reference_run, tmp_path):
    from deepspec.training import run

    overrides = tt.train_overrides(tiny_cache, tmp_path, "trainer.save_every=2")
    stopped = run(tt.compose([*overrides, "faults.stop_after=3"]))
    assert stopped["stopped"] and stopped["step"] == 3
    # Only the periodic checkpoint exists: the run died at step 3 without saving it.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000002"]
    resumed = run(tt.compose(overrides))
    assert resumed["step"] == 4 and not resumed["stopped"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # Step 3 was logged before the kill and again after the resume from step 2: the log holds it once.
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]
    losses = {r["step"]: r["loss"] for r in records if r["split"] == "train"}
    reference = tt.train_losses(reference_run)
    assert [losses[s] for s in (1, 2, 3, 4)] == pytest.approx(reference, rel=1e-6, abs=1e-7)


def test_keep_last_prunes_old_checkpoints(tt, tiny_cache, tmp_path):
    from deepspec.training import run

    run(tt.compose(tt.train_overrides(tiny_cache, tmp_path, "trainer.save_every=1", "trainer.keep_last=2")))
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]


@pytest.mark.slow
def test_resume_two_processes_then_one(tt, tiny_cache, reference_run, tmp_path):
    """2 ranks (micro batch 2 each) and 1 rank (2 micro steps of 2) see the same micro batches, so the
    resumed single-process steps match the uninterrupted single-process reference. With an average of the weights
    (ZeRO-2 across the ranks): it changes no step, and the trained weights it checkpoints beside it are the
    reference's."""
    from safetensors.torch import load_file

    from deepspec.training import run
    from deepspec.training.checkpoint import DRAFTER_DIR, TRAINING_WEIGHTS_FILE

    overrides = tt.train_overrides(tiny_cache, tmp_path, "trainer.save_every=2", "trainer.ema_decay=0.5")
    cmd = tt.torchrun(2, *overrides, "faults.stop_after=2", f"hydra.run.dir={tmp_path}")
    proc = subprocess.run(cmd, env=tt.subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((tmp_path / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert state["world_size"] == 2
    run(tt.compose(overrides))
    losses = tt.train_losses(tmp_path)
    assert losses == pytest.approx(tt.train_losses(reference_run), rel=1e-4)
    trained = load_file(str(list_checkpoints(tmp_path)[-1] / TRAINING_WEIGHTS_FILE))
    reference = load_file(str(list_checkpoints(reference_run)[-1] / DRAFTER_DIR / "model.safetensors"))
    assert trained.keys() == reference.keys()
    for name, weights in trained.items():
        assert torch.allclose(weights, reference[name], rtol=1e-3, atol=1e-5), name


def wait_until(condition, proc: subprocess.Popen, what: str, timeout_s: float = 300.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the process ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.1)


def test_sigterm_saves_the_current_step_and_the_rerun_continues_from_it(tt, tiny_cache, tmp_path):
    """`train.py` sent SIGTERM mid-run (as SLURM or Kubernetes do): it finishes the optimizer step, saves it, says
    where and how to resume in one line and exits 143; the rerun resumes from that step and its steps are the
    uninterrupted run's."""
    import signal

    from deepspec.training import run
    from deepspec.training.checkpoint import checkpoint_problems, read_trainer_state

    out = tmp_path / "run"
    long_run = ["trainer.max_steps=400", "trainer.save_every=1000"]  # no periodic checkpoint before the signal
    overrides = tt.train_overrides(tiny_cache, out, *long_run)
    metrics = out / "metrics.jsonl"
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "deepspec.cli", "train", *overrides, f"hydra.run.dir={out}"],
                                env=tt.subprocess_env(), cwd=tmp_path,
                                stdout=stdout, stderr=stderr)
        try:
            wait_until(lambda: metrics.is_file() and metrics.read_text().count('"split": "train"') >= 2, proc,
                       "second training step")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=300) == 143
        finally:
            proc.kill()
    checkpoints = list_checkpoints(out)
    assert len(checkpoints) == 1 and checkpoint_problems(checkpoints[0]) == []
    step = read_trainer_state(checkpoints[0]).step
    assert step >= 2
    errors = [line for line in (tmp_path / "stderr").read_text().splitlines() if "error:" in line]
    assert errors == [f"deepspec train: error: stopped by SIGTERM after step {step} of 400: saved the checkpoint "
                      f"{checkpoints[0]}; rerun the same command to resume from it"]
    resumed = run(tt.compose([*overrides, f"faults.stop_after={step + 2}"]))
    assert resumed["step"] == step + 2
    reference = run(tt.compose([*tt.train_overrides(tiny_cache, tmp_path / "reference", *long_run),
                                f"faults.stop_after={step + 2}"]))
    assert reference["step"] == step + 2
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, step + 3))
    assert tt.train_losses(out) == pytest.approx(tt.train_losses(tmp_path / "reference"), rel=1e-6, abs=1e-7)
