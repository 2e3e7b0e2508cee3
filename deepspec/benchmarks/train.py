"""What the trainer costs on top of the model and its loss (`deepspec bench train`): CPU-seconds per optimizer step,
and where in the step they go.

For one configuration (default: DSpark, 2 random draft layers, block 7, full vocabulary, 4 sequences x 16 anchors per
step, global batch = micro batch = 4, one thread per process):
- `bare`: the model + loss loop and nothing else (nanoGPT's loop): the session's own batches in the trainer's order,
  drafter and objective (`loss.checkpoint=never`, the configuration's `trainer.autocast`), `loss.backward()`,
  `clip_grad_norm_`, `torch.optim.AdamW` with its defaults, the warmup+cosine schedule; it runs with the trainer's
  process settings (one thread; `trainer.reuse_cpu_memory`'s heap, deepspec/utils/heap.py), so the ratio is the
  framework's cost alone;
- `trainer`: the real trainer, `deepspec train` as a user runs it (DeepSpeed engine, guards, logging), default
  settings; and each mode in `--modes` (`checkpoint-always`: the loss recomputed in backward; `zero2`: DeepSpeed
  ZeRO-2 even for one process; `autocast-bf16`: bf16 autocast of the drafter's matmuls; `no-memory-reuse`: freed
  memory handed back to the kernel, as before `trainer.reuse_cpu_memory`).
Each mode runs `--repeats` times, each time in its own process beside a bare-loop process started with it (the bare
loop's first step waits for the trainer's first logged step), so whatever else loads the machine loads both alike;
modes and repeats are interleaved. Every step is timed per phase (`deepspec.utils.phases`: data, target, forward,
loss, backward, optimizer, guards, logging, other; the trainer logs them with `trainer.phase_times=true`), in the
process's own CPU seconds (user + system, so other jobs on the machine count little), with the system share and
the page faults beside them. `step_cpu_s` is the median over repeats of each run's median step after `--warmup`;
`phase_cpu_s` the median over repeats of each run's mean per phase (means add up to a run's mean step);
`overhead_ratio` = the median over repeats of trainer / its bare loop, `ratio_spread` how far the repeats' ratios
lie apart ((max - min) / median); `timer_cpu_s` what timing the phases cost per step. Peak RSS is polled from each
process. `--features` hands over to the online-features benchmark (deepspec/benchmarks/train_features.py),
`--scaling` runs the 1- vs 2-process throughput comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from deepspec.training.log import METRICS_FILE, read_metrics
from deepspec.utils.errors import UsageError, command_line
from deepspec.utils.heap import keep_freed_memory
from deepspec.utils.io import emit_report
from deepspec.utils.machine import cpu_model
from deepspec.utils.phases import STEP_PHASES, PhaseTimer, phase, span_cost_s

DEFAULT_OVERRIDES = ["experiment=bench-train", "drafter=dspark"]  # deepspec/conf/experiment/bench-train.yaml
MODES = {  # mode -> extra `deepspec train` overrides over the configuration
    "trainer": [],
    "checkpoint-always": ["loss.checkpoint=always"],
    "zero2": ["deepspeed.single_process_engine=false"],
    "autocast-bf16": ["trainer.autocast=bf16"],
    "no-memory-reuse": ["trainer.reuse_cpu_memory=false"],
}


def build_bench_cache(cache_dir: Path, num_samples: int, max_length: int) -> list[str]:
    cmd = [sys.executable, "-m", "deepspec.cli", "cache", "target=smollm2-135m", "data.prompts=sharegpt",
           f"data.limit={num_samples}", "data.val_fraction=0.1", f"cache.max_length={max_length}",
           f"cache.out_dir={cache_dir}", "cache.progress=false"]
    if not (cache_dir / "meta.json").is_file():
        subprocess.run(cmd, check=True)
    return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bench_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    return env


class _Process:
    """A benchmark subprocess with its output in files (not pipes: a full pipe would block it) and its peak RSS."""

    def __init__(self, cmd: list[str], env: dict):
        self.cmd = cmd
        self.stdout, self.stderr = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.stdout, stderr=self.stderr, text=True)
        self.root, self.peak = psutil.Process(self.proc.pid), 0

    def poll_rss(self) -> None:
        try:
            tree = [self.root, *self.root.children(recursive=True)]
            self.peak = max(self.peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass

    def finish(self) -> tuple[float, str]:
        """(peak total RSS of its process tree in MB, its stdout); raises if it failed."""
        self.stdout.seek(0)
        self.stderr.seek(0)
        out, log = self.stdout.read(), self.stderr.read()
        self.stdout.close()
        self.stderr.close()
        if self.proc.returncode != 0:
            raise RuntimeError(f"{' '.join(self.cmd)} failed:\n{log[-3000:]}")
        return self.peak / 2**20, out


def _watch(processes: list[_Process], on_poll=None) -> None:
    """Poll every process's RSS (and `on_poll()`) until all have exited."""
    while any(p.proc.poll() is None for p in processes):
        for p in processes:
            if p.proc.poll() is None:
                p.poll_rss()
        if on_poll is not None:
            on_poll()
        time.sleep(0.2)


