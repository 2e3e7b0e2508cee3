"""`deepspec bench train --features` (deepspec/benchmarks/train_features.py): the offline and the online run of the
same tiny training, side by side, in one JSON object."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def prompts(tmp_path_factory, conversations_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "convs.jsonl"
    path.write_text("".join(json.dumps({"id": c.id, "conversations": c.messages}) + "\n"
                            for c in conversations_factory(24)))
    return path


@pytest.mark.slow
def test_bench_features_reports_both_ways(prompts, tmp_path, monkeypatch):
    from deepspec.benchmarks.train_features import main

    monkeypatch.setenv("PYTHONPATH",
                       str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "bench.json"
    assert main(["--target", "tiny-random-llama", "--prompts", str(prompts), "--num-samples", "12",
                 "--max-length", "64", "--out", str(out), "drafter.num_draft_layers=1", "drafter.block_size=4",
                 "data.max_anchors_per_seq=8"]) == 0
    result = json.loads(out.read_text())
    assert result["offline"]["steps"] == result["online"]["steps"] >= 2
    # Same data and steps; the bench's cache is the default batched build, so equal up to float rounding only.
    assert result["offline"]["final_loss"] == pytest.approx(result["online"]["final_loss"], rel=1e-3)
    assert set(result["cpu_s_per_step"]) == {"offline", "online"} and result["online_over_cache_plus_offline"] > 0
    assert result["online_over_offline_step_ratio"] == pytest.approx(
        result["cpu_s_per_step"]["online"] / result["cpu_s_per_step"]["offline"], abs=1e-3)
    assert result["cache_build"]["bytes_per_token"] > 0 and result["peak_rss_mb"]["online"] > 0
