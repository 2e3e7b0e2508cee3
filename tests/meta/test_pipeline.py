"""The quickstart's own pieces: held-out prompts are disjoint from training prompts, train overrides validate and
select the budget's training preset (`cpu` by default), a run folder resumes only its own budget."""

import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from deepspec.data.sources import Conversation, load_sharegpt_bundled
from deepspec.pipeline import Pipeline, held_out_prompts, named_budget, training_prompts
from deepspec.utils.config import config_options


def test_held_out_prompts_never_overlap_the_regenerated_ones(tmp_path):
    used, _ = load_sharegpt_bundled(limit=40)
    path = held_out_prompts(40, tmp_path / "heldout.jsonl", num=5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and all(len(r["turns"]) == 1 for r in rows)
    assert not {r["id"] for r in rows} & {c.id for c in used}


def _first_prompt_lengths(conversations, tokenizer) -> dict[str, int | None]:
    """Each conversation's first prompt in tokens as regeneration renders it (None: no user message)."""
    from deepspec.data.regenerate import first_turn_prompt
    from deepspec.data.rendering import Rendering

    prompts = {c.id: first_turn_prompt(c) for c in conversations}
    return {k: None if m is None else len(Rendering().prompt_ids(tokenizer, m)) for k, m in prompts.items()}


def test_every_regeneration_prompt_fits_the_prompt_budget_and_the_held_out_ones_come_after_them(tmp_path):
    """The first N conversations whose first prompt fits (none left without an answer), in ShareGPT order; the
    held-out prompts start after the last conversation read, so they never overlap."""
    from deepspec.targets.load import load_tokenizer

    tokenizer, budget = load_tokenizer("smollm2-135m"), 64
    read = training_prompts("smollm2-135m", 12, budget, tmp_path / "prompts.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    conversations, _ = load_sharegpt_bundled(limit=read)
    lengths = _first_prompt_lengths(conversations, tokenizer)
    fits = [c.id for c in conversations if lengths[c.id] is not None and lengths[c.id] <= budget]
    assert len(rows) == 12 and len(conversations) == read and [r["id"] for r in rows] == fits
    assert read > 12 and fits[-1] == conversations[-1].id  # some were passed over; none read after the last
    assert all(r["conversations"][-1]["role"] == "user" for r in rows)
    held_out = held_out_prompts(read, tmp_path / "heldout.jsonl", num=3)
    assert not {json.loads(line)["id"] for line in held_out.read_text().splitlines()} & set(lengths)


def test_the_regenerate_stage_draws_as_many_prompts_as_asked_and_every_one_fits(tmp_path, monkeypatch):
    """Before, `--prompts sharegpt --limit N` drew the first N conversations, and those over the prompt budget
    (68 of the quickstart's 240) came back without an answer."""
    from deepspec.targets.load import load_tokenizer

    commands = {}
    monkeypatch.setattr(Pipeline, "run", lambda self, name, cmd: commands.setdefault(name, cmd))
    pipe = Pipeline(tmp_path, named_budget("quick"), "smollm2-135m", ["dspark"], seed=0)
    pipe.regenerate()
    cmd = commands["regenerate"]
    budget = int(cmd[cmd.index("--max-prompt-tokens") + 1])
    assert "--limit" not in cmd and budget == named_budget("quick").max_length // 2
    rows = [json.loads(line) for line in Path(cmd[cmd.index("--prompts") + 1]).read_text().splitlines()]
    conversations = [Conversation(id=r["id"], messages=r["conversations"], source="t", line=None) for r in rows]
    lengths = _first_prompt_lengths(conversations, load_tokenizer("smollm2-135m"))
    assert len(rows) == named_budget("quick").num_conversations and all(n <= budget for n in lengths.values())
    assert pipe.num_read >= len(rows) and "prompts" in pipe.times


@pytest.mark.parametrize("experiment", ["cpu", "cpu-servable"])
@pytest.mark.parametrize("budget", config_options("quickstart"))
@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_train_overrides_compose_and_validate(tmp_path, budget, kind, experiment):
    from deepspec.training.config import compose_train_config, plan_training, resolve_config

    chosen = replace(named_budget(budget), experiment=experiment)
    pipe = Pipeline(tmp_path, chosen, "smollm2-135m", [kind], seed=0)
    overrides = pipe.train_overrides(kind, tmp_path / "cache", tmp_path / "train" / kind)
    assert f"experiment={experiment}" in overrides
    cfg = resolve_config(compose_train_config(overrides))
    plan_training(cfg, world_size=1, check_files=False)  # one process: the batch is achievable
    assert cfg.drafter.kind == kind and cfg.trainer.max_steps == (named_budget(budget).train_steps or 600)
    assert cfg.trainer.val_every == cfg.trainer.save_every == cfg.trainer.max_steps  # validated at the schedule's end
    assert cfg.data.max_anchors_per_seq == (named_budget(budget).anchors_per_seq or 32)
    assert "debug=pipeline" in overrides and not cfg.calibration.enabled  # the calibrate stage fits STS once


# The budgets as they were a Python dict in deepspec/pipeline.py, before they moved into deepspec/conf/quickstart/
# (the training preset was then a constant, cpu).
OLD_BUDGETS = {
    "quick": dict(num_conversations=16, regen_max_new_tokens=48, max_length=256, eval_prompts=1, eval_max_new_tokens=24,
                  speed_prompts=1, regen_batch=48, bf16_target=False, experiment="cpu", train_steps=8,
                  anchors_per_seq=16),
    "default": dict(num_conversations=240, regen_max_new_tokens=160, max_length=448, eval_prompts=6,
                    eval_max_new_tokens=96, speed_prompts=2, regen_batch=48, bf16_target=False, experiment="cpu",
                    train_steps=None, anchors_per_seq=None),
}
QUICKSTART_FILES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "deepspec" / "conf" / "quickstart")
                          .glob("*.yaml"))


