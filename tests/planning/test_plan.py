"""`deepspec plan`: its arithmetic against exact counts at tiny widths, ZeRO partitioning, the cache estimate, the fit,
named targets without network, and the command line's one-line errors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepspec.planning.plan import MB, plan_training_run
from deepspec.training.config import compose_train_config, resolve_config

TINY = ["target=tiny-random-qwen3", "drafter=dspark", "drafter.num_draft_layers=2", "drafter.block_size=4",
        "drafter.markov_rank=8", "data.cache.max_length=48", "data.max_anchors_per_seq=8",
        "trainer.global_batch_size=4", "trainer.micro_batch_size=2"]


def config(*overrides: str):
    return resolve_config(compose_train_config([*TINY, *overrides]))


def component_bytes(report: dict, name: str) -> float:
    return report["memory"]["components"][name]["mb"] * MB


def test_parameter_optimizer_and_frozen_bytes_equal_the_built_drafters(tiny_qwen3):
    from deepspec.drafters.build import build_drafter
    from deepspec.training.config import drafter_overrides, plan_training
    from deepspec.training.engine import ClippedAdamW

    cfg = config("target.dtype=float32")
    report = plan_training_run(cfg, device="cpu", fit=False)
    layer_ids = plan_training(cfg, world_size=1, check_files=False).drafter_layer_ids
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_qwen3, **drafter_overrides(cfg, layer_ids))
    params = [p for p in drafter.parameters() if p.requires_grad]
    exact = sum(p.numel() * p.element_size() for p in drafter.parameters())
    exact += sum(b.numel() * b.element_size() for b in drafter.buffers())
    assert report["parameters"]["drafter"] == sum(p.numel() for p in params)
    assert component_bytes(report, "drafter_parameters") == pytest.approx(exact, abs=0.05 * MB)
    optimizer = ClippedAdamW(params, max_norm=1.0, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    states = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    assert component_bytes(report, "optimizer_states") == pytest.approx(states, abs=0.05 * MB)
    model = tiny_qwen3.model
    frozen = {t.data_ptr(): t.numel() * t.element_size()
              for t in (model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                        *model.model.norm.parameters())}
    assert component_bytes(report, "frozen_embedding_head") == pytest.approx(sum(frozen.values()), abs=0.05 * MB)
    assert report["parameters"]["target"] == sum(p.numel() for p in model.parameters())


def test_an_average_of_the_weights_costs_four_bytes_per_drafter_parameter():
    plain = plan_training_run(config(), device="cpu", fit=False)
    averaged = plan_training_run(config("trainer.ema_decay=0.9"), device="cpu", fit=False)
    assert "weight_average" not in plain["memory"]["components"]
    assert component_bytes(averaged, "weight_average") == pytest.approx(4 * plain["parameters"]["drafter"],
                                                                        abs=0.05 * MB)


def test_zero_partitions_optimizer_states_and_gradients_by_world_size():
    stage2 = {n: plan_training_run(config("trainer.global_batch_size=16", "trainer.micro_batch_size=1"),
                                   world_size=n, device="cuda", fit=False) for n in (1, 2, 8)}
    params = stage2[1]["parameters"]["drafter"]
    bucket = 2 * 500_000_000  # DeepSpeed's reduce bucket: deepspeed.reduce_bucket_size bf16 elements, whole
    for n, report in stage2.items():
        shard = -(-params // n)
        # bf16 on a GPU: DeepSpeed's bf16 engine casts the drafter to 2-byte parameters
        assert report["config"]["zero_stage_run"] == 2 and report["config"]["parameter_bytes"] == 2
        assert component_bytes(report, "optimizer_states") == pytest.approx(12 * shard, abs=0.05 * MB)
        assert component_bytes(report, "gradients") == pytest.approx(2 * shard + bucket, abs=0.05 * MB)
        assert component_bytes(report, "drafter_parameters") == pytest.approx(2 * params, abs=0.05 * MB)
    stage3 = plan_training_run(config("deepspeed=zero3", "trainer.global_batch_size=16", "trainer.micro_batch_size=1"),
                               world_size=8, device="cuda", fit=False)
    assert component_bytes(stage3, "drafter_parameters") == pytest.approx(2 * params * (1 + 1 / 8), abs=0.05 * MB)
    stage1 = plan_training_run(config("deepspeed=zero1", "trainer.global_batch_size=16", "trainer.micro_batch_size=1",
                                      "deepspeed.overlap_comm=true"), world_size=8, device="cuda", fit=False)
    assert component_bytes(stage1, "gradients") == pytest.approx(2 * params + 2 * bucket, abs=0.05 * MB)


@pytest.mark.slow
def test_zero2_optimizer_state_bytes_match_deepspeeds(tiny_qwen3):
    """One bf16 process under DeepSpeed's ZeRO-2: its fp32 partition and AdamW moments are the plan's 12 B/param."""
    from deepspec.drafters.build import build_drafter
    from deepspec.training.config import drafter_overrides, plan_training
    from deepspec.training.engine import build_engine
    from deepspec.training.placement import placement_on
    from deepspec.utils.dist import Launch, init_distributed

    cfg = config("trainer.precision=bf16", "trainer.global_batch_size=2", "trainer.micro_batch_size=2")
    report = plan_training_run(cfg, device="cpu", fit=False)
    assert report["config"]["zero_stage_run"] == 2
    drafter = build_drafter("dspark", tiny_qwen3, **drafter_overrides(
        cfg, plan_training(cfg, world_size=1, check_files=False).drafter_layer_ids)).to(torch.bfloat16)
    init_distributed(Launch(), torch.device("cpu"))
    placement = placement_on(torch.device("cpu"), cfg.trainer, cfg.deepspeed, world_size=1)  # trainer.precision=bf16
    engine = build_engine(drafter, cfg.deepspeed, cfg.optim, placement, micro_batch_size=cfg.trainer.micro_batch_size,
                          grad_accum_steps=cfg.trainer.grad_accum_steps(1), total_steps=4)
    optimizer = engine.optimizer
    master = sum(t.numel() * t.element_size() for t in optimizer.single_partition_of_fp32_groups)
    for group in optimizer.single_partition_of_fp32_groups:
        group.grad = torch.zeros_like(group)
    optimizer.optimizer.step()
    moments = sum(t.numel() * t.element_size() for s in optimizer.optimizer.state.values() for t in s.values()
                  if t.dim() > 0)
    assert master + moments == pytest.approx(component_bytes(report, "optimizer_states"), rel=0.01)
    engine.destroy()


def test_cache_bytes_are_the_cache_jobs_estimate(tiny_cache):
    from deepspec.cache.format import read_meta
    from deepspec.cache.plan import estimate_cache_size

    report = plan_training_run(config(), device="cpu", samples=1000, mean_tokens=30.0, fit=False)
    hidden = report["widths"]["hidden"]
    data = report["data"]
    expected = estimate_cache_size(30_000, 1000, hidden, 3, "bf16")
    assert {k: data["cache"][k] for k in expected} == expected
    assert data["train_samples"] == 990 and data["steps_per_epoch"] == 990 // 4  # data.source.val_fraction=0.01
    meta = read_meta(tiny_cache)
    on_disk = plan_training_run(
        resolve_config(compose_train_config([*TINY[:-1], "target=tiny-random-llama", f"data.cache_dir={tiny_cache}",
                                             "target.layer_ids=[0,1,2]", "trainer.micro_batch_size=2"])),
        device="cpu", fit=False)
    assert on_disk["config"]["max_length"] == meta.max_length  # the finished cache's, not data.cache.max_length
    assert on_disk["data"]["tokens"] == meta.counts["tokens"]
    assert on_disk["data"]["cache"]["total_bytes"] == meta.bytes_per_token * meta.counts["tokens"]
    assert on_disk["data"]["train_samples"] == 16 and on_disk["data"]["steps_per_epoch"] == 4


def test_a_cache_short_of_one_step_says_what_to_change(tiny_cache):
    from deepspec.planning.plan import format_plan

    tiny = [o for o in TINY if not o.startswith(("target=", "trainer."))]
    report = plan_training_run(
        resolve_config(compose_train_config([*tiny, "target=tiny-random-llama", f"data.cache_dir={tiny_cache}",
                                             "target.layer_ids=[0,1,2]", "trainer.micro_batch_size=2",
                                             "trainer.global_batch_size=32"])),
        device="cpu", fit=False)
    assert ("16 train, 0 steps per epoch (fewer train samples than trainer.global_batch_size=32: lower it, or cache "
            "more samples)") in format_plan(report)


def test_named_target_is_planned_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = resolve_config(compose_train_config(["experiment=paper", "target=qwen3-8b", "drafter=dspark",
                                               "data.cache.max_length=4096", "data.cache_dir=/nonexistent"]))
    report = plan_training_run(cfg, world_size=8, device="cuda")
    assert report["parameters"]["target"] == 8_190_735_360  # Qwen3-8B's published parameter count
    assert report["config"]["target_source"].startswith("target.shape=qwen3-8b")
    assert report["micro_batch"]["supervised_positions"] == 2 * 512 * 7
    assert report["fit"]["fits"] and report["fit"]["largest_micro_batch"] >= 2


def test_the_fit_is_the_largest_micro_batch_under_the_device_memory():
    report = plan_training_run(config("trainer.global_batch_size=16"), device="cuda", device_memory_gb=80)
    totals = report["fit"]["total_mb_by_micro_batch"]
    assert list(totals) == [1, 2, 4, 8, 16]
    assert all(a < b for a, b in zip(totals.values(), list(totals.values())[1:]))
    between = (totals[4] + totals[8]) / 2 / 1024 / 0.9  # GB whose usable 90% holds micro-batch 4, not 8
    tight = plan_training_run(config("trainer.global_batch_size=16"), device="cuda", device_memory_gb=between)
    assert tight["fit"]["largest_micro_batch"] == 4


def test_an_80_gb_gpu_is_counted_in_gib_as_it_is():
    """Every figure of the plan is GiB; an "80 GB" H100 holds 81,559 MiB (nvidia-smi), 79.6 GiB, not 80."""
    from deepspec.planning.plan import format_plan

    report = plan_training_run(config("trainer.global_batch_size=16"), device="cuda")
    assert report["fit"]["device_memory_gb"] == 79.6 and report["fit"]["usable_gb"] == 71.6
    assert "fit: fits in 71.6 of 79.6 GiB (90%)" in format_plan(report)
    assert re.search(r"^  memory per rank +MiB  what$", format_plan(report), re.MULTILINE)  # MB = 2**20 B


def test_micro_batch_activations_grow_with_anchors_and_length():
    small = plan_training_run(config("data.max_anchors_per_seq=4"), device="cpu", fit=False)
    more_anchors = plan_training_run(config("data.max_anchors_per_seq=16"), device="cpu", fit=False)
    longer = plan_training_run(config("data.cache.max_length=96"), device="cpu", fit=False)
    for name in ("draft_layer_activations", "loss_chunk"):
        assert component_bytes(more_anchors, name) > component_bytes(small, name)
    assert component_bytes(longer, "context_activations") > component_bytes(small, "context_activations")
    assert more_anchors["micro_batch"]["supervised_positions"] == 2 * 16 * 4


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env_path = str(Path(__file__).resolve().parents[2])
    return subprocess.run([sys.executable, "-m", "deepspec.cli", "plan", *args], capture_output=True, text=True,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1", "HOME": str(Path.home())}, timeout=300)


@pytest.mark.parametrize("args,code,message", [
    (["drafter=eagle3"], 1, "drafter.kind=eagle3: `deepspec plan` covers the block drafters"),
    (["--samples", "10"], 2, "--samples and --mean-tokens go together"),
    (["drafter.bogus=1"], 2, "drafter.bogus"),
    (["--measure", "--steps", "1"], 2, "--steps 1: measure at least 2 optimizer steps"),
    (["target=qwen3-14b", "trainer.micro_batch_size=64", "data.cache.max_length=4096", "--measure"], 1,
     "--measure: trainer.micro_batch_size=64 needs about"),
])
def test_refusals_are_one_line(tmp_path, args, code, message):
    result = run_cli(*args, "--out", str(tmp_path / "plan.json"))
    assert result.returncode == code, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("deepspec plan: error: ") and message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_the_command_prints_the_table_and_writes_the_json(tmp_path):
    import json

    out = tmp_path / "plan.json"
    result = run_cli("experiment=paper", "target=qwen3-8b", "drafter=dspark", "data.cache.max_length=4096",
                     "--world-size", "8", "--samples", "60000", "--mean-tokens", "1500", "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "largest micro-batch that fits" in result.stdout and "block_attention" in result.stdout
    report = json.loads(out.read_text())
    assert report["total_mb"] == report["memory"]["total_mb"] > 0
    assert report["config"]["world_size"] == 8 and report["data"]["steps_per_epoch"] == 59_400 // 64


def test_online_features_plan_the_targets_forward_as_the_run_batches_and_shards_it(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def plan(*overrides: str) -> dict:  # Qwen3-8B's widths (bf16, 2 B per weight) on 8 GPUs
        cfg = resolve_config(compose_train_config(["experiment=paper", "target=qwen3-8b", "drafter=dspark",
                                                   "data.cache_dir=/nonexistent", *overrides]))
        return plan_training_run(cfg, world_size=8, device="cuda", fit=False)

    offline, online = plan(), plan("data.features=online")
    params, widths = online["parameters"], online["widths"]
    tokens = online["micro_batch"]["context_tokens"]
    decoder = params["target"] - params["target_embedding_head"]
    flops = online["flops"]["micro_batch"]["forward"]["online_target_forward"]
    assert flops == 2 * tokens * (decoder + widths["target_vocab"] * widths["hidden"])
    assert offline["flops"]["micro_batch"]["forward"]["online_target_forward"] == 0
    assert "online_feature_forward" not in offline["memory"]["components"]
    assert "features" in online["memory"]["phase_peaks_mb"]
    working_set = 4 * widths["hidden"] + 3 * widths["intermediate"]  # per token: residual, attention, MLP
    assert component_bytes(online, "online_feature_forward") == pytest.approx(2 * tokens * working_set, abs=0.05 * MB)
    # data.online_batch=sample: one forward per sample, over one sample's tokens
    sample = plan("data.features=online", "data.online_batch=sample")
    assert component_bytes(sample, "online_feature_forward") == pytest.approx(
        2 * (tokens // 2) * working_set, abs=0.05 * MB)
    # data.target_sharding=zero3: 1/N of every target weight, whole embedding and LM head, a layer gathered to run
    sharded = plan("data.features=online", "data.target_sharding=zero3")
    outer, layers = params["target_embedding_head"], 36  # Qwen3-8B's decoder layers
    assert component_bytes(sharded, "target_decoder_layers") == pytest.approx(2 * decoder / 8, abs=0.05 * MB)
    assert component_bytes(sharded, "frozen_embedding_head") == pytest.approx(2 * outer * (1 + 1 / 8), abs=0.05 * MB)
    assert component_bytes(sharded, "online_feature_forward") == pytest.approx(
        component_bytes(online, "online_feature_forward") + 2 * decoder / layers, abs=0.05 * MB)
    assert sharded["config"]["target_sharding"] == "zero3"
    assert sharded["total_mb"] < online["total_mb"]


def test_the_walkthroughs_plan_is_the_commands_output():
    """docs/train-on-gpus.md prints the plan of its own command line: every number of its table is recomputed."""
    import re
    import shlex

    from deepspec.planning.run import run_plan

    page = (Path(__file__).resolve().parents[2] / "docs" / "train-on-gpus.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- step: plan -->\n```bash\n(deepspec plan .*?)\n```\n\n```text\n(.*?)\n```", page, re.DOTALL)
    assert match, "docs/train-on-gpus.md: no `deepspec plan` step followed by its printed table"
    args = shlex.split(match.group(1))[2:]
    options = {"--world-size": "world_size", "--samples": "samples", "--mean-tokens": "mean_tokens"}
    overrides, kwargs = [], {}
    while args:
        arg = args.pop(0)
        if arg in options:
            kwargs[options[arg]] = float(args.pop(0)) if arg == "--mean-tokens" else int(args.pop(0))
        else:
            overrides.append(arg)
    report, text = run_plan(overrides, device="cuda", device_memory_gb=None, measure=False, steps=2,
                            **{"world_size": None, "samples": None, "mean_tokens": None, **kwargs})
    printed = match.group(2)
    for name, row in report["memory"]["components"].items():
        assert re.search(rf"^  {name}\s+{row['mb']:,.1f}\s", printed, re.MULTILINE), name
    assert f"{report['total_mb']:,.1f}" in printed
    assert f"largest micro-batch that fits: {report['fit']['largest_micro_batch']} " in printed
    fit = report["fit"]
    assert f"in {fit['usable_gb']:,.1f} of {fit['device_memory_gb']:g} GiB" in printed
    assert f"{report['data']['steps_per_epoch']:,} steps per epoch" in printed
