"""The quickstart, end to end on one target: regenerate -> cache -> train -> floors -> calibrate -> evaluate -> bench
speed -> export.

Each stage is the project's own command line (`deepspec <stage>`, the same ones a user runs by hand),
executed as a subprocess (`python -m deepspec.cli <stage> ...`) so that every stage is exercised exactly
as documented; nothing is read from a source checkout, so it runs the same from an installed wheel (the
Hydra configs are packaged in deepspec/conf). Finished stages leave a marker in the run folder, so an
interrupted job resumes at the first unfinished stage.

The job's budget (how many prompts it regenerates and evaluates, how long, the cuts of the training preset's
schedule) is configuration: deepspec/conf/pipeline.yaml selects one of deepspec/conf/quickstart/<name>.yaml, each
a delta over `Budget`, and Hydra overrides on the job's command line change it like any other setting. Training
is the preset's (`quickstart.experiment`, default cpu), the same for every drafter.

    python -m deepspec.pipeline            # DSpark on the default budget (or: deepspec pipeline)
    python -m deepspec.pipeline --compare  # DSpark, DFlash and Eagle3 at an equal budget (later stages per drafter)
    python -m deepspec.pipeline --quick    # a few-minute demo: quickstart=quick (tiny budgets; tau will be low)
    python -m deepspec.pipeline quickstart.eval_prompts=12  # the default budget with more evaluation prompts
    python -m deepspec.pipeline quickstart.experiment=cpu-servable  # drafters vLLM and SGLang load (learn less)

docs/results.md has the stage times of the default budget, with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from omegaconf import MISSING, OmegaConf

from deepspec.utils.errors import command_line
from deepspec.utils.io import atomic_write_text
from deepspec.utils.machine import cpu_model


@dataclass
class Budget:
    """What the stages around training cost; training itself is the experiment's (the same steps, batch and
    anchors for every drafter, so a --compare table compares like with like) unless a field below cuts it.
    The schema of deepspec/conf/quickstart/<name>.yaml (`quickstart=<name>`, `quickstart.<field>=...`)."""

    num_conversations: int  # ShareGPT prompts whose answers the target regenerates
    regen_max_new_tokens: int
    max_length: int  # cache / training sequence length
    eval_prompts: int  # per benchmark
    eval_max_new_tokens: int
    speed_prompts: int
    # conversations per generate call: more generated tokens per CPU-s than smaller batches, the same answers
    # (docs/results.md, section 3)
    regen_batch: int = 48
    bf16_target: bool = False  # regenerate and cache with bf16 target weights where the CPU multiplies in bf16
    # The training preset, deepspec/conf/experiment/<name>.yaml: cpu (the drafter that learns most here, `hf` layout
    # only for the block drafters) or cpu-servable (drafters vLLM and SGLang load)
    experiment: str = "cpu"
    train_steps: Optional[int] = None  # None: the experiment's schedule
    anchors_per_seq: Optional[int] = None  # None: the experiment's


@dataclass
class PipelineConfig:
    """deepspec/conf/pipeline.yaml: the budget chosen from the `quickstart` group."""

    quickstart: Budget = MISSING


def compose_budget(overrides: list[str] = (), config_dir: str | Path | None = None) -> tuple[str, Budget]:
    """(the chosen quickstart option, its Budget) of deepspec/conf/pipeline.yaml with Hydra `overrides`
    (`quickstart=quick`, `quickstart.eval_prompts=12`); an unknown key or a wrong type fails naming it.
    `config_dir` replaces the packaged configs with a folder of the same layout (tests)."""
    from hydra.core.config_store import ConfigStore

    from deepspec.utils.config import compose_config, merge_into_schema

    store = ConfigStore.instance()
    store.store(name="pipeline_schema", node=PipelineConfig)
    store.store(group="quickstart", name="base_quickstart", node=Budget)
    cfg = compose_config("pipeline", overrides, config_dir, what="pipeline config")
    schema = OmegaConf.structured(PipelineConfig)
    OmegaConf.set_struct(schema, True)  # a key added with `+` fails too
    return cfg.hydra.runtime.choices.quickstart, merge_into_schema(cfg, lambda _: schema, "pipeline config").quickstart


def named_budget(name: str) -> Budget:
    """The budget of deepspec/conf/quickstart/<name>.yaml as it stands."""
    return compose_budget([f"quickstart={name}"])[1]


COMPARED_DRAFTERS = ["dspark", "dflash", "eagle3"]  # --compare: the paper's three at an equal budget


class Pipeline:
    def __init__(self, out: Path, budget: Budget, target: str, drafters: list[str], seed: int):
        self.out, self.budget, self.target, self.drafters, self.seed = out, budget, target, drafters, seed
        self.deepspec = [sys.executable, "-m", "deepspec.cli"]  # the `deepspec` console script
        self.times: dict[str, dict] = {}  # stage -> {"wall_s", "cpu_s"[, "resumed"]}, in the order run
        self.num_read = 0  # bundled ShareGPT conversations read for the regeneration prompts (`training_prompts`)
        self.target_model_type: str | None = None  # `preflight`
        self.left_out: dict[str, str] = {}  # export layouts this target cannot have -> why (`preflight`)

    def run(self, name: str, cmd: list[str]) -> None:
        marker = self.out / f".done-{name}"
        if marker.exists():
            self.times[name] = {**read_marker(marker), "resumed": True}
            print(f"[pipeline] {name}: already done ({marker.name}), skipping", flush=True)
            return
        print(f"\n[pipeline] {name}: {shlex.join(cmd)}", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with self.timed(name) as timing:
            subprocess.run(cmd, env=env, check=True)
        atomic_write_text(marker, json.dumps(timing) + "\n")

    @contextmanager
    def timed(self, name: str) -> Iterator[dict]:
        """Time one stage: wall seconds, and the CPU seconds (user + system) of this process and the stage's
        subprocesses together; the entry is filled in when the stage ends and written to timings.json at once."""
        timing: dict = {}
        wall0, cpu0 = time.perf_counter(), cpu_seconds()
        yield timing
        timing.update(wall_s=round(time.perf_counter() - wall0, 1), cpu_s=round(cpu_seconds() - cpu0, 1))
        self.times[name] = timing
        self.write_times()
        print(f"[pipeline] {name}: done in {timing['wall_s']:.0f}s ({timing['cpu_s']:.0f} CPU-s)", flush=True)

    def write_times(self, total_wall_s: float | None = None) -> Path:
        path = self.out / "timings.json"
        atomic_write_text(path, json.dumps(stage_times_record(self.times, total_wall_s), indent=2) + "\n")
        return path

    def preflight(self) -> None:
        """What each stage will need that names and configs decide, checked before the first stage runs, so that a
        job which could only fail at a later stage is refused in one line at the start: the target's config (the
        cache's layers, the export's layouts), each drafter's training preset (composed and validated), the
        benchmark that evaluate and the speed stage read; and which layouts the export stage can write for this
        target (`self.left_out`: those it cannot, said here, e.g. vLLM's for a target that exists only in memory)."""
        from deepspec.drafters.spec import drafter_kinds
        from deepspec.evaluation.prompt_sets import humaneval_bundled_path
        from deepspec.export.vllm_speculators import verifier_name_or_path
        from deepspec.targets.load import load_target_config
        from deepspec.training.config import compose_train_config, resolve_config

        unknown = [kind for kind in self.drafters if kind not in drafter_kinds()]
        if unknown:
            raise ValueError(f"--drafters {' '.join(unknown)}: no such drafter kind; choose from {drafter_kinds()}")
        self.target_model_type = load_target_config(self.target).model_type
        for kind in self.drafters:
            overrides = self.train_overrides(kind, self.out / "cache", self.out / "train" / kind)
            resolve_config(compose_train_config(overrides))
        humaneval_bundled_path()
        try:
            verifier_name_or_path(SimpleNamespace(target_name=self.target), None, None)
        except ValueError as why:
            self.left_out["vllm"] = str(why).split("; pass ")[0]
        for fmt, why in self.left_out.items():
            print(f"[pipeline] export: the {fmt} layout is left out ({why})", flush=True)

    # -- stages --------------------------------------------------------------------------------
    def regenerate(self) -> Path:
        data, prompts = self.out / "regenerated.jsonl", self.out / "prompts.jsonl"
        b = self.budget
        with self.timed("prompts"):  # cheap and deterministic: redone on every run, the held-out prompts follow it
            self.num_read = training_prompts(self.target, b.num_conversations, b.max_length // 2, prompts)
        self.run("regenerate", [*self.deepspec, "regenerate", "--prompts", str(prompts), "--target", self.target,
                                "--max-turns", "1", "--max-prompt-tokens", str(b.max_length // 2),
                                "--max-new-tokens", str(b.regen_max_new_tokens), "--temperature", "0",
                                *self.target_dtype("--dtype"), "--batch-size", str(b.regen_batch),
                                "--seed", str(self.seed), "--out", str(data)])
        return data

    def target_dtype(self, option: str) -> list[str]:
        """bf16 target weights for regeneration and caching (`--bf16-target`) where the CPU multiplies in bf16
        natively; else the default (fp32 on CPU). Opt-in: bf16 greedy answers part from fp32 ones after a few dozen
        tokens, and decoding (evaluate, bench speed) verifies with the fp32 target."""
        from deepspec.training.engine import cpu_has_bf16_matmul

        if not self.budget.bf16_target or not cpu_has_bf16_matmul():
            return []
        return [option, "bf16"] if option.startswith("--") else [f"{option}=bf16"]

    def cache(self, data: Path) -> Path:
        cache_dir = self.out / "cache"
        self.run("cache", [*self.deepspec, "cache", f"target.name={self.target}", *self.target_dtype("target.dtype"),
                           f"data.prompts={data}", "data.val_fraction=0.15", "data.test_fraction=0.0",
                           f"data.seed={self.seed}", f"cache.out_dir={cache_dir}",
                           f"cache.max_length={self.budget.max_length}"])
        return cache_dir

    def train(self, cache_dir: Path) -> dict[str, Path]:
        """Every drafter gets the same data, steps, batch and anchors (an equal training budget)."""
        from deepspec.training.latest import latest_drafter_dir

        drafters = {}
        for kind in self.drafters:
            run_dir = self.out / "train" / kind
            self.run(f"train-{kind}", [*self.deepspec, "train", *self.train_overrides(kind, cache_dir, run_dir)])
            drafters[kind] = latest_drafter_dir(run_dir)  # never a crash's step-*.tmp
        return drafters

    def train_overrides(self, kind: str, cache_dir: Path, run_dir: Path) -> list[str]:
        b = self.budget
        cut = []  # the budget's cuts of the experiment's schedule (--quick)
        if b.train_steps is not None:
            cut += [f"trainer.max_steps={b.train_steps}", f"trainer.log_every={max(b.train_steps // 20, 1)}"]
        if b.anchors_per_seq is not None:
            cut.append(f"data.max_anchors_per_seq={b.anchors_per_seq}")
        return [f"experiment={b.experiment}", f"target={self.target}", f"drafter={kind}", f"data.cache_dir={cache_dir}",
                *cut, f"trainer.seed={self.seed}", f"trainer.out_dir={run_dir}", "debug=pipeline",
                f"hydra.run.dir={run_dir}"]

    def floors(self, drafters: dict[str, Path], cache_dir: Path) -> dict:
        """Each block drafter's validation slot-0 agreement against the bigram floor of its own cache's train split,
        and its input ablations (deepspec.benchmarks.learning.drafter_against_floors); eval/floors.json."""
        out, marker = self.out / "eval" / "floors.json", self.out / ".done-floors"
        if out.is_file():
            if marker.is_file():
                self.times["floors"] = {**read_marker(marker), "resumed": True}
            return json.loads(out.read_text())
        with self.timed("floors") as timing:
            result = self.measure_floors(drafters, cache_dir)
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, json.dumps(result, indent=2) + "\n")
        atomic_write_text(marker, json.dumps(timing) + "\n")
        return result

    def measure_floors(self, drafters: dict[str, Path], cache_dir: Path) -> dict:
        from omegaconf import OmegaConf

        from deepspec.benchmarks.learning import drafter_against_floors

        result = {}
        for kind, path in drafters.items():
            if default_capabilities(kind).block_convention is not None:
                try:
                    run_dir = self.out / "train" / kind
                    # the validation blocks training scored: its anchors per sequence (the run's resolved config)
                    data = OmegaConf.load(run_dir / "config.yaml").data
                    anchors = data.get("val_anchors_per_seq") or data.max_anchors_per_seq
                    result[kind] = drafter_against_floors(cache_dir, run_dir, path.parent, anchors, self.seed)
                except ValueError as err:  # e.g. --quick's tiny validation split: say so, the job goes on
                    print(f"[pipeline] floors of {kind} not measured: {err}", flush=True)
        return result

    def calibrate(self, drafters: dict[str, Path], cache_dir: Path) -> None:
        for kind, path in drafters.items():
            if default_capabilities(kind).confidence_head:
                self.run(f"calibrate-{kind}", [*self.deepspec, "calibrate", "--drafter", str(path), "--cache",
                                               str(cache_dir), "--min-samples", "20"])

    def evaluate(self, drafters: dict[str, Path], cache_dir: Path) -> Path:
        b = self.budget
        eval_dir = self.out / "eval"
        chat = held_out_prompts(self.num_read, self.out / "heldout_chat.jsonl", b.eval_prompts)
        self.run("evaluate", [*self.deepspec, "evaluate", "--target", self.target,
                              "--drafter", *[f"{k}={v}" for k, v in drafters.items()],
                              "--benchmarks", f"sharegpt-heldout={chat}", "humaneval",
                              "--domain", "sharegpt-heldout=chat", "--num-prompts", str(b.eval_prompts),
                              "--max-new-tokens", str(b.eval_max_new_tokens), "--temperature", "1.0",
                              "--seed", str(self.seed), "--out", str(eval_dir)])
        self.run("bench-speed", [*self.deepspec, "bench", "speed", "--target", self.target,
                                 "--drafter", *[f"{k}={v}" for k, v in drafters.items()],
                                 "--benchmark", "humaneval", "--num-prompts", str(b.speed_prompts),
                                 "--max-new-tokens", str(b.eval_max_new_tokens),
                                 "--out", str(eval_dir / "bench_speed.json")])
        return eval_dir

    def export(self, drafters: dict[str, Path], eval_dir: Path) -> dict[str, Path]:
        from deepspec.drafters.block.config import engine_unread_extensions
        from deepspec.drafters.spec import get_drafter_spec
        from deepspec.export import formats_for
        from deepspec.targets.load import load_target_config
        from deepspec.utils.checksums import check_drafter_checksums

        exported = {}
        target_model_type = self.target_model_type or load_target_config(self.target).model_type
        for kind, path in drafters.items():
            # The layouts whose engine class fits this target and this drafter's feature-layer count (Eagle3
            # fuses every cached layer by default; the SGLang/vLLM Eagle3 engines read exactly 3) and draft positions
            # (speculators' MTP holds one module).
            spec = get_drafter_spec(kind)
            check_drafter_checksums(path)  # before its config is read (`deepspec export` verifies it again)
            positions = spec.capabilities(spec.config_class.from_pretrained(path)).num_positions
            config = json.loads((path / "config.json").read_text())
            num_feature_layers = len(config.get("target_layer_ids") or [])
            reduced = config.get("draft_vocab_size") not in (None, config.get("target_vocab_size"))
            unread = bool(engine_unread_extensions(config))  # anchor fusion, output adapter: HF layout only
            for fmt in formats_for(kind, target_model_type, num_feature_layers, reduced_vocab=reduced,
                                   engine_unread=unread, num_positions=positions,
                                   layer_family=config.get("layer_family")):
                if fmt in self.left_out:
                    continue
                out = self.out / "export" / f"{kind}-{fmt}"
                card = ["--tau-table", str(eval_dir / "results.json")] if fmt == "hf" else []  # model card: HF only
                self.run(f"export-{kind}-{fmt}", [*self.deepspec, "export", "--checkpoint", str(path),
                                                  "--format", fmt, "--out", str(out), "--target", self.target, *card])
                exported[f"{kind}-{fmt}"] = out
        return exported


def default_capabilities(kind: str):
    """What a drafter of `kind` can do with its default config (its spec decides the stages' choices)."""
    from deepspec.drafters.spec import get_drafter_spec

    spec = get_drafter_spec(kind)
    return spec.capabilities(spec.config_class())


def training_prompts(target: str, num: int, max_prompt_tokens: int, out: Path) -> int:
    """The regeneration prompts: the first `num` bundled ShareGPT conversations whose first prompt (as `deepspec
    regenerate` renders it for `target`) fits in `max_prompt_tokens`, written to `out` as JSONL. A longer one would
    get no answer (finish reason prompt_too_long) and no training sample. Returns how many conversations were read
    (the held-out prompts come after them); the ones passed over are counted on the console."""
    from deepspec.data.regenerate import first_turn_prompt
    from deepspec.data.rendering import command_line_rendering
    from deepspec.data.sources import load_sharegpt_bundled
    from deepspec.targets.config import target_settings
    from deepspec.targets.load import load_tokenizer

    settings = target_settings(target)
    rendering = command_line_rendering("chat", None, settings.chat_template, settings.chat_template_kwargs)
    tokenizer = load_tokenizer(settings.name, settings.revision)
    rows, too_long, no_user, read, limit = [], 0, 0, 0, 2 * num
    while len(rows) < num:
        conversations, _ = load_sharegpt_bundled(limit=limit)
        for conv in conversations[read:]:
            read += 1
            messages = first_turn_prompt(conv)
            if messages is None:
                no_user += 1
            elif len(rendering.prompt_ids(tokenizer, messages)) > max_prompt_tokens:
                too_long += 1
            else:
                rows.append({"id": conv.id, "conversations": messages})
                if len(rows) == num:
                    break
        if len(conversations) < limit:
            break
        limit *= 2
    if len(rows) < num:
        raise ValueError(f"the bundled ShareGPT has {len(rows)} conversations whose first prompt fits in "
                         f"{max_prompt_tokens} tokens, not {num}")
    atomic_write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"[pipeline] prompts: the first {num} of {read} ShareGPT conversations whose first prompt fits in "
          f"{max_prompt_tokens} tokens ({too_long} longer, {no_user} without a user message passed over) -> {out}",
          flush=True)
    return read


def held_out_prompts(num_used: int, out: Path, num: int) -> Path:
    """First user turns of bundled ShareGPT conversations after the `num_used` that regeneration read."""
    from deepspec.data.sources import load_sharegpt_bundled

    conversations, _ = load_sharegpt_bundled(limit=num_used + 50 * num)
    rows = []
    for conv in conversations[num_used:]:
        first = next((m["content"] for m in conv.messages if m["role"] == "user"), "")
        if 20 <= len(first) <= 600:  # short enough for a CPU demo, long enough to be a real prompt
            rows.append({"id": conv.id, "turns": [first]})
        if len(rows) == num:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="the few-minute demo budget: the same as the override quickstart=quick")
    parser.add_argument("--out", type=Path, default=None,
                        help="run folder (default runs/quickstart, or runs/quickstart-NAME for quickstart=NAME, under "
                             "the current directory)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafters", nargs="+", default=["dspark"],
                        help="drafter kinds to train, evaluate and export (default: DSpark alone)")
    parser.add_argument("--compare", action="store_true",
                        help=f"train and compare {', '.join(COMPARED_DRAFTERS)} at an equal budget (the stages after "
                             "the cache run for each drafter)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16-target", action="store_true",
                        help="regenerate and cache with bf16 target weights on a CPU with bf16 units (faster; the "
                             "answers differ from fp32 ones); the same as quickstart.bf16_target=true")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra overrides of the budget (deepspec/conf/pipeline.yaml), e.g. quickstart=quick "
                             "quickstart.eval_prompts=12")
    return parser


