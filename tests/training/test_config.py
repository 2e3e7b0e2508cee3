"""Training config: every group/experiment composes and validates; bad input fails before any weights load."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deepspec.training.config import TrainConfig, plan_training, resolve_config
from deepspec.training.engine import WarmupCosine, deepspeed_config

EXPERIMENTS = sorted(p.stem for p in
                     (Path(__file__).resolve().parents[2] / "deepspec" / "conf" / "experiment").glob("*.yaml"))
DEBUG_OPTIONS = sorted(p.stem for p in
                       (Path(__file__).resolve().parents[2] / "deepspec" / "conf" / "debug").glob("*.yaml"))


@pytest.mark.parametrize("experiment,drafter", [
    (experiment, drafter) for experiment in EXPERIMENTS
    for drafter in (["mtp"] if experiment.startswith("mtp") else ["dspark", "dflash", "eagle3", "mtp", "standalone"])])
def test_every_experiment_composes_and_validates_by_configuration_alone(tt, experiment, drafter):
    """Experiments are deltas combined with target=/drafter= (the paper's targets; the CPU one its own)."""
    # CPU: the quickstart's one process, and the recipe's 2 processes with half the micro batch; GPU recipes: one
    # 8-GPU node
    runs = ([("smollm2-135m", 1, []), ("smollm2-135m", 2, ["trainer.micro_batch_size=2"])]
            if experiment in ("cpu", "cpu-servable")
            else [(target, 8, []) for target in ["qwen3-4b", "qwen3-14b", "llama3.1-8b", "gemma3"]])
    for target, world, extra in runs:
        cfg = resolve_config(tt.compose([f"experiment={experiment}", f"target={target}", f"drafter={drafter}", *extra]))
        plan = plan_training(cfg, world_size=world, check_files=False)
        assert plan.grad_accum_steps * cfg.trainer.micro_batch_size * world == cfg.trainer.global_batch_size
        assert all(0 <= i <= plan.num_target_layers - 2 for i in plan.drafter_layer_ids)


def test_the_paper_experiment_is_the_papers_configuration(tt):
    """5 random layers for DFlash/DSpark and 1 for Eagle3, the full vocabulary, DSpark's Markov head started at
    random, no anchor fusion, no autocast, 10 epochs of 64 sequences at lr 6e-4 (DSpark section 4)."""
    for kind, layers in (("dspark", 5), ("dflash", 5), ("eagle3", 1)):
        cfg = resolve_config(tt.compose(["experiment=paper", f"drafter={kind}"]))
        d, t = cfg.drafter, cfg.trainer
        assert (d.num_draft_layers, d.init_from_target, d.draft_vocab_size) == (layers, False, None)
        assert getattr(d, "anchor_fusion", "none") == "none" and getattr(d, "markov_init", "random") == "random"
        assert (t.epochs, t.max_steps, t.global_batch_size, t.autocast, cfg.optim.lr) == (10, None, 64, "none", 6e-4)
    assert resolve_config(tt.compose(["drafter=dspark"])).drafter.markov_init == "bigram"  # the default start


def test_an_experiment_applies_its_settings_for_the_chosen_kind_only(tt):
    """experiment/cpu/<kind>.yaml follows drafter=<kind>; a kind without a file keeps its defaults; the command
    line still wins."""
    dspark = resolve_config(tt.compose(["experiment=cpu", "drafter=dspark"])).drafter
    assert (dspark.num_draft_layers, dspark.anchor_fusion, dspark.draft_vocab_size) == (1, "latest_context", 8192)
    assert (dspark.output_adapter, dspark.markov_init, dspark.markov_init_scale) == ("zero", "bigram", 1.0)
    dflash = resolve_config(tt.compose(["drafter=dflash", "experiment=cpu"])).drafter
    assert (dflash.num_draft_layers, dflash.anchor_fusion, dflash.draft_vocab_size) == (2, "latest_context", 8192)
    assert resolve_config(tt.compose(["experiment=cpu", "drafter=eagle3"])).drafter.draft_vocab_size == 8192
    mtp = resolve_config(tt.compose(["experiment=cpu", "drafter=mtp"]))
    assert mtp.drafter.num_mtp_modules == 1 and mtp.trainer.autocast == "auto"
    cfg = resolve_config(tt.compose(["experiment=cpu", "drafter.num_draft_layers=3", "trainer.max_steps=50"]))
    assert cfg.drafter.num_draft_layers == 3 and cfg.trainer.val_every == cfg.trainer.save_every == 50


@pytest.mark.parametrize("group,options", [("drafter", ["dspark", "dflash", "eagle3", "mtp", "standalone"]),
                                           ("deepspeed", ["zero1", "zero2", "zero3", "zero3_offload"]),
                                           ("logger", ["jsonl", "wandb", "tensorboard", "none"]),
                                           ("target", ["smollm2-135m", "qwen3-4b", "qwen3-8b", "qwen3-14b",
                                                       "llama3.1-8b", "gemma3", "tiny-random-llama",
                                                       "tiny-random-qwen3"]),
                                           ("debug", DEBUG_OPTIONS)])
def test_every_group_option_composes_into_the_schema(tt, group, options):
    for option in options:
        cfg = resolve_config(tt.compose([f"{group}={option}"]))
        assert isinstance(cfg, TrainConfig)
        plan_training(cfg, world_size=1, check_files=False)


# What the benchmarks and the GPU check said as Python lists of overrides before the debug options held it.
OLD_QUIET = ["trainer.progress_bar=false", "calibration.enabled=false", "logger=jsonl"]  # the GPU check's
OLD_BENCHMARK = [*OLD_QUIET, "trainer.resume=false", "trainer.decode_eval_prompts=0", "trainer.epochs=100000",
                 "trainer.log_every=1", "trainer.val_every=100000", "trainer.save_every=100000"]  # bench train's
OLD_GPU_CHECK = [*OLD_QUIET, "trainer.log_every=1", "trainer.val_every=100000", "trainer.save_every=100000",
                 "trainer.precision=bf16"]  # validation and checkpoints were 10 x max_steps: only at the end either way
OLD_PIPELINE = ["calibration.enabled=false"]  # the quickstart's training runs: its calibrate stage fits STS


@pytest.mark.parametrize("option,old", [("quiet", OLD_QUIET), ("benchmark", OLD_BENCHMARK),
                                        ("gpu_check", OLD_GPU_CHECK), ("pipeline", OLD_PIPELINE)])
@pytest.mark.parametrize("preset", [[], ["experiment=cpu"], ["experiment=paper", "target=qwen3-4b"],
                                    ["experiment=paper", "drafter=eagle3"]])
def test_a_debug_option_says_what_the_old_override_lists_said_and_applies_after_the_experiment(tt, option, old,
                                                                                                preset):
    """Over any experiment (paper's logger is wandb: the option's jsonl wins, as the old `logger=jsonl` did); the
    command line still wins over the option."""
    from dataclasses import asdict

    assert set(DEBUG_OPTIONS) >= {"quiet", "benchmark", "gpu_check", "pipeline"}
    before = resolve_config(tt.compose([*preset, *old]))
    now = resolve_config(tt.compose([*preset, f"debug={option}"]))
    assert asdict(now) == asdict(before) and (now.logger.wandb is False or option == "pipeline")
    mine = resolve_config(tt.compose([*preset, f"debug={option}", "trainer.progress_bar=true", "logger=wandb"]))
    assert mine.trainer.progress_bar and mine.logger.wandb


def test_a_debug_file_with_an_unknown_key_fails_naming_it(tt, tmp_path):
    import shutil

    from deepspec.training.config import compose_train_config

    conf = tmp_path / "conf"
    shutil.copytree(tt.CONF_DIR, conf)
    (conf / "debug" / "typo.yaml").write_text("# @package _global_\ntrainer:\n  progres_bar: false\n")
    with pytest.raises(ValueError, match="progres_bar"):
        compose_train_config(["debug=typo"], config_dir=conf)


def test_loss_group_follows_the_drafter(tt):
    cfg = resolve_config(tt.compose(["drafter=dflash"]))
    assert (cfg.loss.ce_weight, cfg.loss.tv_weight, cfg.loss.conf_weight) == (1.0, 0.0, 0.0)
    assert resolve_config(tt.compose([])).loss.tv_weight == 0.9


def test_unknown_key_and_wrong_type_fail_naming_the_key(tt):
    with pytest.raises(ValueError, match="bogus"):
        resolve_config(tt.compose(["+trainer.bogus=1"]))
    with pytest.raises(ValueError, match="epochs"):
        resolve_config(tt.compose(["trainer.epochs=many"]))


@pytest.mark.parametrize("override,field", [
    ("trainer.global_batch_size=6", "trainer.global_batch_size"),
    ("drafter.block_size=3", "drafter.block_size"),
    ("drafter.block_size=17", "drafter.block_size"),
    ("deepspeed.offload_param=true", "deepspeed.offload_param"),
    ("deepspeed.stage=0", "deepspeed.stage"),
    ("drafter.target_layer_ids=[1,2,40]", "drafter.target_layer_ids"),
    ("target.layer_ids=[1,29]", "target.layer_ids"),
    ("optim.warmup_fraction=1.5", "optim.warmup_fraction"),
    ("drafter.sequential_head=lstm", "sequential_head"),
])
def test_impossible_settings_name_the_field(tt, override, field):
    """Refused by the config's own sections (resolve_config) or by the plan (world size, drafter, target)."""
    with pytest.raises(ValueError, match=field.replace(".", r"\.").replace("[", r"\[")):
        plan_training(resolve_config(tt.compose(["trainer.micro_batch_size=4", override])), world_size=1,
                      check_files=False)


@pytest.mark.parametrize("section,kwargs,field", [
    ("TrainerSchema", {"epochs": 0}, "trainer.epochs"), ("TrainerSchema", {"max_steps": 0}, "trainer.max_steps"),
    ("TrainerSchema", {"autocast": "fp16"}, "trainer.autocast"), ("OptimSchema", {"lr": 0.0}, "optim.lr"),
    ("OptimSchema", {"betas": [0.9]}, "optim.betas"), ("DeepSpeedSchema", {"stage": 0}, "deepspeed.stage"),
    ("DataSchema", {"features": "cached"}, "data.features"),
    ("DataSchema", {"max_anchors_per_seq": 0}, "data.max_anchors_per_seq")])
def test_each_section_checks_its_own_fields_when_built(section, kwargs, field):
    """The same check whether the section comes from Hydra (above) or is built in code."""
    from deepspec.training import config

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        getattr(config, section)(**kwargs)
    getattr(config, section)()  # the defaults are valid


def test_batch_divisibility_depends_on_world_size(tt):
    cfg = resolve_config(tt.compose(["trainer.global_batch_size=12", "trainer.micro_batch_size=2"]))
    assert plan_training(cfg, world_size=2, check_files=False).grad_accum_steps == 3 == cfg.trainer.grad_accum_steps(2)
    with pytest.raises(ValueError, match="world size 4"):
        plan_training(cfg, world_size=4, check_files=False)


def deepspeed_config_of(cfg, world: int, precision: str) -> dict:
    """DeepSpeed's config of `cfg` on `world` CPU ranks at `precision` (trainer.precision)."""
    import dataclasses

    import torch

    from deepspec.training.placement import placement_on

    placement = placement_on(torch.device("cpu"), dataclasses.replace(cfg.trainer, precision=precision), cfg.deepspeed,
                             world)
    return deepspeed_config(cfg.deepspeed, cfg.optim, placement, cfg.trainer.micro_batch_size,
                            cfg.trainer.grad_accum_steps(world))


def test_accumulation_keeps_the_global_batch_for_any_world_size(tt):
    cfg = resolve_config(tt.compose(["trainer.global_batch_size=64", "trainer.micro_batch_size=2"]))
    for world, accum in ((1, 32), (2, 16), (8, 4)):
        ds = deepspeed_config_of(cfg, world, "fp32")
        assert ds["gradient_accumulation_steps"] == accum
        assert ds["train_batch_size"] == ds["gradient_accumulation_steps"] * 2 * world
        if world > 1:
            assert ds["optimizer"]["params"]["torch_adam"] is True and ds["zero_optimization"]["stage"] == 2
        else:  # one fp32 process: the engine without ZeRO, with the client ClippedAdamW (clipping moves into it)
            assert "optimizer" not in ds and ds["zero_optimization"]["stage"] == 0 and ds["gradient_clipping"] == 0
    assert deepspeed_config_of(cfg, 1, "bf16")["bf16"]["enabled"] is True
    assert deepspeed_config_of(cfg, 1, "bf16")["zero_optimization"]["stage"] == 2  # bf16: ZeRO's fp32 master copy
    single = resolve_config(tt.compose(["trainer.global_batch_size=64", "trainer.micro_batch_size=2",
                                        "deepspeed.single_process_engine=false"]))
    assert deepspeed_config_of(single, 1, "fp32")["zero_optimization"]["stage"] == 2


def test_warmup_then_cosine_schedule():
    schedule = WarmupCosine(total_steps=100, warmup_fraction=0.04, min_ratio=0.1)
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == 1.0
    assert math.isclose(schedule(52), 0.1 + 0.9 * 0.5, rel_tol=1e-12)  # half-way through the cosine
    assert math.isclose(schedule(100), 0.1, rel_tol=1e-12)


def test_missing_cache_is_refused_before_loading_weights(tt, tmp_path, monkeypatch):
    from deepspec.training import session

    monkeypatch.setattr(session, "load_training_target", lambda *a, **k: pytest.fail("weights loaded"))
    from deepspec.training import run

    cfg = tt.compose(tt.train_overrides(tmp_path / "no_cache", tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="data.cache_dir"):
        run(cfg)


def test_fingerprint_mismatch_is_refused(tt, tiny_cache, tmp_path):
    cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "out", "target=tiny-random-qwen3")))
    with pytest.raises(ValueError, match="config_hash"):
        plan_training(cfg, world_size=1)


