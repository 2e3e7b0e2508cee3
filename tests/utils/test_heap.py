"""`keep_freed_memory`: a training-like loop that frees and allocates the same large blocks every step reuses their
pages instead of faulting in fresh ones (in a subprocess: the setting is the whole process's)."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CODE = """
import resource, sys
import torch
from deepspec.utils.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
x, w = torch.randn(1024, 64), torch.randn(16384, 64, requires_grad=True)
def step():  # a loss step's pattern: [1024, 16384] fp32 logits (64 MB, above glibc's largest automatic mmap
    torch.log_softmax(x @ w.T, dim=-1).mean().backward()  # threshold), their softmax and gradients, freed each step
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    def page_faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, check=True, cwd=REPO,
                             env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        return int(out.stdout.split()[-1])

    plain, kept = page_faults("plain"), page_faults("keep")
    assert plain > 10 * (64 << 20) // 4096  # at least one fresh 64 MB block per step
    assert kept < plain / 10