def parse_job(argv: list[str] | None) -> tuple[argparse.Namespace, str, Budget]:
    """(the options, the chosen quickstart budget's name, the budget with the overrides applied)."""
    args = build_parser().parse_intermixed_args(argv)
    # --drafters takes every word after it: the overrides typed there are the budget's
    args.overrides += [word for word in args.drafters if "=" in word]
    args.drafters = [word for word in args.drafters if "=" not in word]
    name, budget = compose_budget([*(["quickstart=quick"] if args.quick else []),
                                   *(["quickstart.bf16_target=true"] if args.bf16_target else []), *args.overrides])
    return args, name, budget


def default_run_folder(budget_name: str, budget: Budget) -> Path:
    """runs/quickstart, with -NAME for quickstart=NAME and -EXPERIMENT for a training preset other than cpu."""
    suffix = "".join(f"-{part}" for part, default in ((budget_name, "default"), (budget.experiment, "cpu"))
                     if part != default)
    return Path("runs") / f"quickstart{suffix}"


def check_same_budget(out: Path, budget: Budget) -> None:
    """A run folder resumes only the budget it was started with: its finished stages would otherwise stand for
    another job (a field an older budget.json lacks counts as its default)."""
    recorded = out / "budget.json"
    if not recorded.is_file():
        return
    defaults = {f.name: f.default for f in fields(Budget) if f.default is not NO_DEFAULT}
    before = {**defaults, **json.loads(recorded.read_text())}
    changed = [f"{key}: {before.get(key)!r} -> {value!r}" for key, value in asdict(budget).items()
               if before.get(key) != value]
    if changed:
        raise ValueError(f"{recorded}: this run folder was started with another budget ({'; '.join(changed)}); "
                         "resume it with the same settings, or give another --out")