@pytest.mark.parametrize("name", QUICKSTART_FILES)
def test_every_quickstart_budget_composes_into_the_budget_schema(name):
    from deepspec.pipeline import Budget, compose_budget

    chosen, budget = compose_budget([f"quickstart={name}"])
    assert chosen == name and isinstance(budget, Budget)
    assert asdict(budget) == OLD_BUDGETS[name]  # the same budgets as before they moved into configuration
    assert config_options("quickstart") == QUICKSTART_FILES == sorted(OLD_BUDGETS)


@pytest.mark.parametrize("override,message", [
    ("quickstart.bogus_key=1", "quickstart.bogus_key"), ("+quickstart.bogus_key=1", "bogus_key"),
    ("+bogus_key=1", "bogus_key"), ("quickstart.eval_prompts=many", "quickstart.eval_prompts"),
    ("quickstart=nosuch", "quickstart=nosuch: there is no quickstart config 'nosuch'; choose one of default, quick")])
def test_a_budget_override_with_an_unknown_key_or_a_wrong_type_fails_naming_it(override, message):
    from deepspec.pipeline import compose_budget

    with pytest.raises(ValueError, match=re.escape(message)):
        compose_budget([override])


def test_a_budget_file_with_an_unknown_key_fails_naming_it(tmp_path):
    import shutil

    from deepspec.pipeline import compose_budget

    conf = tmp_path / "conf"
    shutil.copytree(Path(__file__).resolve().parents[2] / "deepspec" / "conf", conf)
    quick = (conf / "quickstart" / "quick.yaml").read_text()
    (conf / "quickstart" / "typo.yaml").write_text(quick + "eval_promts: 3\n")
    assert compose_budget(["quickstart=quick"], config_dir=conf)[1] == named_budget("quick")
    with pytest.raises(ValueError, match="eval_promts"):
        compose_budget(["quickstart=typo"], config_dir=conf)


def test_quick_is_the_selection_of_the_quick_budget_and_overrides_change_a_budget_like_any_setting():
    from deepspec.pipeline import parse_job

    args, name, budget = parse_job(["--quick"])
    assert (name, asdict(budget)) == ("quick", OLD_BUDGETS["quick"]) and parse_job(["quickstart=quick"])[1:] == (
        name, budget)
    assert parse_job([])[1:] == ("default", named_budget("default"))
    args, name, budget = parse_job(["--quick", "quickstart.train_steps=32", "--seed", "2", "--drafters", "dspark",
                                    "eagle3", "quickstart.eval_prompts=3"])
    assert (name, budget.train_steps, budget.eval_prompts, budget.max_length) == ("quick", 32, 3, 256)
    assert args.drafters == ["dspark", "eagle3"] and args.seed == 2  # an override after --drafters is the budget's
    assert parse_job(["--bf16-target"])[2].bf16_target and not parse_job([])[2].bf16_target


