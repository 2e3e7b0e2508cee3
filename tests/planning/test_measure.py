"""`deepspec plan --measure` at tiny widths: the trainer's step on a stand-in target and a synthetic cache, measured
within tolerance of the plan; and the tracking that measures it."""

from __future__ import annotations

import pytest
import torch

from deepspec.planning.tracking import SavedActivations, TensorMemory, tensor_bytes

TINY = ["target=tiny-random-qwen3", "drafter.num_draft_layers=2", "drafter.block_size=4", "data.cache.max_length=48",
        "data.max_anchors_per_seq=12", "trainer.global_batch_size=4", "trainer.micro_batch_size=2"]


@pytest.mark.parametrize("overrides", [
    ["drafter=dspark", "drafter.markov_rank=8"],
    # mask-predicts, a reduced vocabulary (the target's log-normaliser, the outside column) and no loss checkpointing
    ["drafter=dflash", "drafter.draft_vocab_size=1024", "loss.checkpoint=never", "loss.tv_weight=0.5",
     "trainer.micro_batch_size=4"],
    # the output adapter (its saved input is a draft-layer term)
    ["drafter=dspark", "drafter.markov_rank=8", "drafter.output_adapter=zero"],
], ids=["dspark", "dflash-reduced-vocab", "dspark-output-adapter"])
def test_measured_peak_is_the_plans_within_tolerance(overrides):
    from deepspec.planning.run import compose, measure_here

    report = measure_here(compose([*TINY, *overrides]), steps=2)
    plan, measured = report["plan"], report["measured"]
    assert measured["total_mb"] == pytest.approx(plan["total_mb"], rel=0.15)
    rows = measured["components"]
    for exact in ("drafter_parameters", "optimizer_states", "frozen_embedding_head", "batch", "gradients"):
        assert rows[exact]["measured_mb"] == pytest.approx(rows[exact]["plan_mb"], abs=0.15), exact
    for saved in ("context_activations", "draft_layers_and_attention"):
        assert rows[saved]["measured_mb"] == pytest.approx(rows[saved]["plan_mb"], rel=0.15), saved
    assert measured["flops_micro_batch"] == pytest.approx(plan["flops"]["micro_batch"]["total"], rel=0.05)
    assert measured["micro_batch"]["blocks"] == plan["micro_batch"]["blocks"]
    assert measured["micro_batch"]["context_tokens"] == plan["micro_batch"]["context_tokens"]
    # a run that accumulates gradients is measured with 2 micro-batches per step (the gradients persist), else 1
    accumulates = plan["config"]["grad_accum_steps"] > 1
    assert measured["steps"] == 2 and measured["micro_batches_per_step"] == (2 if accumulates else 1)
    assert measured["step_cpu_s"] > 0 and measured["peak_rss_mb"] > measured["total_mb"]


def test_tensor_memory_counts_live_storages_and_their_peak():
    tracker = TensorMemory()
    weight = torch.zeros(256, 256, requires_grad=True)  # 256 KiB, made outside the tracker
    tracker.track("parameters", [weight])
    tracker.watch_gradients([weight])
    with tracker.kind("forward"):
        a = torch.ones(512, 256)  # 512 KiB
        b = a * 2  # 512 KiB
        b.add_(1)  # in place: nothing new
        view = b[:10]  # a view: nothing new
        del a
        out = (view.sum() * weight).sum()
    peak_forward = tracker.peak_bytes
    assert peak_forward >= 256 * 1024 + 2 * 512 * 1024 and tracker.live["forward"] < 2 * 512 * 1024
    with tracker.kind("backward"):
        out.backward()
    assert tracker.live["gradients"] == 256 * 1024  # relabelled when accumulated into the parameter
    del b, view, out
    assert tracker.live["forward"] == 0
    assert tracker.total_bytes() == 2 * 256 * 1024
    tracker.remove_hooks()
    assert tensor_bytes([weight, weight[:3], weight.grad]) == 2 * 256 * 1024