def test_unwritable_out_dir_is_refused(tt, tiny_cache, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, blocker / "out")))
    with pytest.raises(ValueError, match="trainer.out_dir"):
        plan_training(cfg, world_size=1)


def test_layer_ids_must_match_the_cache(tt, tiny_cache, tmp_path):
    cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "out", "drafter.target_layer_ids=[0,1]")))
    with pytest.raises(ValueError, match="drafter.target_layer_ids"):
        plan_training(cfg, world_size=1)


def test_a_cache_of_another_format_version_is_refused_before_weights_load(tt, tiny_cache, tmp_path):
    import json
    import shutil

    other = tmp_path / "v1"
    shutil.copytree(tiny_cache, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    cfg = resolve_config(tt.compose(tt.train_overrides(other, tmp_path / "run")))
    with pytest.raises(ValueError, match=r"v1/meta.json: cache format_version=1, this DeepSpec reads version 2"):
        plan_training(cfg, world_size=1)


def test_too_few_train_samples_for_the_global_batch(tt, tiny_cache, tmp_path):
    from deepspec.training import run

    cfg = tt.compose(tt.train_overrides(tiny_cache, tmp_path / "out", "trainer.global_batch_size=32"))
    with pytest.raises(ValueError, match="fewer than trainer.global_batch_size=32"):
        run(cfg)


def test_valid_tiny_plan_reads_cache_layers(tt, tiny_cache, tmp_path):
    cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "out")))
    plan = plan_training(cfg, world_size=2)
    assert plan.cache_layer_ids == [0, 1, 2] and plan.drafter_layer_ids == [0, 1, 2]
    assert plan.grad_accum_steps == 1 and Path(plan.out_dir).is_dir()


