"""The float-sensitive tests also pass under a second CPU kernel set, not only under this machine's own.

torch picks its vectorised ATen kernels by instruction set (`ATEN_CPU_CAPABILITY`: default, avx2,
avx512, ...), and with them reduction orders, softmax/attention blocking and even the values
`torch.randn` draws. A bit-exact comparison that holds by luck on one set fails on a user's CPU. Tests
marked `float_exact` (cheap ones that compare computed floats bit for bit, or greedy tokens of two
computations) are re-run here in a child pytest under another set: `default` when this process runs a
vectorised one, else the machine's best.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CHILD_FLAG = "DEEPSPEC_SECOND_KERNEL_SET"  # set in the child, which must not start another child
# The child asserts the kernel set it got (torch ignores an unknown ATEN_CPU_CAPABILITY with a warning).
CHILD = ("import sys, torch, pytest; got = torch.backends.cpu.get_cpu_capability(); "
         "print('child kernel set:', got, flush=True); "
         "sys.exit(pytest.main(sys.argv[2:]) if got == sys.argv[1] else 'child runs kernel set ' + got)")


def _capability(env: dict[str, str]) -> str:
    probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
    return subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
def test_float_exact_tests_pass_under_a_second_cpu_kernel_set():
    if os.environ.get(CHILD_FLAG):
        pytest.skip("already the second kernel set's run")
    env = {**os.environ, CHILD_FLAG: "1"}
    current = torch.backends.cpu.get_cpu_capability()
    if current != "DEFAULT":
        env["ATEN_CPU_CAPABILITY"] = "default"
    else:
        env.pop("ATEN_CPU_CAPABILITY", None)
    other = _capability(env)
    if other == current:
        pytest.skip(f"this CPU offers no kernel set besides {current}")
    cmd = [sys.executable, "-c", CHILD, other, "-q", "--tb=short", "-m", "float_exact", "-p", "no:cacheprovider",
           str(REPO / "tests")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    failures = out[out.find("= FAILURES ="):] if "= FAILURES =" in out else out
    where = f"float_exact tests under kernel set {other} (this run: {current})"
    assert proc.returncode == 0, f"{where}:\n{failures[-6000:]}"
    assert f"child kernel set: {other}" in out and " passed" in out, out[-2000:]