# The quickstart's `deepspec train` command line before its preset moved into deepspec/conf/experiment/cpu.yaml (and
# cpu/<kind>.yaml), run folder and cache aside: `experiment=cpu` must train exactly this drafter on this schedule.
OLD_QUICKSTART = ["target=smollm2-135m", "deepspeed=zero2", "data.max_anchors_per_seq=32", "trainer.autocast=auto",
                  "trainer.max_steps=600", "trainer.epochs=1000", "trainer.global_batch_size=4",
                  "trainer.micro_batch_size=4", "trainer.val_every=600", "trainer.save_every=600",
                  "trainer.log_every=30", "optim.lr=0.0006", "trainer.seed=0", "logger=jsonl",
                  "calibration.enabled=false"]
OLD_BLOCK_PRESET = ["drafter.num_draft_layers=2", "drafter.init_from_target=false",
                    "drafter.anchor_fusion=latest_context", "drafter.draft_vocab_size=8192"]
# DSpark's preset since the output adapter: one layer, the bigram start at scale 1, the backbone's output from zero;
# validated and saved as the average of its weights.
DSPARK_PRESET = ["drafter.num_draft_layers=1", *OLD_BLOCK_PRESET[1:], "drafter.markov_init_scale=1.0",
                 "drafter.output_adapter=zero", "trainer.ema_decay=0.95"]
# The quickstart trains the same drafters as before its preset moved (DSpark: as its preset now says).
OLD_QUICKSTART_DRAFTER = {"dspark": DSPARK_PRESET, "dflash": OLD_BLOCK_PRESET,
                          "eagle3": ["drafter.draft_vocab_size=8192"], "mtp": [], "standalone": []}


@pytest.mark.parametrize("kind", sorted(OLD_QUICKSTART_DRAFTER))
def test_the_quickstart_trains_the_same_drafter_as_before_its_preset_moved(tmp_path, kind):
    from deepspec.training.config import compose_train_config, resolve_config

    run_dir = tmp_path / "run"
    run = [f"data.cache_dir={tmp_path / 'cache'}", f"trainer.out_dir={run_dir}", f"hydra.run.dir={run_dir}"]
    old = [f"drafter={kind}", *OLD_QUICKSTART_DRAFTER[kind], *OLD_QUICKSTART, *run]
    before = resolve_config(compose_train_config(old))
    pipe = Pipeline(tmp_path, named_budget("default"), "smollm2-135m", [kind], seed=0)
    now = resolve_config(compose_train_config(pipe.train_overrides(kind, tmp_path / "cache", tmp_path / "run")))
    assert asdict(now.drafter) == asdict(before.drafter) and asdict(now.trainer) == asdict(before.trainer)
    assert asdict(now) == asdict(before)  # every other section too (data, optim, loss, deepspeed, logger, ...)
    if kind == "dspark":
        assert now.drafter.markov_init == "bigram" and now.drafter.anchor_fusion == "latest_context"


def test_the_stages_choices_come_from_the_specs(tmp_path):
    """Export formats per kind for the embedded Llama-family target, calibration for confidence heads only."""
    from deepspec.export import formats_for
    from deepspec.pipeline import default_capabilities

    assert {k: formats_for(k, "llama") for k in ("dspark", "dflash", "eagle3", "mtp")} == {
        "dspark": ["hf"], "dflash": ["hf"], "eagle3": ["hf", "sglang", "vllm"], "mtp": ["hf"]}
    assert formats_for("dflash", "qwen3") == ["hf", "sglang", "vllm"]  # DFlash engine layers are Qwen3-shaped
    assert formats_for("mtp", "qwen3") == ["hf", "vllm"]  # speculators' MTP is Qwen3-only; NextN is DeepSeek-V3's
    assert formats_for("mtp", "qwen3", num_positions=1) == ["hf", "vllm"]
    assert formats_for("mtp", "qwen3", num_positions=3) == ["hf"]  # speculators' MTP holds one module
    # Eagle3 engines' fc reads exactly 3 layers: a 5-layer Eagle3 (the default) exports to hf only
    assert formats_for("eagle3", "llama", num_feature_layers=5) == ["hf"]
    assert formats_for("eagle3", "llama", num_feature_layers=3) == ["hf", "sglang", "vllm"]
    assert [k for k in ("dspark", "dflash", "eagle3", "mtp") if default_capabilities(k).confidence_head] == ["dspark"]
    assert formats_for("dspark", "qwen3", reduced_vocab=True) == ["hf"]  # engines take the whole target head
    assert formats_for("eagle3", "llama", num_feature_layers=3, reduced_vocab=True) == ["hf", "sglang", "vllm"]
    assert formats_for("dspark", "qwen3", engine_unread=True) == ["hf"]  # no engine reads the anchor fusion


