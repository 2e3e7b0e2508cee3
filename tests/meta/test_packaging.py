"""What ships: stage packages hold library code, every benchmark lives in `deepspec.benchmarks`, and an installed
wheel (no checkout beside it) runs the benchmarks and the GPU check."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deepspec.benchmarks import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]


def test_every_benchmark_lives_in_the_benchmarks_package():
    stray = [str(p.relative_to(REPO)) for p in (REPO / "deepspec").rglob("bench*.py")
             if p.parent.name != "benchmarks"]
    assert not stray, stray
    assert all(module.startswith("deepspec.benchmarks.") for module in BENCHMARKS.values())
    assert not list((REPO / "eval").glob("bench_*.py"))  # one way to run a benchmark: `deepspec bench NAME`


@pytest.mark.parametrize("folder", ["deepspec", "eval", "data_tools", "scripts"])
def test_shipped_code_never_imports_the_tests(folder):
    offenders = []
    for path in (REPO / folder).rglob("*.py"):
        text = path.read_text()
        tree = ast.parse(text)
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        if any(name == "tests" or name.startswith("tests.") for name in names) or '"tests"' in text:
            offenders.append(str(path.relative_to(REPO)))
    assert not offenders, offenders


@pytest.mark.slow
def test_an_installed_wheel_runs_the_benchmarks_and_the_gpu_check(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(REPO)], check=True, capture_output=True, timeout=600)
    (wheel,) = wheels.glob("deepspec-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "deepspec/benchmarks/learning.py" in names and "deepspec/gpu_check/project.py" in names
    assert not any(name.startswith("tests/") for name in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    env = dict(os.environ, PYTHONPATH=str(site))  # the wheel first; the checkout is not on the path
    work = tmp_path / "elsewhere"
    work.mkdir()

    def run(*args):
        return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=600)

    where = run("-c", "import deepspec; print(deepspec.__file__)")
    assert where.stdout.strip().startswith(str(site)), where
    for name in ("learning", "train", "speed"):
        proc = run("-m", "deepspec.cli", "bench", name, "--help")
        assert proc.returncode == 0 and "usage" in proc.stdout, (name, proc.stderr[-2000:])
    proc = run("-m", "deepspec.gpu_check", "--help")
    assert proc.returncode == 0 and "usage" in proc.stdout, proc.stderr[-2000:]


def test_the_torch_floor_holds_the_flex_attention_the_cuda_path_uses():
    """Block drafters attend with torch.nn.attention.flex_attention on CUDA (their default there), which torch has
    from 2.5 on: a floor below it installs a torch whose first training step fails. CI's CPU pin stays inside."""
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    attention = REPO / "deepspec" / "drafters" / "block" / "attention.py"
    assert "torch.nn.attention.flex_attention" in attention.read_text()
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [r for r in map(Requirement, dependencies) if r.name == "torch"]
    assert not torch.specifier.contains("2.4.1") and torch.specifier.contains("2.5.0")
    pinned = next(line for line in (REPO / "requirements" / "ci.txt").read_text().splitlines()
                  if line.startswith("torch=="))
    assert torch.specifier.contains(pinned.removeprefix("torch=="))
