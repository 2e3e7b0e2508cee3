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


def test_a_stopped_run_resumes_without_measuring_its_points_again(tmp_path, monkeypatch, capsys):
    """A point that fails (out of memory on a shared machine) keeps the points measured before it: the rerun
    measures only the rest."""
    from deepspec.benchmarks import scaling

    calls = []

    def fake_point(overrides, timeout_s):
        calls.append(overrides)
        if len(calls) == 3:
            raise RuntimeError("the third point was killed")
        size = 1.0 + len(calls)
        return {"step_cpu_s": size, "peak_mb": 100 * size, "micro_batch_mb": 10 * size, "flops": 1e9 * size}

    monkeypatch.setattr(scaling, "run_point", fake_point)
    out = tmp_path / "scaling.json"
    argv = ["--widths", "tiny-qwen3", "--fixed-length", "48", "--fixed-anchors", "8", "--fixed-layers", "2",
            "--max-length", "24", "48", "--anchors", "4", "8", "--series", "max_length", "anchors",
            "--out", str(out), "--figure", str(tmp_path / "scaling.png")]
    with pytest.raises(RuntimeError, match="third point"):
        scaling.main(argv)
    kept = json.loads((tmp_path / "scaling.json.points.json").read_text())
    assert len(kept) == 2 and not out.exists()
    first_two = calls[:2]
    calls.clear()
    scaling.main(argv)
    assert len(calls) == 1 and calls[0] not in first_two  # only the point that failed (4 anchors) is measured
    assert "resuming: 2 point(s)" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert [len(s["points"]) for s in result["series"].values()] == [2, 2]
    assert not (tmp_path / "scaling.json.points.json").exists()
