"""Training throughput benchmark: the same tiny DSpark run with 1 and 2 CPU processes (eval/bench_train.py).

Each run is a real `torchrun ... train.py` launch; throughput comes from its metrics.jsonl (median over
steps after the first, which includes warm-up), peak memory from polling the launched process tree
(sum of the processes' RSS). scaling_efficiency = 2-process tokens/s / (2 x 1-process tokens/s).
"""

from __future__ import annotations

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

REPO = Path(__file__).resolve().parents[2]


def build_bench_cache(cache_dir: Path, num_samples: int, max_length: int) -> list[str]:
    cmd = [sys.executable, str(REPO / "data_tools" / "cache_hiddens.py"), "target=smollm2-135m", "data.prompts=sharegpt",
           f"data.limit={num_samples}", "data.val_fraction=0.1", f"cache.max_length={max_length}",
           f"cache.out_dir={cache_dir}", "cache.progress=false"]
    if not (cache_dir / "meta.json").is_file():
        subprocess.run(cmd, check=True, cwd=REPO)
    return cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_and_watch(cmd: list[str], env: dict) -> float:
    """Run `cmd`; return the peak total RSS (MB) of its process tree."""
    stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a full pipe would block the run
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
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
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                   f"--master_port={_free_port()}", str(REPO / "train.py"), "target=smollm2-135m", "drafter=dspark",
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
            result["commands"].append(" ".join(cmd[:5] + ["train.py"] + cmd[6:-1]))
    if 1 in result["processes"] and 2 in result["processes"]:
        one, two = (result["tokens_per_s"][result["processes"].index(n)] for n in (1, 2))
        result["scaling_efficiency"] = round(two / (2 * one), 3)
    return result


def write_result(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
