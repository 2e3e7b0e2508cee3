"""The set-up does the slow one-time work, not the user's first run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bootstrap_compiles_deepspeeds_cpu_collective_op_so_training_loads_it():
    """The first `deepspeed.initialize` on a CPU JIT-compiles `deepspeed_shm_comm` (a minute or two on 2 cores)
    unless it is already built: scripts/bootstrap.sh builds it, and after that the op is found compiled."""
    assert "prebuild_deepspeed_ops.py" in (ROOT / "scripts" / "bootstrap.sh").read_text()
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "prebuild_deepspeed_ops.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    if "nothing to build" in out.stdout:
        pytest.skip("DeepSpeed has no compatible CPU shared-memory op on this machine")
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory("deepspeed_shm_comm", verbose=False))
    assert (build_dir / "deepspeed_shm_comm.so").is_file(), sorted(p.name for p in build_dir.iterdir())
