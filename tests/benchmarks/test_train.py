"""`deepspec bench train`: the trainer's per-phase step times (`trainer.phase_times`), the bare loop on the trainer's
batches, the summary's medians and spreads, and one end-to-end run (slow)."""

from __future__ import annotations

import pytest

from deepspec.utils.phases import STEP_PHASES


def test_trainer_logs_each_steps_phases(tt, tiny_cache, tmp_path):
    from deepspec.training import run
    from deepspec.training.log import read_metrics

    out = tmp_path / "run"
    run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.phase_times=true", "trainer.max_steps=3")))
    records = read_metrics(out, "train")
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        phases = record["phase_cpu_s"]
        expected = set(STEP_PHASES) - ({"logging"} if record["step"] == 1 else set())  # a record holds the
        assert set(phases) == expected, phases  # previous step's logging
        assert all(value >= 0 for name, value in phases.items() if name != "other") and phases["other"] > -1e-3
        assert record["phase_spans"] >= 8 and record["user_s"] >= 0 and record["sys_s"] >= 0
    untimed = tmp_path / "untimed"
    run(tt.compose(tt.train_overrides(tiny_cache, untimed, "trainer.max_steps=1")))
    assert "phase_cpu_s" not in read_metrics(untimed, "train")[0]


def test_bare_loop_takes_the_trainers_batches_across_epochs(tt, tiny_cache, tmp_path, monkeypatch):
    """16 training samples, 4 per step: 6 steps cross into epoch 1, where both loops take epoch 1's order."""
    from deepspec.benchmarks.train import bare_loop
    from deepspec.training import run
    from deepspec.training.data import TrainingData

    seen = []
    collate = TrainingData.collate
    monkeypatch.setattr(TrainingData, "collate", lambda self, ids, epoch: seen.append((list(ids), epoch))
                        or collate(self, ids, epoch))
    overrides = tt.train_overrides(tiny_cache, tmp_path / "run", "trainer.max_steps=6", "trainer.micro_batch_size=4")
    run(tt.compose(overrides))
    trainer_batches, seen[:] = seen[:6], []  # validation's batches come after the training steps
    steps = bare_loop(overrides, 6)["steps"]
    assert seen == trainer_batches and trainer_batches[4][1] == 1
    assert len(steps) == 6 and {"data", "loss", "backward", "optimizer"} <= set(steps[0]["phase_cpu_s"])


def test_summary_takes_medians_of_repeats_and_means_of_phases():
    from deepspec.benchmarks.train import summarize_mode

    def record(loss, backward):
        return {"phase_cpu_s": {"loss": loss, "backward": backward}, "phase_spans": 4, "user_s": loss + backward,
                "sys_s": 0.0, "minor_faults": 10}

    runs = [[record(9.0, 9.0), record(1.0, 1.0), record(1.0, 2.0), record(1.0, 3.0)],  # first step: warm-up
            [record(9.0, 9.0), record(2.0, 2.0), record(2.0, 2.0), record(2.0, 2.0)],
            [record(9.0, 9.0), record(1.5, 1.0), record(1.5, 1.0), record(1.5, 1.0)]]
    summary = summarize_mode(runs, warmup=1, span_cost_s=1e-6)
    assert summary["step_cpu_s_by_repeat"] == [3.0, 4.0, 2.5]
    assert summary["step_cpu_s"] == 3.0 and summary["spread"] == pytest.approx(0.5)
    assert summary["phase_cpu_s"] == {"loss": 1.5, "backward": 2.0}  # medians of the repeats' means
    assert summary["timer_cpu_s"] == pytest.approx(4e-6) and summary["minor_faults"] == 10


@pytest.mark.slow
def test_bench_train_end_to_end(tt, tiny_cache, tmp_path):
    from deepspec.benchmarks.train import bench_modes

    overrides = [o for o in tt.train_overrides(tiny_cache, None) if o.split("=")[0] in (
        "target", "drafter", "drafter.block_size", "drafter.markov_rank", "drafter.num_draft_layers",
        "data.max_anchors_per_seq")]
    result = bench_modes(tiny_cache, ["trainer"], steps=3, warmup=1, batch=4, overrides=overrides, repeats=2)
    assert set(result["modes"]) == {"bare", "trainer"} and len(result["ratio_to_bare_by_repeat"]["trainer"]) == 2
    assert result["overhead_ratio"] > 0 and result["ratio_spread"]["trainer"] >= 0
    for mode in ("bare", "trainer"):
        phases = result["modes"][mode]["phase_cpu_s"]
        assert {"data", "target", "forward", "loss", "backward", "optimizer"} <= set(phases)
    assert set(result["overhead_phase_cpu_s"]) >= {"loss", "backward", "optimizer", "guards", "logging"}


def test_the_default_configuration_is_the_list_it_replaced(tt):
    """experiment=bench-train (deepspec/conf/experiment/bench-train.yaml) says what the Python list said."""
    from dataclasses import asdict

    from deepspec.benchmarks.train import DEFAULT_OVERRIDES
    from deepspec.training.config import resolve_config

    old = ["target=smollm2-135m", "drafter=dspark", "drafter.num_draft_layers=2", "drafter.init_from_target=false",
           "drafter.draft_vocab_size=null", "data.max_anchors_per_seq=16"]
    assert asdict(resolve_config(tt.compose(DEFAULT_OVERRIDES))) == asdict(resolve_config(tt.compose(old)))


def test_command_line_reads_overrides_after_the_modes():
    from deepspec.benchmarks.train import DEFAULT_OVERRIDES, parse_args
    from deepspec.utils.errors import UsageError

    args = parse_args(["--modes", "trainer", "zero2", "experiment=cpu", "drafter=eagle3"])
    assert args.modes == ["trainer", "zero2"] and args.overrides == ["experiment=cpu", "drafter=eagle3"]
    assert parse_args(["--modes", "trainer"]).overrides == DEFAULT_OVERRIDES
    with pytest.raises(UsageError, match="unknown --modes"):
        parse_args(["--modes", "trainerr"])
    with pytest.raises(UsageError, match="--warmup"):
        parse_args(["--steps", "2", "--warmup", "2"])