def test_a_tiny_targets_layouts_are_decided_before_the_first_stage_and_its_export_stage_runs(
        tmp_path, monkeypatch, capsys, tiny_drafter):
    """`--quick --target tiny-random-llama` ran every stage, then failed at export: the target's config could not be
    read there. The preflight reads it before the first stage, and leaves out, saying so, the layout such a target
    cannot have (vLLM's names a verifier model, which an in-memory target lacks)."""
    from deepspec.targets.load import make_tiny_target

    commands = {}
    monkeypatch.setattr(Pipeline, "run", lambda self, name, cmd: commands.setdefault(name, cmd))
    pipe = Pipeline(tmp_path, named_budget("quick"), "tiny-random-llama", ["dspark", "eagle3"], seed=0)
    pipe.preflight()
    assert pipe.target_model_type == "llama" and list(pipe.left_out) == ["vllm"]
    assert ("[pipeline] export: the vllm layout is left out (the target 'tiny-random-llama' exists only in memory, "
            "so no hub id or folder names it)\n") in capsys.readouterr().out
    target, drafters = make_tiny_target("llama"), {}
    for kind in ("dspark", "eagle3"):
        drafters[kind] = tmp_path / "train" / kind / "checkpoints" / "step-00000008" / "drafter"
        tiny_drafter(kind, target).save_pretrained(drafters[kind])
    pipe.export(drafters, tmp_path / "eval")
    assert sorted(commands) == ["export-dspark-hf", "export-eagle3-hf", "export-eagle3-sglang"]


@pytest.mark.parametrize("argv,message", [
    (["--drafters", "dspark", "nosuch"], "--drafters nosuch: no such drafter kind; choose from ["),
    (["--target", "no-such-model-folder"], "target 'no-such-model-folder' is neither an embedded target"),
    (["quickstart.eval_prompts=many"], "invalid pipeline config"),
], ids=["drafter-kind", "target", "budget"])
def test_a_job_a_later_stage_would_refuse_is_refused_before_the_first_stage(tmp_path, monkeypatch, argv, message):
    from deepspec.pipeline import main

    def no_stage(*args, **kwargs):
        raise AssertionError("a stage ran before the job was checked")

    monkeypatch.setattr(Pipeline, "run", no_stage)
    monkeypatch.setattr(Pipeline, "regenerate", no_stage)
    out = tmp_path / "run"
    with pytest.raises((ValueError, OSError), match=re.escape(message)):  # both a one-line refusal (exit 1)
        main(["--quick", "--target", "tiny-random-llama", *argv, "--out", str(out)])
    assert not out.exists()  # nothing written


def test_the_speed_summary_puts_prompt_lookup_and_the_combined_proposer_next_to_the_drafters():
    from deepspec.pipeline import summarise_speed

    row = {"tau": 1.8, "tokens_per_s": 20.0, "speedup_vs_ar": 1.5, "speedup_vs_prompt_lookup": 1.1}
    speed = {"baselines": {"T=0": {"prompt_lookup": {"tau": 2.4, "tokens_per_s": 22.0, "speedup_vs_ar": 1.6}},
                           "T=1": {"prompt_lookup": {"tau": 1.3, "tokens_per_s": None, "speedup_vs_ar": None}}},
             "drafters": {"dspark": {"T=0": row, "T=1": {**row, "tau": 1.5, "speedup_vs_prompt_lookup": None}},
                          "dspark+lookup": {"T=0": {**row, "tau": 2.6, "lookup_round_share": 0.25}}}}
    lines = summarise_speed(speed).splitlines()
    assert lines[1] == "  T=0: dspark 1.80, dspark+lookup 2.60, prompt lookup 2.40"
    assert lines[2] == "  T=1: dspark 1.50, prompt lookup 1.30"
    assert any("n/a tok/s" in line for line in lines)  # a number the benchmark could not measure is said so
    assert any(line.startswith("  dspark+lookup T=0") and line.endswith("in 25% of rounds") for line in lines)