@command_line("deepspec pipeline")
def main(argv: list[str] | None = None) -> None:
    args, budget_name, budget = parse_job(argv)
    out = (args.out or default_run_folder(budget_name, budget)).resolve()
    check_same_budget(out, budget)
    pipe = Pipeline(out, budget, args.target, COMPARED_DRAFTERS if args.compare else args.drafters, args.seed)
    pipe.preflight()  # before anything is written: a job refused here leaves no run folder
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget.json").write_text(json.dumps(asdict(budget), indent=2) + "\n")
    t0 = time.perf_counter()
    data = pipe.regenerate()
    cache_dir = pipe.cache(data)
    drafters = pipe.train(cache_dir)
    floors = pipe.floors(drafters, cache_dir)
    pipe.calibrate(drafters, cache_dir)
    eval_dir = pipe.evaluate(drafters, cache_dir)
    exported = pipe.export(drafters, eval_dir)
    print("\n" + (eval_dir / "table.md").read_text())
    print(summarise_floors(floors))
    speed = json.loads((eval_dir / "bench_speed.json").read_text())
    print(summarise_speed(speed))
    print("\nexported drafters:")
    for name, path in exported.items():
        print(f"  {name:16s} {path}")
    total = time.perf_counter() - t0
    times_path = pipe.write_times(total_wall_s=total)
    print("\n" + summarise_times(pipe.times, total))
    print(f"\n[pipeline] finished in {total:.0f}s; outputs in {out} (stage times: {times_path.name})")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished (waited-for) subprocesses so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def read_marker(marker: Path) -> dict:
    """A finished stage's marker: its timing as JSON (older markers hold only "<wall>s")."""
    text = marker.read_text().strip()
    try:
        timing = json.loads(text)
    except json.JSONDecodeError:
        timing = None
    if isinstance(timing, dict):
        return timing
    try:
        return {"wall_s": float(text.removesuffix("s")), "cpu_s": None}
    except ValueError:
        return {"wall_s": None, "cpu_s": None}