def _run_and_watch(cmd: list[str], env: dict) -> tuple[float, str]:
    """Run `cmd`; return (peak total RSS of its process tree in MB, its stdout)."""
    process = _Process(cmd, env)
    _watch([process])
    return process.finish()


def run_overrides(cache_dir: Path, steps: int, batch: int, overrides: list[str], out_dir: Path) -> list[str]:
    """One measured run of the configuration `overrides`: a benchmark's run (debug=benchmark) of `steps` steps."""
    return [*overrides, "debug=benchmark", f"data.cache_dir={cache_dir}", f"trainer.max_steps={steps}",
            f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}", f"trainer.out_dir={out_dir}"]


def bare_loop(overrides: list[str], steps: int, start_file: Path | None = None, start_timeout_s: float = 3600) -> dict:
    """The bare model + loss loop (module docstring) in this process: each step's CPU seconds per phase (the trainer's
    phases, `deepspec.utils.phases`), the same batches in the same order as the trainer's steps. With `start_file`,
    the first step waits (once everything is built) until that file exists."""
    import torch

    from deepspec.training.config import compose_train_config, plan_training, resolve_config
    from deepspec.training.engine import WarmupCosine, resolve_autocast
    from deepspec.training.session import TrainingModule, build_data_and_drafter

    torch.set_num_threads(1)
    cfg = resolve_config(compose_train_config([*overrides, "loss.checkpoint=never"]))
    plan = plan_training(cfg, world_size=1)
    device = torch.device("cpu")
    if cfg.trainer.reuse_cpu_memory:  # the trainer's process setting (deepspec/utils/heap.py), not a loop's
        keep_freed_memory()
    data, _, drafter = build_data_and_drafter(cfg, plan, device)
    module = TrainingModule(drafter, cfg.loss, resolve_autocast(cfg, device, "fp32")).train()  # trainer.autocast
    params = [p for p in module.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(steps, o.warmup_fraction, o.min_lr_ratio))
    step_phases, order, order_epoch = [], None, None
    deadline = time.monotonic() + start_timeout_s
    while start_file is not None and not start_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{start_file} did not appear within {start_timeout_s:.0f} s")
        time.sleep(0.05)
    with PhaseTimer() as timer:
        for step in range(steps):
            epoch = step // data.steps_per_epoch
            if order_epoch != epoch:
                with phase("data"):
                    order, order_epoch = data.epoch_order(epoch), epoch
            with phase("data"):
                batch = data.collate(data.micro_batch_ids(order, step % data.steps_per_epoch, 0, 0, 1), epoch)
            with phase("target"):
                batch = batch.to(device, torch.float32)
            with phase("loss"):
                loss, _ = module(batch)
            with phase("backward"):
                loss.backward()
            with phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
            with phase("guards"):
                float(loss.detach())
            step_phases.append(timer.take())
    return {"steps": step_phases}


def _step_totals(records: list[dict]) -> list[float]:
    return [sum(r["phase_cpu_s"].values()) for r in records]


def _median(values) -> float:
    return round(statistics.median(values), 4) if values else float("nan")


def _spread(values) -> float:
    """(max - min) / median: how far apart the repeats are."""
    return round((max(values) - min(values)) / statistics.median(values), 4) if values else float("nan")


def summarize_mode(runs: list[list[dict]], warmup: int, span_cost_s: float) -> dict:
    """One mode's repeats (each a list of per-step records with `phase_cpu_s`) -> its medians and spreads.

    `step_cpu_s`: the median over repeats of each repeat's median step (steps after `warmup`); `phase_cpu_s`: per
    phase, the median over repeats of each repeat's mean (means add up: the phases of one repeat sum to its mean
    step); `timer_cpu_s`: what timing the phases cost per step (spans x the cost of one, measured in the bench)."""
    medians, phase_means, spans, kernel = [], [], [], []
    for records in runs:
        measured = records[warmup:] or records
        medians.append(statistics.median(_step_totals(measured)))
        names = {name for r in measured for name in r["phase_cpu_s"]}
        phase_means.append({name: statistics.fmean(r["phase_cpu_s"].get(name, 0.0) for r in measured)
                            for name in names})
        spans.append(statistics.fmean(r.get("phase_spans", 0) for r in measured))
        kernel.append({key: statistics.fmean(r[key] for r in measured) for key in ("user_s", "sys_s", "minor_faults")})
    order = {name: k for k, name in enumerate(STEP_PHASES)}
    names = sorted({name for means in phase_means for name in means}, key=lambda n: (order.get(n, len(order)), n))
    return {"step_cpu_s": _median(medians), "step_cpu_s_by_repeat": [round(m, 4) for m in medians],
            "spread": _spread(medians),
            "phase_cpu_s": {name: _median([means.get(name, 0.0) for means in phase_means]) for name in names},
            "timer_cpu_s": round(statistics.median(spans) * span_cost_s, 6),
            **{key: _median([k[key] for k in kernel]) for key in ("user_s", "sys_s", "minor_faults")},
            "step_cpu_s_all": [[round(x, 4) for x in _step_totals(records)] for records in runs]}


