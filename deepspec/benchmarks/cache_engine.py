"""The cache built by vLLM (`cache.engine=vllm`) against the transformers builder, in one run on the
same samples: tokens per CPU-second and how far the two caches are apart.

Both builds write a cache of the same conversations (ShareGPT's original answers, or --prompts) with
the same layers, storage and batches. CPU-seconds are DeepSpec's process (`time.process_time`:
rendering, the final norm, the LM head's log-normaliser, the shards) plus, for the engine, every
process of vLLM's session; the engine's are split into its start (loading the target) and the
capture after it. So `ratio_capture` compares the two builders once running (what a long build
converges to) and `ratio_total` includes the engine's start and transformers' model load. The caches
are then compared sample by sample: token ids and loss masks exactly, and per layer (and the final
hidden state, the log-normaliser) the largest absolute difference against the largest absolute
value.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

from deepspec.cache.build import BuildJob, build_cache
from deepspec.cache.config import CacheSchema, VllmCaptureSchema
from deepspec.cache.engine_source import VllmCapture
from deepspec.cache.reader import CacheReader
from deepspec.data.sources import load_prompts
from deepspec.targets.head import load_target_head
from deepspec.targets.layers import spread_layer_ids
from deepspec.targets.load import load_target
from deepspec.utils.errors import command_line
from deepspec.utils.io import emit_report


def compare_caches(engine_dir: Path, local_dir: Path) -> dict:
    """How far the engine's cache is from the transformers cache (module docstring): per tensor
    (each layer's features, the final hidden state, the log-normaliser) the largest absolute
    difference, the largest absolute value, and the relative L2 error over every token."""
    engine, local = CacheReader(engine_dir), CacheReader(local_dir)
    hidden, layer_ids = local.meta.hidden_size, list(local.meta.layer_ids)
    if [s["id"] for s in engine.samples] != [s["id"] for s in local.samples]:
        raise ValueError(f"{engine_dir} and {local_dir} hold other samples")
    names = [f"layer_{layer}" for layer in layer_ids] + ["final_hidden", "target_lse"]
    # name -> [max |diff|, max |value|, sum diff^2, sum value^2]
    sums = {name: [0.0, 0.0, 0.0, 0.0] for name in names}
    same_tokens = True
    for i in range(len(local)):
        a, b = engine[i], local[i]
        same_tokens &= torch.equal(a.input_ids, b.input_ids)
        same_tokens &= torch.equal(a.loss_mask, b.loss_mask)
        pairs = {f"layer_{layer}": (a.features[:, k * hidden:(k + 1) * hidden],
                                    b.features[:, k * hidden:(k + 1) * hidden])
                 for k, layer in enumerate(layer_ids)}
        pairs.update(final_hidden=(a.final_hidden, b.final_hidden),
                     target_lse=(a.target_lse, b.target_lse))
        for name, (x, y) in pairs.items():
            diff, y = x.double() - y.double(), y.double()
            acc = sums[name]
            acc[0], acc[1] = max(acc[0], float(diff.abs().max())), max(acc[1], float(y.abs().max()))
            acc[2] += float(diff.square().sum())
            acc[3] += float(y.square().sum())
    return {"same_token_ids_and_loss_masks": bool(same_tokens),
            "max_abs_diff": {name: acc[0] for name, acc in sums.items()},
            "max_abs_value": {name: acc[1] for name, acc in sums.items()},
            "max_abs_diff_relative": {name: acc[0] / acc[1] if acc[1] else 0.0
                                      for name, acc in sums.items()},
            "relative_l2": {name: (acc[2] / acc[3]) ** 0.5 if acc[3] else 0.0
                            for name, acc in sums.items()}}


def run(args: argparse.Namespace) -> dict:
    """Both builds on the same samples, then the comparison (`build_parser` names the settings)."""
    target_name, prompts, max_length, batch_size = args.target, args.prompts, args.max_length, args.batch_size
    storage_dtype, work_dir, dtype = args.storage_dtype, Path(args.work_dir), args.dtype
    vllm = VllmCaptureSchema(python=args.vllm_python, threads=args.engine_threads, max_num_seqs=args.max_num_seqs)
    conversations, _ = load_prompts(prompts, limit=args.n)
    splits = {"train": conversations}

    def options(name: str) -> CacheSchema:
        shutil.rmtree(work_dir / name, ignore_errors=True)
        return CacheSchema(out_dir=str(work_dir / name), layer_ids=layer_ids, max_length=max_length,
                           batch_size=batch_size, storage_dtype=storage_dtype, resume=False,
                           progress=False)

    cpu = time.process_time()
    target = load_target(target_name, dtype=dtype, device="cpu")
    local_load_cpu = time.process_time() - cpu
    layer_ids = spread_layer_ids(target.num_layers, args.num_layers)
    cpu = time.process_time()
    local = build_cache(splits, target, BuildJob(options("transformers")))
    local_cpu = time.process_time() - cpu
    del target

    cpu = time.process_time()
    head = load_target_head(target_name, dtype=dtype, device="cpu")
    head_load_cpu = time.process_time() - cpu
    cpu = time.process_time()
    with VllmCapture(head, layer_ids, vllm, max_model_len=max_length + 1) as engine:
        served = build_cache(splits, head, BuildJob(options("vllm"), engine=engine))
        engine_cpu = engine.running_cpu_seconds()
    deepspec_cpu = time.process_time() - cpu  # rendering, the final norm, the LM head, the shards
    engine_capture_cpu = engine_cpu - engine.startup_cpu_seconds
    tokens = local.num_tokens
    assert served.num_tokens == tokens

    def per_cpu_s(seconds: float) -> float:
        return round(tokens / seconds, 1)

    return {
        "target": target_name, "prompts": prompts, "conversations": len(conversations),
        "samples": local.num_samples, "tokens": tokens, "max_length": max_length,
        "batch_size": batch_size, "layer_ids": layer_ids, "dtype": dtype,
        "storage_dtype": storage_dtype, "vllm_version": engine.version,
        "engine_threads": vllm.threads, "torch_threads": torch.get_num_threads(),
        "transformers": {"load_cpu_s": round(local_load_cpu, 2), "build_cpu_s": round(local_cpu, 2),
                         "build_wall_s": round(local.seconds, 2),
                         "tokens_per_cpu_s": per_cpu_s(local_cpu)},
        "vllm": {"head_load_cpu_s": round(head_load_cpu, 2),
                 "engine_startup_cpu_s": round(engine.startup_cpu_seconds, 2),
                 "engine_capture_cpu_s": round(engine_capture_cpu, 2),
                 "deepspec_cpu_s": round(deepspec_cpu, 2), "build_wall_s": round(served.seconds, 2),
                 "tokens_per_cpu_s_capture": per_cpu_s(engine_capture_cpu + deepspec_cpu),
                 "tokens_per_cpu_s_total": per_cpu_s(head_load_cpu + engine_cpu + deepspec_cpu)},
        "ratio_capture": round(local_cpu / (engine_capture_cpu + deepspec_cpu), 3),
        "ratio_total": round((local_load_cpu + local_cpu)
                             / (head_load_cpu + engine_cpu + deepspec_cpu), 3),
        "equality": compare_caches(work_dir / "vllm", work_dir / "transformers"),
    }


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="The cache built by vLLM against the transformers builder (tokens "
        "per CPU-second, equality); one JSON object, also written to --out.")
    parser.add_argument("--target", default="smollm2-135m",
                        help="an embedded name or a saved model folder")
    parser.add_argument("--prompts", default="sharegpt")
    parser.add_argument("--n", type=int, default=64, help="conversations")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the target's, both ways")
    parser.add_argument("--storage-dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--num-layers", type=int, default=5,
                        help="cached layers, spread (the cache default)")
    parser.add_argument("--engine-threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--vllm-python")
    parser.add_argument("--work-dir", default="outputs/bench_cache-engine")
    parser.add_argument("--out", default="outputs/bench_cache-engine.json")
    return parser


@command_line("deepspec bench cache-engine")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emit_report(run(args), args.out)
    return 0