def stage_times_record(times: dict[str, dict], total_wall_s: float | None = None) -> dict:
    """timings.json: every stage's wall and CPU seconds, with the machine and thread count they were measured on."""
    counted = [t for t in times.values() if not t.get("resumed")]
    return {"stages": times,
            "total_wall_s": None if total_wall_s is None else round(total_wall_s, 1),
            "total_cpu_s": round(sum(t["cpu_s"] or 0.0 for t in counted), 1),
            "threads": os.environ.get("OMP_NUM_THREADS") or f"torch default ({os.cpu_count()} CPUs)",
            "cpu": cpu_model(), "python": platform.python_version()}


def summarise_times(times: dict[str, dict], total_wall_s: float) -> str:
    """The per-stage time table; stages finished by an earlier run of the job are marked and left out of the sum."""
    def cell(value):
        return f"{value:9.1f}" if value is not None else f"{'-':>9s}"

    lines = ["stage times (wall: this run's seconds; CPU: user + system seconds of the stage's processes):",
             f"  {'stage':24s} {'wall s':>9s} {'CPU s':>9s}"]
    for name, t in times.items():
        lines.append(f"  {name:24s} {cell(t.get('wall_s'))} {cell(t.get('cpu_s'))}"
                     + ("  (an earlier run)" if t.get("resumed") else ""))
    counted = [t for t in times.values() if not t.get("resumed")]
    lines.append(f"  {'this run':24s} {cell(total_wall_s)} {cell(sum(t['cpu_s'] or 0.0 for t in counted))}")
    return "\n".join(lines)