def test_eagle3_fuses_every_cached_layer_unless_told_low_mid_high(tt):
    """The paper's protocol: Eagle3 reads the same (5) layers as the block drafters; the 3-layer subset stays
    one config value away, and explicit ids with it are refused naming both fields."""
    base = ["drafter=eagle3", "target=qwen3-4b"]
    plan = plan_training(resolve_config(tt.compose(base)), world_size=1, check_files=False)
    assert plan.cache_layer_ids == [1, 9, 17, 25, 33] and plan.drafter_layer_ids == plan.cache_layer_ids
    plan = plan_training(resolve_config(tt.compose([*base, "drafter.feature_layers=low_mid_high"])), world_size=1,
                         check_files=False)
    assert plan.drafter_layer_ids == [1, 17, 33]
    with pytest.raises(ValueError, match=r"drafter\.feature_layers='low_mid_high' and drafter\.target_layer_ids"):
        resolve_config(tt.compose([*base, "drafter.feature_layers=low_mid_high", "drafter.target_layer_ids=[1,9,17]"]))
    with pytest.raises(ValueError, match=r"drafter\.feature_layers='most'"):
        resolve_config(tt.compose([*base, "drafter.feature_layers=most"]))


def test_template_options_must_match_the_cache_and_reach_the_drafter_config(tt, tiny_cache, tmp_path):
    """A cache rendered without options refuses a run configured for Qwen3 non-thinking mode, naming the field;
    the options a run trains with are recorded in the drafter config (evaluation renders prompts with them)."""
    from deepspec.training.config import drafter_overrides

    cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "out",
                                                       "+target.chat_template_kwargs.enable_thinking=false")))
    assert cfg.target.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"target.chat_template_kwargs=\{'enable_thinking': False\} but the cache at "
                                         r"data.cache_dir=.* was rendered with chat_template_kwargs=\{\}"):
        plan_training(cfg, world_size=1)
    assert drafter_overrides(cfg)["chat_template_kwargs"] == {"enable_thinking": False}
    assert resolve_config(tt.compose(["target=qwen3-4b"])).target.chat_template_kwargs == {"enable_thinking": False}