def test_saved_activations_are_counted_by_region():
    layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(32, 8)
    with SavedActivations(layer, {"1": "activation"}, root="root", outside="outside",
                          exclude=[x, *layer.parameters()]) as saved:
        hidden = layer(x)
        loss = (hidden.exp()).sum()
    # Linear 0 saves x (excluded); Tanh saves its output (32 x 16 fp32); Linear 2 saves its input, the same storage;
    # exp, outside the model, saves its output (32 x 4)
    assert dict(saved.bytes) == {"activation": 32 * 16 * 4, "outside": 32 * 4 * 4}
    loss.backward()


def test_the_command_prints_and_writes_the_measurement_beside_the_plan(tmp_path):
    """`deepspec plan ... --measure`: the JSON carries plan.total_mb and measured.total_mb, component by component,
    and the printed table the same rows."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "measure.json"
    result = subprocess.run(
        [sys.executable, "-m", "deepspec.cli", "plan", *TINY, "drafter=dspark", "drafter.markov_rank=8", "--measure",
         "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
             "HF_HUB_OFFLINE": "1", "HOME": str(Path.home())})
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    plan, measured = report["plan"], report["measured"]
    assert report["total_mb"] == plan["total_mb"] > 0 and measured["total_mb"] > 0
    assert report["plan_as_configured"]["config"]["device"] == "cpu"
    assert measured["total_mb"] == pytest.approx(plan["total_mb"], rel=0.15)
    for name, row in measured["components"].items():
        assert {"plan_mb", "measured_mb", "how"} <= set(row), name
        assert name in result.stdout
    assert "measured here:" in result.stdout and "peak RSS" in result.stdout
    assert json.loads(result.stdout.strip().splitlines()[-1])["measured_total_mb"] == measured["total_mb"]


def test_a_measurement_this_machine_cannot_hold_is_refused_naming_the_micro_batch_that_fits(monkeypatch):
    """With less memory available than micro-batch 2 needs (a faked number; its plan is a few hundred MB), the
    refusal is one line naming trainer.micro_batch_size=1 and --device cpu (asked for cuda, measured on the CPU),
    and nothing is built; with that much more memory the refusal says no micro-batch size fits."""
    from deepspec.planning import measure, run
    from deepspec.planning.plan import plan_training_run

    cfg = run.compose([*TINY, "drafter=dspark", "drafter.markov_rank=8"])
    by_micro = plan_training_run(cfg, device="cpu", target_layers_materialised=False)["fit"]["total_mb_by_micro_batch"]
    one, two = (run.process_bytes(by_micro[m], "cpu") / run.HEADROOM for m in (1, 2))
    assert one < two

    def not_allocated(*args, **kwargs):
        raise AssertionError("the measurement started")

    monkeypatch.setattr(measure, "measure_training", not_allocated)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(run, "available_memory", lambda device: int((one + two) / 2))
    with pytest.raises(ValueError) as refused:
        run.measure_here(cfg, steps=2, requested_device="cuda")
    message = str(refused.value)
    assert message.startswith("--measure: trainer.micro_batch_size=2 needs about ") and "\n" not in message
    assert message.endswith("rerun with trainer.micro_batch_size=1 --device cpu")
    monkeypatch.setattr(run, "available_memory", lambda device: int(one / 2))
    with pytest.raises(ValueError, match=r"no micro-batch size fits: measure a smaller configuration \(.*\)$"):
        run.measure_here(cfg, steps=2, requested_device="cpu")
    monkeypatch.setattr(run, "available_memory", lambda device: int(two * 1.01))
    monkeypatch.setattr(measure, "measure_training", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("started")))
    with pytest.raises(RuntimeError, match="started"):  # enough memory: the measurement starts
        run.measure_here(cfg, steps=2, requested_device="cpu")
