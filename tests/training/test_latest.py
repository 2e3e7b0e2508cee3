"""`python -m deepspec.training.latest RUN_DIR`: the drafter of the checkpoint a rerun would resume from, never a
half-written `.tmp` folder nor a damaged one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec.training.latest import latest_drafter_dir

REPO = Path(__file__).resolve().parents[2]


def test_the_newest_valid_checkpoint_is_taken_past_a_half_written_and_a_damaged_one(tmp_path, fake_checkpoint, caplog):
    run = tmp_path / "run"
    fake_checkpoint(run, 2)
    valid = fake_checkpoint(run, 4)
    fake_checkpoint(run, 8, complete=False)  # killed while saving: no checksums, still .tmp
    assert latest_drafter_dir(run) == valid / "drafter"
    damaged = fake_checkpoint(run, 6)
    (damaged / "drafter" / "model.safetensors").write_text("flipped")
    assert latest_drafter_dir(run) == valid / "drafter"
    assert any("step-00000006 is damaged" in r.getMessage() for r in caplog.records)


def test_the_command_prints_the_folder_and_refuses_a_run_without_checkpoints_in_one_line(tmp_path, fake_checkpoint):
    run = tmp_path / "run"
    valid = fake_checkpoint(run, 3)
    fake_checkpoint(run, 5, complete=False)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "deepspec.training.latest"]
    proc = subprocess.run([*command, str(run)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"{valid / 'drafter'}\n", proc.stderr
    proc = subprocess.run([*command, str(tmp_path / "empty")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{tmp_path / 'empty' / 'checkpoints'}: no complete checkpoint" in proc.stderr


@pytest.mark.parametrize("name", ["step-00000007.tmp", "step-7"])
def test_folders_that_are_not_checkpoints_are_never_taken(tmp_path, fake_checkpoint, name):
    run = tmp_path / "run"
    valid = fake_checkpoint(run, 1)
    (run / "checkpoints" / name / "drafter").mkdir(parents=True)
    assert latest_drafter_dir(run) == valid / "drafter"