def test_every_stage_is_timed_in_wall_and_cpu_seconds_and_a_resumed_run_shows_the_earlier_times(
        tmp_path, capsys, monkeypatch):
    """Each stage's wall and CPU seconds (read from clocks the test sets) are recorded in the stage's marker and in
    timings.json; a re-run skips a finished stage and shows its earlier times, marked, outside the sum."""
    import sys
    from types import SimpleNamespace

    import deepspec.pipeline as pipeline
    from deepspec.pipeline import summarise_times

    walls, cpus = iter([0.0, 2.0, 10.0, 13.5, 20.0, 20.25]), iter([1.0, 1.8, 5.0, 5.1, 6.0, 6.5])
    monkeypatch.setattr(pipeline, "time", SimpleNamespace(perf_counter=lambda: next(walls)))
    monkeypatch.setattr(pipeline, "cpu_seconds", lambda: next(cpus))
    pipe = Pipeline(tmp_path, named_budget("quick"), "smollm2-135m", ["dspark"], seed=0)
    pipe.run("spin", [sys.executable, "-c", "pass"])
    pipe.run("sleep", [sys.executable, "-c", "pass"])
    spun, slept = pipe.times["spin"], pipe.times["sleep"]
    assert spun == {"wall_s": 2.0, "cpu_s": 0.8} and slept == {"wall_s": 3.5, "cpu_s": 0.1}
    assert json.loads((tmp_path / ".done-spin").read_text()) == spun
    assert json.loads((tmp_path / "timings.json").read_text())["stages"] == {"spin": spun, "sleep": slept}

    (tmp_path / ".done-sleep").write_text("12.5s\n")  # a marker from before markers held the timing
    again = Pipeline(tmp_path, named_budget("quick"), "smollm2-135m", ["dspark"], seed=0)
    again.run("spin", ["false"])  # finished: not run again (it would fail)
    again.run("sleep", ["false"])
    again.run("new", [sys.executable, "-c", "pass"])
    assert again.times["spin"] == {**spun, "resumed": True}
    assert again.times["sleep"] == {"wall_s": 12.5, "cpu_s": None, "resumed": True}
    record = json.loads((tmp_path / "timings.json").read_text())
    assert list(record["stages"]) == ["spin", "sleep", "new"] and record["total_cpu_s"] == again.times["new"]["cpu_s"]
    table = summarise_times(again.times, 1.0).splitlines()
    assert table[1].split() == ["stage", "wall", "s", "CPU", "s"]
    assert table[2].split() == ["spin", f"{spun['wall_s']:.1f}", f"{spun['cpu_s']:.1f}", "(an", "earlier", "run)"]
    assert table[3].split() == ["sleep", "12.5", "-", "(an", "earlier", "run)"]
    assert table[-1].split()[:3] == ["this", "run", "1.0"]


def test_the_cpu_seconds_count_the_finished_subprocesses(monkeypatch):
    """A stage's CPU seconds are mostly its subprocess's: user + system of this process and of its children."""
    import resource
    from types import SimpleNamespace

    import deepspec.pipeline as pipeline

    usage = {resource.RUSAGE_SELF: SimpleNamespace(ru_utime=1.0, ru_stime=0.25),
             resource.RUSAGE_CHILDREN: SimpleNamespace(ru_utime=30.0, ru_stime=2.5)}
    monkeypatch.setattr(pipeline, "resource", SimpleNamespace(getrusage=usage.__getitem__, **{
        name: getattr(resource, name) for name in ("RUSAGE_SELF", "RUSAGE_CHILDREN")}))
    assert pipeline.cpu_seconds() == 33.75


