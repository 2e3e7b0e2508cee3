"""Cost of training without a cache (`deepspec bench train --features`): offline vs online target features.

Three phases on the same data and training config, each in its own process (one CPU thread, so peak RSS and
CPU time are the phase's own):
- `cache`: `deepspec cache` of the conversations (default cache options, the batched build);
- `offline`: one epoch of training from that cache;
- `online`: the same epoch with `data.features=online` (the target runs inside each step: one forward per
  micro-batch, or per sample with the override `data.online_batch=sample`).
Per optimizer step the CPU seconds are the training loop's own (`train_cpu_s` of metrics.jsonl: data, target
forwards when online, drafter forward/backward, optimizer); the cache build's are the whole job's (target load
included). With the override `trainer.phase_times=true` each training phase also reports its mean CPU seconds per
step by phase (`phase_cpu_s_per_step`, the first step left out; online, `target` holds the target's forwards).
The verdict compares one online epoch with the cache build plus one offline epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _train_overrides(args, cache_dir: Path, run_dir: Path, steps: int) -> list[str]:
    # A random Markov start: the bigram start counts the target's argmax where a cache stores it and the data's
    # next tokens online, so only a random start trains the same drafter both ways.
    return [f"target={args.target}", "debug=benchmark", "drafter=dspark", "drafter.markov_init=random",
            f"data.cache_dir={cache_dir}", f"trainer.out_dir={run_dir}", f"trainer.max_steps={steps}",
            f"trainer.global_batch_size={args.global_batch}", f"trainer.micro_batch_size={args.micro_batch}",
            *args.overrides]


def _source_overrides(args, prefix: str) -> list[str]:
    """The conversations and cache options, for the cache job (prefix '') or a training run (prefix 'data.')."""
    data = "data." if not prefix else "data.source."
    cache = "cache." if not prefix else "data.cache."
    return [f"{data}prompts={args.prompts}", f"{data}limit={args.num_samples}", f"{data}val_fraction=0.1",
            f"{cache}max_length={args.max_length}"]


def _phase(args) -> dict:
    import torch

    torch.set_num_threads(1)
    work = Path(args.work_dir)
    cache_dir = work / "cache"
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if args.phase == "cache":
        from omegaconf import OmegaConf

        from deepspec.cache.config import compose_cache_config
        from deepspec.cache.format import read_meta
        from deepspec.cache.pipeline import run_cache_job

        cfg = compose_cache_config([f"target={args.target}", *_source_overrides(args, ""), f"cache.out_dir={cache_dir}",
                                    "cache.progress=false"])
        cache_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        run_cache_job(OmegaConf.to_container(cache_cfg, resolve=True))
        meta = read_meta(cache_dir)
        return {"cpu_s": round(time.process_time() - cpu0, 2), "wall_s": round(time.perf_counter() - wall0, 2),
                "peak_rss_mb": round(_rss_mb(), 1), "samples": meta.counts["samples"], "tokens": meta.counts["tokens"],
                "train_samples": meta.counts["per_split"]["train"]["samples"],
                "bytes_on_disk": meta.counts["bytes_on_disk"], "bytes_per_token": meta.bytes_per_token}
    from deepspec.training import run
    from deepspec.training.config import compose_train_config
    from deepspec.training.log import read_metrics

    run_dir = work / f"run-{args.phase}"
    extra = [] if args.phase == "offline" else ["data.features=online", *_source_overrides(args, "data.")]
    run(compose_train_config([*_train_overrides(args, cache_dir, run_dir, args.steps), *extra]))
    records = read_metrics(run_dir, "train")
    cumulative = [r["train_cpu_s"] for r in records]
    per_step = [b - a for a, b in zip([0.0, *cumulative], cumulative)]
    phases = {}
    if records and "phase_cpu_s" in records[-1]:  # trainer.phase_times=true: where a step goes (first step left out)
        measured = records[1:] or records
        names = list(dict.fromkeys(name for r in measured for name in r["phase_cpu_s"]))
        phases = {"phase_cpu_s_per_step": {name: round(statistics.fmean(r["phase_cpu_s"].get(name, 0.0)
                                                                            for r in measured), 3) for name in names}}
    return {**phases, "steps": len(records), "epoch_cpu_s": round(cumulative[-1], 2),
            "cpu_s_per_step": round(cumulative[-1] / len(records), 3),
            "cpu_s_per_step_median_after_first": round(statistics.median(per_step[1:] or per_step), 3),
            "process_cpu_s": round(time.process_time() - cpu0, 2), "wall_s": round(time.perf_counter() - wall0, 2),
            "peak_rss_mb": round(_rss_mb(), 1), "final_loss": records[-1]["loss"]}


def _run_phase(args, phase: str, steps: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "deepspec.benchmarks.train_features", "--phase", phase,
           "--work-dir", str(args.work_dir), "--target", args.target, "--prompts", args.prompts,
           "--num-samples", str(args.num_samples),
           "--max-length", str(args.max_length), "--global-batch", str(args.global_batch),
           "--micro-batch", str(args.micro_batch), "--steps", str(steps or 0), *args.overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="CPU cost of offline vs online target features: cache "
                                     "build + one offline epoch vs one online epoch (one thread); prints one JSON "
                                     "object (also written to --out).")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--prompts", default="sharegpt", help="conversations (data.prompts / data.source.prompts)")
    parser.add_argument("--num-samples", type=int, default=24)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_features.json"))
    parser.add_argument("--features", action="store_true", help="accepted and ignored (`deepspec bench train "
                        "--features` routes here)")
    parser.add_argument("--phase", choices=("cache", "offline", "online"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", default=["drafter.num_draft_layers=2", "data.max_anchors_per_seq=32"],
                        help="extra training overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.phase is not None:  # a child process: one phase
        print(json.dumps(_phase(args)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_features_") as tmp:
        args.work_dir = (args.work_dir or Path(tmp)).resolve()
        cache = _run_phase(args, "cache")
        steps = cache["train_samples"] // args.global_batch  # one epoch (the last partial batch is dropped)
        offline = _run_phase(args, "offline", steps)
        online = _run_phase(args, "online", steps)
    offline_total = cache["cpu_s"] + offline["epoch_cpu_s"]
    result = {"target": args.target, "prompts": args.prompts, "num_samples": args.num_samples,
              "max_length": args.max_length, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
              "threads": 1, "overrides": args.overrides, "cache_build": cache, "offline": offline, "online": online,
              "cpu_s_per_step": {"offline": offline["cpu_s_per_step"], "online": online["cpu_s_per_step"]},
              "online_over_offline_step_ratio": round(online["cpu_s_per_step"] / offline["cpu_s_per_step"], 3),
              "epoch_cpu_s": {"cache_build_plus_offline": round(offline_total, 2), "online": online["epoch_cpu_s"]},
              "online_over_cache_plus_offline": round(online["epoch_cpu_s"] / offline_total, 3),
              "peak_rss_mb": {"cache_build": cache["peak_rss_mb"], "offline": offline["peak_rss_mb"],
                              "online": online["peak_rss_mb"]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
