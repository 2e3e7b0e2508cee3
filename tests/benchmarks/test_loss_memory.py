"""`deepspec bench loss-memory`: one JSON object with the chunked and the naive loss's extra peak memory, each
measured in its own process on CPU; sizes that are not positive integers are refused."""

from __future__ import annotations

import json

import pytest

from deepspec.benchmarks.loss_memory import main, measure_loss_peak_memory


def test_the_report_holds_both_paths_at_the_given_sizes(tmp_path, capsys):
    out = tmp_path / "loss_memory.json"
    assert main(["--num-rows", "16", "--hidden", "8", "--vocab", "32", "--chunk-rows", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {k: report[k] for k in ("num_rows", "hidden", "vocab", "chunk_rows", "device")} == {
        "num_rows": 16, "hidden": 8, "vocab": 32, "chunk_rows": 4, "device": "cpu"}
    assert isinstance(report["chunked_peak_mb"], float) and isinstance(report["naive_peak_mb"], float)
    assert json.loads(capsys.readouterr().out) == report


def test_sizes_must_be_positive_integers():
    with pytest.raises(ValueError, match="chunk_rows must be a positive integer"):
        measure_loss_peak_memory(16, 8, 32, True, chunk_rows=0)
    with pytest.raises(ValueError, match="device must be 'cpu' or a CUDA device"):
        measure_loss_peak_memory(16, 8, 32, True, device="meta")
