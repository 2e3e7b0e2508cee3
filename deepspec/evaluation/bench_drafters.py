"""Benchmark one training step of each drafter kind at the embedded target's shapes; print one JSON object.

Shapes: the embedded SmolLM2-135M target (hidden 576, 30 layers, vocab 49,152; its real frozen
embedding/LM head). Features and final hidden states are *random* (shapes are what matter for
speed/memory), one sequence of `--seq-len` tokens, every token supervised, batched by each kind's own
batcher (its spec): block drafters block 7 with `--anchors` anchors per sequence, chain drafters one packed
sequence row over the same tokens.
Per kind: trainable/frozen params, forward+backward `step_ms` (median of `--repeats` after one
warm-up) and `peak_mem_mb` (CPU: growth of the peak RSS in a fresh subprocess; CUDA: max allocated).
The TV/CE loss alone: chunked vs naive peak memory at N = 7 * anchors rows (deepspec.losses.memory).

    deepspec bench drafters --out outputs/bench_drafters.json   (or python eval/bench_drafters.py ...)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from deepspec.drafters.spec import drafter_kinds


def _batch(drafter, seq_len, anchors, seed=0):
    from deepspec.cache.reader import CachedSample
    from deepspec.drafters.spec import BatchSettings, spec_of

    g = torch.Generator().manual_seed(seed)
    hidden, layer_ids = drafter.config.hidden_size, drafter.config.target_layer_ids
    sample = CachedSample(sample_id="bench", input_ids=torch.randint(20, drafter.config.target_vocab_size, (seq_len,), generator=g),
                          loss_mask=torch.ones(seq_len, dtype=torch.bool),
                          features=torch.randn(seq_len, len(layer_ids) * hidden, generator=g),
                          final_hidden=torch.randn(seq_len, hidden, generator=g))
    settings = BatchSettings(cache_layer_ids=layer_ids, feature_layer_ids=layer_ids, max_anchors_per_seq=anchors,
                             max_tokens_per_row=seq_len)
    return spec_of(drafter).make_batcher(drafter.config, settings).collate([sample])


def worker(kind: str, seq_len: int, anchors: int, repeats: int) -> dict:
    """Runs in a fresh process: build, one warm-up step, timed steps; peak memory over the inputs' baseline."""
    from deepspec.drafters.base import describe_params
    from deepspec.drafters.build import build_drafter
    from deepspec.targets.load import load_target
    from deepspec.training.objective import compute_training_loss

    torch.set_num_threads(1)
    target = load_target("smollm2-135m", dtype="float32", device="cpu")
    torch.manual_seed(0)
    drafter = build_drafter(kind, target).train()
    batch = _batch(drafter, seq_len, anchors)
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for step in range(repeats + 1):
        start = time.perf_counter()
        result = compute_training_loss(drafter, batch)
        result.loss.total.backward()
        drafter.zero_grad(set_to_none=True)
        if step:
            times.append((time.perf_counter() - start) * 1000)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    parts = drafter.target_parts  # shared frozen target tensors, outside the drafter's module tree
    shared = {t.data_ptr(): t.numel() for t in (parts.embed_tokens.weight, parts.lm_head_weight)}
    return {**describe_params(drafter), "shared_frozen_target_params": sum(shared.values()), "step_ms": round(statistics.median(times), 1),
            "peak_mem_mb": round((peak_kb - baseline_kb) / 1024, 1), "num_rows": int(result.terms.valid_N.numel())}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_drafters.json")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=",".join(drafter_kinds()), help="default: every registered kind")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq_len, args.anchors, args.repeats)))
        return
    from deepspec.losses.memory import measure_loss_peak_memory

    report = {"target": "smollm2-135m (hidden 576, vocab 49152)", "features": "random", "block_size": 7,
              "anchors_per_seq": args.anchors, "seq_len": args.seq_len, "device": "cpu", "threads": 1, "kinds": {}}
    for kind in args.kinds.split(","):
        if kind not in drafter_kinds():
            report["kinds"][kind] = {"skipped": f"drafter kind {kind!r} is not registered"}
            continue
        cmd = [sys.executable, "-m", "deepspec.evaluation.bench_drafters", "--worker", kind, "--seq-len", str(args.seq_len), "--anchors", str(args.anchors),
               "--repeats", str(args.repeats)]
        run = subprocess.run(cmd, capture_output=True, text=True, check=False)
        report["kinds"][kind] = (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0
                                 else {"error": run.stderr[-1500:]})
    ds, df = report["kinds"].get("dspark", {}), report["kinds"].get("dflash", {})
    if "step_ms" in ds and "step_ms" in df:
        report["dspark_over_dflash_step"] = round(ds["step_ms"] / df["step_ms"], 3)
    rows = 7 * args.anchors
    chunked = measure_loss_peak_memory(rows, 576, 49152, True)
    naive = measure_loss_peak_memory(rows, 576, 49152, False)
    report["loss"] = {"num_rows": rows, "loss_peak_mem_mb_chunked": round(chunked, 1),
                      "loss_peak_mem_mb_naive": round(naive, 1), "naive_over_chunked": round(naive / max(chunked, 1e-9), 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
