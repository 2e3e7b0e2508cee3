"""What the trainer costs on top of the model and its loss (`deepspec bench train`): CPU-seconds per optimizer step.

Side by side in one run, for one configuration (default: DSpark, 2 random draft layers, block 7, full vocabulary,
4 sequences x 16 anchors per step, global batch = micro batch = 4, one thread per process):
- `bare`: the model + loss loop and nothing else (nanoGPT's loop): the session's own batches, drafter and objective
  (`loss.checkpoint=never`), `loss.backward()`, `clip_grad_norm_`, `torch.optim.AdamW`, the warmup+cosine schedule;
- `trainer`: the real trainer, `deepspec train` as a user runs it (DeepSpeed engine, logging, guards), default
  settings; and each mode in `--modes` (`checkpoint-always`: the loss recomputed in backward, the former default;
  `zero2`: DeepSpeed ZeRO-2 even for one process; `autocast-bf16`: bf16 autocast of the drafter's matmuls).
Every mode runs in its own process, one after another, each `--steps` optimizer steps; `step_cpu_s` is the median
CPU time of the steps after `--warmup` (the process's own CPU time, so other jobs on the machine count little).
`overhead_ratio` = trainer (default settings) / bare. Peak RSS is polled from each process.
`--features` hands over to the online-features benchmark (deepspec/benchmarks/train_features.py), `--scaling` runs
the 1- vs 2-process throughput comparison of earlier versions.
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

from deepspec.training.log import read_metrics
from deepspec.utils.errors import command_line
from deepspec.utils.machine import cpu_model

DEFAULT_OVERRIDES = ["target=smollm2-135m", "drafter=dspark", "drafter.num_draft_layers=2",
                     "drafter.init_from_target=false", "drafter.draft_vocab_size=null", "data.max_anchors_per_seq=16"]
MODES = {  # mode -> extra `deepspec train` overrides over the configuration
    "trainer": [],
    "checkpoint-always": ["loss.checkpoint=always"],
    "zero2": ["deepspeed.single_process_engine=false"],
    "autocast-bf16": ["trainer.autocast=bf16"],
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


def _run_and_watch(cmd: list[str], env: dict) -> tuple[float, str]:
    """Run `cmd`; return (peak total RSS of its process tree in MB, its stdout)."""
    stderr = tempfile.TemporaryFile(mode="w+")  # files, not pipes: a full pipe would block the run
    stdout = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.2)
    stderr.seek(0)
    stdout.seek(0)
    log, out = stderr.read(), stdout.read()
    stderr.close()
    stdout.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log[-3000:]}")
    return peak / 2**20, out


def run_overrides(cache_dir: Path, steps: int, batch: int, overrides: list[str], out_dir: Path) -> list[str]:
    return [*overrides, f"data.cache_dir={cache_dir}", f"trainer.max_steps={steps}", "trainer.epochs=100000",
            f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}", "trainer.log_every=1",
            "trainer.val_every=100000", "trainer.save_every=100000", "trainer.progress_bar=false",
            "trainer.resume=false", "trainer.decode_eval_prompts=0", "calibration.enabled=false", "logger=jsonl",
            f"trainer.out_dir={out_dir}"]


def bare_loop(overrides: list[str], steps: int) -> list[float]:
    """CPU seconds of each step of the bare model + loss loop (module docstring), in this process."""
    import torch

    from deepspec.training.config import compose_train_config, plan_training, resolve_config
    from deepspec.training.engine import WarmupCosine
    from deepspec.training.session import TrainingModule, build_data_and_drafter

    torch.set_num_threads(1)
    cfg = resolve_config(compose_train_config([*overrides, "loss.checkpoint=never"]))
    plan = plan_training(cfg, world_size=1)
    data, _, drafter = build_data_and_drafter(cfg, plan, torch.device("cpu"))
    module = TrainingModule(drafter, cfg.loss).train()
    params = [p for p in module.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(steps, o.warmup_fraction, o.min_lr_ratio))
    order = data.epoch_order(0)
    step_cpu = []
    for step in range(steps):
        cpu0 = time.process_time()
        batch = data.collate(data.micro_batch_ids(order, step % data.steps_per_epoch, 0, 0, 1), step // data.steps_per_epoch)
        loss, _ = module(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach())
        step_cpu.append(time.process_time() - cpu0)
    return step_cpu


def _summary(step_cpu: list[float], warmup: int) -> dict:
    measured = step_cpu[warmup:] or step_cpu
    return {"step_cpu_s": round(statistics.median(measured), 4), "step_cpu_s_all": [round(x, 4) for x in step_cpu]}


def bench_modes(cache_dir: Path, modes: list[str], steps: int, warmup: int, batch: int, overrides: list[str]) -> dict:
    env = _bench_env()
    result: dict = {"config": {"overrides": overrides, "steps": steps, "warmup": warmup, "batch": batch,
                               "cache": str(cache_dir), "threads_per_process": 1},
                    "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
                    "modes": {}}
    for mode in ["bare", *modes]:
        with tempfile.TemporaryDirectory(prefix=f"bench_train_{mode}_") as run_dir:
            args = run_overrides(cache_dir, steps, batch, [*overrides, *MODES.get(mode, [])], Path(run_dir) / "run")
            if mode == "bare":
                cmd = [sys.executable, "-m", "deepspec.benchmarks.train", "--bare-worker", "--steps", str(steps), *args]
                peak_mb, out = _run_and_watch(cmd, env)
                step_cpu = json.loads(out.strip().splitlines()[-1])["step_cpu_s"]
            else:
                cmd = [sys.executable, "-m", "deepspec.cli", "train", *args]
                peak_mb, _ = _run_and_watch(cmd, env)
                step_cpu = [r["step_cpu_s"] for r in read_metrics(Path(run_dir) / "run", "train")]
        result["modes"][mode] = {**_summary(step_cpu, warmup), "peak_rss_mb": round(peak_mb, 1),
                                 "command": " ".join(["deepspec", "train", *args[:-1]]) if mode != "bare" else "bare loop"}
    bare = result["modes"]["bare"]["step_cpu_s"]
    result["step_cpu_s"] = {mode: r["step_cpu_s"] for mode, r in result["modes"].items()}
    if "trainer" in result["modes"]:
        result["overhead_ratio"] = round(result["modes"]["trainer"]["step_cpu_s"] / bare, 3)
    result["ratio_to_bare"] = {mode: round(r["step_cpu_s"] / bare, 3) for mode, r in result["modes"].items()}
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


def write_result(result: dict, out: Path) -> None:
    from deepspec.utils.io import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="CPU-seconds per optimizer step of the bare model+loss "
                                     "loop and of the real trainer in each mode; prints one JSON object (also "
                                     "written to --out). --features: online vs offline features.")
    parser.add_argument("--cache", type=Path, default=Path("outputs/cache/smollm2-135m-bench"))
    parser.add_argument("--num-samples", type=int, default=48, help="ShareGPT conversations cached if --cache is empty")
    parser.add_argument("--max-length", type=int, default=448)
    parser.add_argument("--modes", nargs="*", default=["trainer", "checkpoint-always", "zero2"],
                        help=f"trainer modes besides the bare loop: {', '.join(MODES)}")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--batch", type=int, default=4, help="sequences per optimizer step (one micro batch)")
    parser.add_argument("--scaling", action="store_true", help="1- vs 2-process throughput instead of the modes")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_train.json"))
    parser.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)  # one bare-loop process
    parser.add_argument("overrides", nargs="*", default=DEFAULT_OVERRIDES,
                        help="the configuration (`deepspec train` overrides); default: " + " ".join(DEFAULT_OVERRIDES))
    return parser


@command_line("deepspec bench train")
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--features" in argv:
        from deepspec.benchmarks import train_features

        return train_features.main([a for a in argv if a != "--features"]) or 0
    args = build_parser().parse_args(argv)
    if args.bare_worker:
        print(json.dumps({"step_cpu_s": bare_loop(args.overrides, args.steps)}))
        return 0
    unknown = set(args.modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown --modes {sorted(unknown)}; choose from {sorted(MODES)}")
    cache_cmd = build_bench_cache(args.cache.resolve(), args.num_samples, args.max_length)
    if args.scaling:
        result = bench_scaling(args.cache.resolve(), [1, 2], args.steps, args.batch, max(args.batch // 2, 1),
                               args.overrides)
    else:
        result = bench_modes(args.cache.resolve(), list(args.modes), args.steps, args.warmup, args.batch,
                             args.overrides)
    result["cache_command"] = " ".join(cache_cmd)
    write_result(result, args.out)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
