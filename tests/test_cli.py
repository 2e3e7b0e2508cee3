"""The `deepspec` console script: a subcommand for every stage and benchmark, forwarding to the stage's own
parser; Hydra stages compose the packaged configs (deepspec/conf) from any working directory."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepspec.cli import BENCHMARKS, FORWARDED, build_parser, main

REPO = Path(__file__).resolve().parents[1]


def test_every_stage_and_benchmark_is_a_subcommand():
    subcommands = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"regenerate", "decontaminate", "cache", "train", "plan", "calibrate", "evaluate", "export", "pipeline",
            "bench"} <= subcommands
    assert set(BENCHMARKS) == {"cache", "cache-engine", "drafters", "learning", "train", "kernels", "speed",
                               "calibration", "scheduler", "serve", "standalone", "interop", "scaling", "regenerate",
                               "loss-memory"}
    for module in [*BENCHMARKS.values(), *(m for m, _ in FORWARDED.values())]:
        assert callable(importlib.import_module(module).main), module


def test_a_benchmark_runs_through_the_cli(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert main(["bench", "kernels", "--batch-sizes", "1", "--vocab-sizes", "64", "--num-draft", "2", "--iters", "1",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {row["mode"] for row in report["results"]} == {"greedy", "sampled"}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report


@pytest.mark.parametrize("command,overrides,expected", [
    ("train", ["drafter=eagle3", "target=qwen3-4b"], {"kind: eagle3", "cache_dir: outputs/cache/qwen3-4b"}),
    ("cache", ["target=tiny-random-qwen3"], {"out_dir: outputs/cache/tiny-random-qwen3", "mode: build"}),
])
def test_hydra_stages_compose_the_packaged_configs_from_anywhere(tmp_path, command, overrides, expected):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "deepspec.cli", command, "--cfg", "job", "--resolve", *overrides],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert expected <= {line.strip() for line in proc.stdout.splitlines()}, proc.stdout
    bogus = "cache.bogus_key=3" if command == "cache" else "drafter.bogus_key=3"
    bad = subprocess.run([sys.executable, "-m", "deepspec.cli", command, "--cfg", "job", bogus], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and ("bogus" in bad.stderr), bad.stderr[-2000:]