def run_pair(mode: str, cache_dir: Path, steps: int, batch: int, overrides: list[str], env: dict) -> dict:
    """`mode`'s trainer and a bare loop, at once, one process each; the bare loop steps once the trainer logged its
    first step. Returns each one's per-step records, peak RSS (MB) and the trainer's command line."""
    with tempfile.TemporaryDirectory(prefix=f"bench_train_{mode}_") as tmp:
        run_dir, start_file = Path(tmp) / "run", Path(tmp) / "start"
        args = run_overrides(cache_dir, steps, batch, [*overrides, *MODES[mode]], run_dir)
        trainer = _Process([sys.executable, "-m", "deepspec.cli", "train", *args, "trainer.phase_times=true"], env)
        bare = _Process([sys.executable, "-m", "deepspec.benchmarks.train", "--bare-worker", "--steps", str(steps),
                         "--start-file", str(start_file),
                         *run_overrides(cache_dir, steps, batch, overrides, Path(tmp) / "bare")], env)

        def release_bare_loop():
            if trainer.proc.poll() not in (None, 0) and bare.proc.poll() is None:
                bare.proc.kill()  # the trainer failed: its error is what to report
            metrics = run_dir / METRICS_FILE
            if not start_file.exists() and (trainer.proc.poll() is not None or
                                            (metrics.is_file() and metrics.stat().st_size > 0)):
                start_file.touch()

        _watch([trainer, bare], release_bare_loop)
        trainer_peak, _ = trainer.finish()
        bare_peak, bare_out = bare.finish()
        bare_steps = json.loads(bare_out.strip().splitlines()[-1])["steps"]
        return {"trainer": read_metrics(run_dir, "train"), "bare": bare_steps,
                "trainer_peak_mb": trainer_peak, "bare_peak_mb": bare_peak,
                "command": " ".join(["deepspec", "train", *args[:-1]])}


def bench_modes(cache_dir: Path, modes: list[str], steps: int, warmup: int, batch: int, overrides: list[str],
                repeats: int = 3) -> dict:
    """Each mode `repeats` times beside its own bare loop (`run_pair`), interleaved: mode 1, mode 2, ..., mode 1, ..."""
    env = _bench_env()
    span_cost = span_cost_s()
    result: dict = {"config": {"overrides": overrides, "steps": steps, "warmup": warmup, "batch": batch,
                               "repeats": repeats, "cache": str(cache_dir), "threads_per_process": 1},
                    "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
                    "timer_span_cpu_s": round(span_cost, 9), "modes": {}}
    pairs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            pairs[mode].append(run_pair(mode, cache_dir, steps, batch, overrides, env))
    bare_runs = [pair["bare"] for mode in modes for pair in pairs[mode]]
    result["modes"]["bare"] = {**summarize_mode(bare_runs, warmup, span_cost), "command": "bare loop",
                               "peak_rss_mb": round(max(p["bare_peak_mb"] for m in modes for p in pairs[m]), 1)}
    ratios = {}
    for mode in modes:
        summary = summarize_mode([pair["trainer"] for pair in pairs[mode]], warmup, span_cost)
        bare = summarize_mode([pair["bare"] for pair in pairs[mode]], warmup, span_cost)
        ratios[mode] = [round(m / b, 4) for m, b in zip(summary["step_cpu_s_by_repeat"], bare["step_cpu_s_by_repeat"])]
        result["modes"][mode] = {**summary, "peak_rss_mb": round(max(p["trainer_peak_mb"] for p in pairs[mode]), 1),
                                 "command": pairs[mode][0]["command"], "bare_beside_it": bare}
    result["step_cpu_s"] = {mode: r["step_cpu_s"] for mode, r in result["modes"].items()}
    result["ratio_to_bare"] = {mode: _median(values) for mode, values in ratios.items()}
    result["ratio_to_bare_by_repeat"] = ratios
    result["ratio_spread"] = {mode: _spread(values) for mode, values in ratios.items()}
    if "trainer" in modes:
        result["overhead_ratio"] = result["ratio_to_bare"]["trainer"]
        bare = result["modes"]["trainer"]["bare_beside_it"]["phase_cpu_s"]
        result["overhead_phase_cpu_s"] = {  # where the trainer's extra CPU time per step is (negative: saved)
            name: round(value - bare.get(name, 0.0), 4)
            for name, value in result["modes"]["trainer"]["phase_cpu_s"].items()}
    return result


