"""Training throughput benchmark: the same tiny DSpark run with 1 and 2 CPU processes (`deepspec bench train`).

Each run is a real `torchrun -m deepspec.cli train ...` launch (the same as `torchrun train.py ...`); throughput comes from its metrics.jsonl (median over
steps after the first, which includes warm-up), peak memory from polling the launched process tree
(sum of the processes' RSS). scaling_efficiency = 2-process tokens/s / (2 x 1-process tokens/s).
"""

from __future__ import annotations

import argparse
import json
import os
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


def _run_and_watch(cmd: list[str], env: dict) -> float:
    """Run `cmd`; return the peak total RSS (MB) of its process tree."""
    stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the run
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.2)
    stderr.seek(0)
    log = stderr.read()
    stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log[-3000:]}")
    return peak / 2**20


def bench_train(cache_dir: Path, processes: list[int], steps: int, global_batch: int, micro_batch: int,
                overrides: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    result = {"drafter": "dspark", "target": "smollm2-135m", "processes": [], "tokens_per_s": [], "anchors_per_s": [],
              "step_ms": [], "peak_rss_mb": [], "commands": []}
    for nproc in processes:
        with tempfile.TemporaryDirectory(prefix="bench_train_") as run_dir:
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                        f"--master_port={_free_port()}", "-m", "deepspec.cli", "train"]
            cmd = [*launcher, "target=smollm2-135m", "drafter=dspark",
                   f"data.cache_dir={cache_dir}", f"trainer.max_steps={steps}", f"trainer.global_batch_size={global_batch}",
                   f"trainer.micro_batch_size={micro_batch}", "trainer.log_every=1", "trainer.val_every=100000",
                   "trainer.save_every=100000", "trainer.progress_bar=false", "trainer.resume=false", "logger=jsonl",
                   *overrides, f"hydra.run.dir={run_dir}"]
            peak_mb = _run_and_watch(cmd, env)
            records = read_metrics(run_dir, "train")[1:]  # step 1 includes warm-up
            result["processes"].append(nproc)
            for key in ("tokens_per_s", "anchors_per_s", "step_ms"):
                result[key].append(round(statistics.median(r[key] for r in records), 2))
            result["peak_rss_mb"].append(round(peak_mb, 1))
            result["commands"].append(" ".join(cmd[2:4] + ["-m", "deepspec.cli", "train"] + cmd[len(launcher):-1]))
    if 1 in result["processes"] and 2 in result["processes"]:
        one, two = (result["tokens_per_s"][result["processes"].index(n)] for n in (1, 2))
        result["scaling_efficiency"] = round(two / (2 * one), 3)
    return result


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Benchmark drafter training throughput with 1 and 2 CPU "
                                     "processes; prints one JSON object (also written to --out).")
    parser.add_argument("--cache", type=Path, default=Path("outputs/cache/smollm2-135m-bench"))
    parser.add_argument("--num-samples", type=int, default=48, help="ShareGPT conversations cached if --cache is empty")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_train.json"))
    parser.add_argument("overrides", nargs="*", default=["drafter.num_draft_layers=2", "data.max_anchors_per_seq=32"],
                        help="extra training overrides")
    return parser


@command_line("deepspec bench train")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cache_cmd = build_bench_cache(args.cache.resolve(), args.num_samples, args.max_length)
    result = bench_train(args.cache.resolve(), args.processes, args.steps, args.global_batch, args.micro_batch,
                         args.overrides)
    result["cache_command"] = " ".join(cache_cmd)
    write_result(result, args.out)
    print(json.dumps(result))
    return 0