@pytest.mark.parametrize("bf16_units", [True, False])
def test_bf16_target_weights_for_regeneration_and_the_cache_only_when_asked_and_the_cpu_has_bf16_units(
        tmp_path, monkeypatch, bf16_units):
    """`--bf16-target` (opt-in: bf16 greedy answers differ from fp32 ones) reaches regenerate and cache; never
    evaluation, which verifies with the default fp32 target."""
    from dataclasses import replace

    import deepspec.training.engine as engine

    commands = {}
    monkeypatch.setattr(Pipeline, "run", lambda self, name, cmd: commands.setdefault(name, cmd))
    monkeypatch.setattr(engine, "cpu_has_bf16_matmul", lambda: bf16_units)
    for asked in (False, True):
        commands.clear()
        pipe = Pipeline(tmp_path, replace(named_budget("quick"), bf16_target=asked), "smollm2-135m", ["dspark"], seed=0)
        pipe.cache(pipe.regenerate())
        pipe.evaluate({"dspark": tmp_path / "drafter"}, tmp_path / "cache")
        regenerate, cache = commands["regenerate"], commands["cache"]
        expected = asked and bf16_units
        assert (regenerate[regenerate.index("--target") + 1:].count("bf16") == 1) is expected
        assert ("--dtype" in regenerate) is expected and ("target.dtype=bf16" in cache) is expected
        assert "bf16" not in commands["evaluate"] and "--dtype" not in commands["evaluate"]


def test_the_servable_preset_trains_drafters_whose_export_reaches_the_engine_layouts(
        tmp_path, monkeypatch, experiment_drafter):
    """quickstart.experiment=cpu-servable: each block drafter's preset turns on nothing only the `hf` layout holds,
    so the export stage writes the engines' layouts too (vLLM's is left out for an in-memory target: no verifier
    name); the cpu preset's DSpark reaches `hf` alone."""
    from deepspec.drafters.build import build_drafter
    from deepspec.targets.load import make_tiny_target

    target = make_tiny_target("llama")
    commands = {}
    monkeypatch.setattr(Pipeline, "run", lambda self, name, cmd: commands.setdefault(name, cmd))
    pipe = Pipeline(tmp_path, replace(named_budget("quick"), experiment="cpu-servable"), "tiny-random-llama",
                    ["dspark", "dflash"], seed=0)
    pipe.preflight()
    drafters = {}
    for kind in ("dspark", "dflash"):
        params = {**experiment_drafter(kind, "cpu-servable"), "target_layer_ids": [0, 1, 2]}
        if kind == "dspark":
            params["markov_init"] = "random"  # the bigram start needs training data
        drafters[kind] = tmp_path / kind / "checkpoints" / "step-00000008" / "drafter"
        build_drafter(kind, target, **params).save_pretrained(drafters[kind])
    pipe.export(drafters, tmp_path / "eval")
    assert sorted(commands) == ["export-dflash-hf", "export-dflash-sglang", "export-dspark-hf", "export-dspark-sglang"]
    commands.clear()
    research = {**experiment_drafter("dspark", "cpu"), "target_layer_ids": [0, 1, 2], "markov_init": "random"}
    build_drafter("dspark", target, **research).save_pretrained(tmp_path / "research" / "drafter")
    pipe.export({"dspark": tmp_path / "research" / "drafter"}, tmp_path / "eval")
    assert sorted(commands) == ["export-dspark-hf"]


def test_a_run_folder_resumes_only_the_budget_it_was_started_with(tmp_path, monkeypatch):
    from deepspec.pipeline import check_same_budget, default_run_folder, main

    out = tmp_path / "run"
    out.mkdir()
    started = asdict(named_budget("quick"))
    del started["experiment"]  # a budget.json written before the field existed: read as its default
    (out / "budget.json").write_text(json.dumps(started))
    check_same_budget(out, named_budget("quick"))
    monkeypatch.setattr(Pipeline, "regenerate", lambda self: pytest.fail("a stage ran for another budget"))
    with pytest.raises(ValueError, match=re.escape("started with another budget (eval_prompts: 1 -> 3; experiment: "
                                                   "'cpu' -> 'cpu-servable')")):
        main(["--quick", "quickstart.experiment=cpu-servable", "quickstart.eval_prompts=3", "--out", str(out)])
    assert default_run_folder("default", named_budget("default")) == Path("runs/quickstart")
    assert default_run_folder("quick", replace(named_budget("quick"), experiment="cpu-servable")) == Path(
        "runs/quickstart-quick-cpu-servable")