def test_draft_layer_family_is_checked_before_weights_load(tt, tiny_cache, tmp_path):
    """`drafter.layer_family`: a family DeepSpec builds (the error names the choices), one the target's config converts
    into, not with init_from_target, not on a standalone drafter; all refused by plan_training (no weights)."""
    cfg = resolve_config(tt.compose(["drafter=dflash", "drafter.layer_family=gpt2"]))
    with pytest.raises(ValueError, match=r"drafter.layer_family='gpt2' must be null \(the target's family\) or one of "
                                         r"\['gemma3_text', 'llama', 'mistral', 'qwen2', 'qwen3'\]"):
        plan_training(cfg, world_size=1, check_files=False)
    cfg = resolve_config(tt.compose(["drafter=standalone", "drafter.layer_family=qwen3"]))
    with pytest.raises(ValueError, match=r"drafter.layer_family='qwen3': a standalone drafter is a causal LM"):
        plan_training(cfg, world_size=1, check_files=False)
    for extra, message in ((["drafter.layer_family=gemma3_text"], r"Gemma 3 layers need settings only a Gemma 3"),
                           (["drafter.layer_family=qwen3", "drafter.init_from_target=true"],
                            r"the target's llama layers cannot be copied into qwen3 draft layers")):
        cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "out", *extra)))
        with pytest.raises(ValueError, match=message):
            plan_training(cfg, world_size=1)
    # The target's own family, spelled out, is the default; another family plans like any drafter.
    for family in ("llama", "qwen3"):
        overrides = tt.train_overrides(tiny_cache, tmp_path / family, f"drafter.layer_family={family}")
        cfg = resolve_config(tt.compose(overrides))
        assert plan_training(cfg, world_size=1).drafter_layer_ids == [0, 1, 2]