def summarise_floors(floors: dict) -> str:
    lines = ["validation slot-0 agreement against the floors (bigram table from this cache's train split):"]
    for kind, row in floors.items():
        ablation = row.get("ablation") or {}
        lines.append(f"  {kind:8s} {100 * row['drafter_slot0']:.1f}% vs bigram {100 * row['bigram_slot0']:.1f}% "
                     f"({row['ratio_to_bigram']:.2f}x), prompt lookup {100 * row['prompt_lookup_slot0']:.1f}%; "
                     f"anchor randomised {100 * ablation.get('slot0_random_anchor', float('nan')):.1f}%, "
                     f"context shifted {100 * ablation.get('slot0_shifted_context', float('nan')):.1f}%")
    return "\n".join(lines)


def _num(value, spec: str) -> str:
    """A measured number, or "n/a" where the benchmark could not measure it (e.g. a baseline that failed)."""
    return "n/a" if value is None else format(value, spec)


def summarise_speed(speed: dict) -> str:
    """Per temperature one line of decoded tau: each drafter, prompt lookup in the same loop, and each drafter
    combined with prompt lookup (NAME+lookup, a calibrated drafter); then each run's speed."""
    drafters = speed.get("drafters", {})
    lines = ["decoded tau (batch 1, the same prompts; NAME+lookup: prompt lookup or the drafter, chosen per round):"]
    for temp, baselines in speed.get("baselines", {}).items():
        taus = [f"{name} {_num(per_temp[temp].get('tau'), '.2f')}" for name, per_temp in drafters.items()
                if temp in per_temp]
        lookup = baselines.get("prompt_lookup")
        if lookup:
            taus.append(f"prompt lookup {_num(lookup.get('tau'), '.2f')}")
        lines.append(f"  {temp}: " + (", ".join(taus) or "no runs"))
    lines.append("speed (batch 1, prefill excluded):")
    for temp, baselines in speed.get("baselines", {}).items():
        lookup = baselines.get("prompt_lookup")
        if lookup:
            lines.append(f"  {'prompt lookup':8s} {temp}: tau {_num(lookup.get('tau'), '.2f')}, "
                         f"{_num(lookup.get('tokens_per_s'), '.1f')} tok/s, "
                         f"speedup vs AR {_num(lookup.get('speedup_vs_ar'), '.2f')}x")
    for name, per_temp in drafters.items():
        for temp, row in per_temp.items():
            share = row.get("lookup_round_share")
            lines.append(f"  {name:8s} {temp}: tau {_num(row.get('tau'), '.2f')}, "
                         f"{_num(row.get('tokens_per_s'), '.1f')} tok/s, "
                         f"speedup vs AR {_num(row.get('speedup_vs_ar'), '.2f')}x, vs prompt lookup (above) "
                         f"{_num(row.get('speedup_vs_prompt_lookup'), '.2f')}x"
                         + (f", prompt lookup's drafts in {100 * share:.0f}% of rounds" if share is not None else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