def bench_scaling(cache_dir: Path, processes: list[int], steps: int, global_batch: int, micro_batch: int,
                  overrides: list[str]) -> dict:
    """Tokens/s of the same run with 1 and 2 CPU processes (torchrun); scaling_efficiency = 2-process tokens/s /
    (2 x 1-process tokens/s)."""
    env = _bench_env()
    result = {"processes": [], "tokens_per_s": [], "step_ms": [], "peak_rss_mb": []}
    for nproc in processes:
        with tempfile.TemporaryDirectory(prefix="bench_train_") as run_dir:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                        f"--master_port={_free_port()}", "-m", "deepspec.cli", "train"]
            args = run_overrides(cache_dir, steps, global_batch, overrides, Path(run_dir) / "run")
            args.append(f"trainer.micro_batch_size={micro_batch}")
            peak_mb, _ = _run_and_watch([*launcher, *args], env)
            records = read_metrics(Path(run_dir) / "run", "train")[1:]  # step 1 includes warm-up
            result["processes"].append(nproc)
            for key in ("tokens_per_s", "step_ms"):
                result[key].append(round(statistics.median(r[key] for r in records), 2))
            result["peak_rss_mb"].append(round(peak_mb, 1))
    if 1 in result["processes"] and 2 in result["processes"]:
        one, two = (result["tokens_per_s"][result["processes"].index(n)] for n in (1, 2))
        result["scaling_efficiency"] = round(two / (2 * one), 3)
    return result


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="CPU-seconds per optimizer step of the bare model+loss "
                                     "loop and of the real trainer in each mode; prints one JSON object (also "
                                     "written to --out). --features: online vs offline features.")
    parser.add_argument("--cache", type=Path, default=Path("outputs/cache/smollm2-135m-bench"))
    parser.add_argument("--num-samples", type=int, default=48, help="ShareGPT conversations cached if --cache is empty")
    parser.add_argument("--max-length", type=int, default=448)
    parser.add_argument("--modes", nargs="*", default=["trainer"],
                        help=f"trainer modes, each measured beside a bare loop: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every mode (each beside a bare loop)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch", type=int, default=4, help="sequences per optimizer step (one micro batch)")
    parser.add_argument("--scaling", action="store_true", help="1- vs 2-process throughput instead of the modes")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_train.json"))
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)  # one bare-loop process
    parser.add_argument("--start-file", type=Path, default=None, help=argparse.SUPPRESS)  # the bare loop's start signal
    parser.add_argument("overrides", nargs="*", default=DEFAULT_OVERRIDES,
                        help="the configuration (`deepspec train` overrides); default: " + " ".join(DEFAULT_OVERRIDES))
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, checked; overrides typed after `--modes` (which takes every word) are the configuration."""
    args = build_parser().parse_args(argv)
    swallowed = [item for item in args.modes if "=" in item]
    if swallowed:
        given = [] if args.overrides is DEFAULT_OVERRIDES else args.overrides
        args.modes, args.overrides = [m for m in args.modes if "=" not in m], [*given, *swallowed]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise UsageError(f"unknown --modes {sorted(unknown)}; choose from {sorted(MODES)}")
    if args.repeats < 1 or args.steps <= args.warmup or args.warmup < 0:
        raise UsageError(f"--repeats {args.repeats} must be >= 1 and --steps {args.steps} > --warmup "
                         f"{args.warmup} >= 0")
    return args


@command_line("deepspec bench train")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--features" in argv:
        from deepspec.benchmarks import train_features

        return train_features.main([a for a in argv if a != "--features"]) or 0
    args = parse_args(argv)
    if args.bare_worker:
        print(json.dumps(bare_loop(args.overrides, args.steps, args.start_file)))
        return 0
    cache_cmd = build_bench_cache(args.cache.resolve(), args.num_samples, args.max_length)
    if args.scaling:
        result = bench_scaling(args.cache.resolve(), [1, 2], args.steps, args.batch, max(args.batch // 2, 1),
                               args.overrides)
    else:
        result = bench_modes(args.cache.resolve(), list(args.modes), args.steps, args.warmup, args.batch,
                             args.overrides, args.repeats)
    result["cache_command"] = " ".join(cache_cmd)
    emit_report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
