"""`deepspec bench scaling`: the log-log fits, and a tiny run of every series through the command."""

from __future__ import annotations

import json

import pytest

from deepspec.benchmarks.scaling import fit_series, loglog_slope, point_overrides


def test_loglog_slopes_recover_powers():
    xs = [512, 1024, 2048, 4096]
    assert loglog_slope(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert loglog_slope(xs, [0.5 * x * x for x in xs]) == pytest.approx(2.0)
    assert loglog_slope(xs, [7.0] * 4) == pytest.approx(0.0)
    assert loglog_slope([1], [2.0]) is None
    points = [{"step_cpu_s": x ** 1.5, "peak_mb": 100 + x, "micro_batch_mb": x, "flops": x ** 2} for x in xs]
    assert fit_series(points, xs)["faster_than_linear"] == ["flops", "step_cpu_s"]


def test_a_point_is_the_fixed_values_with_one_changed():
    fixed = {"max_length": 4096, "anchors": 512, "draft_vocab": None, "draft_layers": 5}
    assert point_overrides(["x=1"], fixed, "anchors", 16, 151936) == [
        "x=1", "data.cache.max_length=4096", "data.max_anchors_per_seq=16", "drafter.draft_vocab_size=null",
        "drafter.num_draft_layers=5"]
    assert "drafter.draft_vocab_size=8192" in point_overrides([], fixed, "draft_vocab", 8192, 151936)
    assert "drafter.draft_vocab_size=null" in point_overrides([], fixed, "draft_vocab", 151936, 151936)


@pytest.mark.slow
def test_bench_scaling_at_tiny_widths(tmp_path, capsys):
    from deepspec.benchmarks.scaling import main

    out, figure = tmp_path / "scaling.json", tmp_path / "scaling.png"
    main(["--widths", "tiny-qwen3", "--fixed-length", "48", "--fixed-anchors", "8", "--fixed-layers", "2",
          "--max-length", "24", "48", "--anchors", "4", "8", "--draft-vocab", "128", "512",
          "--draft-layers", "1", "2", "--out", str(out), "--figure", str(figure), "target.layer_ids=[0,1,2]"])
    result = json.loads(out.read_text())
    assert set(result["series"]) == {"max_length", "anchors", "draft_vocab", "draft_layers"}
    for name, series in result["series"].items():
        assert len(series["points"]) == 2, name
        first, last = series["points"]
        assert last["flops"] > first["flops"], name
        assert set(series["fit"]["slopes"]) == {"step_cpu_s", "peak_mb", "micro_batch_mb", "flops"}
    # the fixed point (48 tokens, 8 anchors, full vocabulary, 2 layers) is measured once and shared
    assert result["series"]["max_length"]["points"][-1] == result["series"]["draft_layers"]["points"][-1]
    assert figure.stat().st_size > 10_000
    assert json.loads(capsys.readouterr().out)["widths"] == "tiny-qwen3"
