"""Benchmark one training step of each drafter kind at the embedded target's shapes; print one JSON object.

Shapes: the embedded SmolLM2-135M target (hidden 576, 30 layers, vocab 49,152; its real frozen
embedding/LM head). Features and final hidden states are *random* (shapes are what matter for
speed/memory), one sequence of `--seq-len` tokens, every token supervised, batched by each kind's own
batcher (its spec): block drafters block 7 with `--anchors` anchors per sequence, chain drafters one packed
sequence row over the same tokens.
Per kind: trainable/frozen params, forward+backward `step_ms` (median of `--repeats` after one
warm-up) and `peak_mem_mb` (CPU: growth of the peak RSS in a fresh subprocess; CUDA: max allocated).
The TV/CE loss alone: chunked vs naive peak memory at 7 * anchors rows (`deepspec bench loss-memory`).

`--compare-vocab` instead runs, side by side in one invocation, block drafters with the
full vocabulary and reduced draft vocabularies (`--draft-vocabs`, default 8k/16k/32k) under the dense
[N, T + N] training mask and the segmented one (`--masks`), on `--seqs` packed sequences (the training
batch a step sees), each configuration in a fresh process: forward+backward `step_ms`, `peak_mem_mb`, and
the decode-time draft cost per block at batch 1 (`propose` over a `--decode-context`-token context, greedy
and T=1, median of `--decode-blocks`); then every ratio to the full-vocabulary dense baseline of its kind.
Reduced vocabularies read the target log-normaliser the v2 cache stores (computed here from the random final
hidden states with the real head).

    deepspec bench drafters --out outputs/bench_drafters.json
    deepspec bench drafters --compare-vocab --out outputs/bench_vocab.json
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
from deepspec.utils.errors import command_line


def _samples(drafter, seq_len, num_seqs=1, seed=0):
    """Random cached samples of the target's shapes, with the log-normaliser of their final hidden states."""
    from deepspec.cache.reader import CachedSample
    from deepspec.targets.features import log_normalizer

    g = torch.Generator().manual_seed(seed)
    hidden, layer_ids = drafter.config.hidden_size, drafter.config.target_layer_ids
    samples = []
    for index in range(num_seqs):
        final_hidden = torch.randn(seq_len, hidden, generator=g)
        input_ids = torch.randint(20, drafter.config.target_vocab_size, (seq_len,), generator=g)
        samples.append(CachedSample(sample_id=f"bench{index}", input_ids=input_ids,
                                    loss_mask=torch.ones(seq_len, dtype=torch.bool),
                                    features=torch.randn(seq_len, len(layer_ids) * hidden, generator=g),
                                    final_hidden=final_hidden,
                                    target_lse=log_normalizer(final_hidden, drafter.target_parts.lm_head_weight)))
    return samples


def _batch(drafter, samples, anchors):
    from deepspec.drafters.spec import BatchSettings, spec_of

    layer_ids = drafter.config.target_layer_ids
    settings = BatchSettings(cache_layer_ids=layer_ids, feature_layer_ids=layer_ids, max_anchors_per_seq=anchors,
                             max_tokens_per_row=max(s.length for s in samples))
    return spec_of(drafter).make_batcher(drafter.config, settings).collate(samples)


def _timed(step, repeats: int) -> tuple[float, float]:
    """Median (wall ms, process CPU ms) of `repeats` calls of `step` after one warm-up call. With one thread the
    CPU time is the work itself, robust to other processes sharing the cores (the wall time is not)."""
    walls, cpus = [], []
    for call in range(repeats + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        step()
        if call:
            walls.append((time.perf_counter() - wall) * 1000)
            cpus.append((time.process_time() - cpu) * 1000)
    return round(statistics.median(walls), 2), round(statistics.median(cpus), 2)


def _decode_ms(drafter, samples, context: int, num_blocks: int) -> dict:
    """Median milliseconds of one draft block (`propose`, batch 1) after `context` accepted tokens."""
    from deepspec.decoding.sampling import SamplingParams, draft_sampler

    sample = samples[0]
    drafter.eval()
    cache = drafter.extend_context(drafter.new_decode_state(), sample.features[None, :context],
                                   torch.arange(context)[None])
    anchor_ids, anchor_pos = sample.input_ids[[context]], torch.tensor([context])
    out = {}
    for name, params in (("greedy", SamplingParams(temperature=0.0)), ("t1", SamplingParams(temperature=1.0))):
        sampler = draft_sampler(params, torch.Generator().manual_seed(0))
        out[f"draft_block_ms_{name}"], out[f"draft_block_cpu_ms_{name}"] = _timed(
            lambda sampler=sampler: drafter.propose(cache, anchor_ids, anchor_pos, sampler), num_blocks)
    return out


def worker(kind: str, seq_len: int, anchors: int, repeats: int, settings: dict | None = None) -> dict:
    """Runs in a fresh process: build, one warm-up step, timed steps; peak memory over the inputs' baseline.

    `settings` (compare mode): drafter overrides (`draft_vocab_size`, `training_attention`, `num_draft_layers`),
    `num_seqs` packed sequences, and `decode_context` / `decode_blocks` for the per-block draft cost."""
    from deepspec.drafters.base import describe_params
    from deepspec.drafters.build import build_drafter
    from deepspec.drafters.draft_vocab import build_draft_vocab
    from deepspec.targets.load import load_target
    from deepspec.training.objective import compute_training_loss

    settings = dict(settings or {})
    num_seqs = settings.pop("num_seqs", 1)
    decode_context, decode_blocks = settings.pop("decode_context", None), settings.pop("decode_blocks", 0)
    torch.set_num_threads(1)
    target = load_target("smollm2-135m", dtype="float32", device="cpu")
    torch.manual_seed(0)
    drafter = build_drafter(kind, target, **settings).train()
    samples = _samples(drafter, seq_len, num_seqs)
    if settings.get("draft_vocab_size"):  # as training builds it: the most frequent (here: random) tokens
        drafter.set_draft_vocab(*build_draft_vocab(samples, settings["draft_vocab_size"],
                                                   vocab_size=drafter.config.target_vocab_size, always_keep=[0, 1, 2]))
    batch = _batch(drafter, samples, anchors)
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    steps = []

    def step():
        result = compute_training_loss(drafter, batch)
        result.loss.total.backward()
        drafter.zero_grad(set_to_none=True)
        steps.append(result)

    step_ms, step_cpu_ms = _timed(step, repeats)
    result = steps[-1]
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    parts = drafter.target_parts  # shared frozen target tensors, outside the drafter's module tree
    shared = {t.data_ptr(): t.numel() for t in (parts.embed_tokens.weight, parts.lm_head_weight)}
    report = {**describe_params(drafter), "shared_frozen_target_params": sum(shared.values()),
              "step_ms": round(step_ms, 1), "step_cpu_ms": round(step_cpu_ms, 1),
              "peak_mem_mb": round((peak_kb - baseline_kb) / 1024, 1),
              "num_rows": int(result.terms.valid_N.numel()),
              "num_context_tokens": int(batch.stats.get("num_context_tokens", 0))}
    if decode_context:
        report.update(_decode_ms(drafter, samples, decode_context, decode_blocks))
    return report


def _run_worker(kind: str, args, settings: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "deepspec.benchmarks.drafters", "--worker", kind, "--seq-len", str(args.seq_len),
           "--anchors", str(args.anchors), "--repeats", str(args.repeats)]
    if settings:
        cmd += ["--worker-settings", json.dumps(settings)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    return json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else {"error": run.stderr[-1500:]}


RATIO_KEYS = ("step_ms", "step_cpu_ms", "peak_mem_mb", "draft_block_ms_greedy", "draft_block_cpu_ms_greedy",
              "draft_block_ms_t1", "draft_block_cpu_ms_t1", "trainable_params")


def compare_vocab(args) -> dict:
    """Every (kind, draft vocabulary, mask) configuration in its own process, and ratios to the full-vocabulary
    dense-mask baseline of its kind (< 1: cheaper)."""
    vocabs = [None] + [int(v) for v in args.draft_vocabs.split(",") if v]
    masks = args.masks.split(",")
    report = {"target": "smollm2-135m (hidden 576, vocab 49152)", "features": "random", "block_size": 7,
              "num_draft_layers": args.draft_layers, "seqs": args.seqs, "seq_len": args.seq_len,
              "anchors_per_seq": args.anchors, "decode_context": args.decode_context, "device": "cpu", "threads": 1,
              "configs": {}, "ratios": {}}
    for kind in args.kinds.split(","):
        baseline = None
        for mask in masks:
            for vocab in vocabs:
                name = f"{kind}/{'full' if vocab is None else vocab}/{mask}"
                settings = {"draft_vocab_size": vocab, "training_attention": mask,
                            "num_draft_layers": args.draft_layers, "num_seqs": args.seqs,
                            "decode_context": args.decode_context, "decode_blocks": args.decode_blocks}
                result = _run_worker(kind, args, settings)
                report["configs"][name] = result
                print(json.dumps({name: result}), flush=True)
                if vocab is None and mask == masks[0]:
                    baseline = result
                if baseline and "error" not in result and "error" not in baseline:
                    report["ratios"][name] = {key: round(result[key] / baseline[key], 3) for key in RATIO_KEYS
                                              if baseline.get(key) and key in result}
    report["baseline"] = f"<kind>/full/{masks[0]}"
    return report


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_drafters.json")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", default=None, help="default: every registered kind (--compare-vocab: dspark,dflash)")
    parser.add_argument("--compare-vocab", action="store_true",
                        help="block drafters: full vs reduced draft vocabularies x dense vs segmented training mask")
    parser.add_argument("--draft-vocabs", default="8192,16384,32768", help="--compare-vocab: reduced sizes")
    parser.add_argument("--masks", default="dense,segmented", help="--compare-vocab: training_attention modes "
                        "(the first with the full vocabulary is the baseline)")
    parser.add_argument("--seqs", type=int, default=4, help="--compare-vocab: packed sequences per step")
    parser.add_argument("--draft-layers", type=int, default=2, help="--compare-vocab: draft layers")
    parser.add_argument("--decode-context", type=int, default=256,
                        help="--compare-vocab: context tokens before a block")
    parser.add_argument("--decode-blocks", type=int, default=20, help="--compare-vocab: timed draft blocks")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-settings", default=None, help=argparse.SUPPRESS)
    return parser


@command_line("deepspec bench drafters")
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.worker:
        settings = json.loads(args.worker_settings) if args.worker_settings else None
        print(json.dumps(worker(args.worker, args.seq_len, args.anchors, args.repeats, settings)))
        return
    if args.compare_vocab:
        args.kinds = args.kinds or "dspark,dflash"
        report = compare_vocab(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report))
        return
    args.kinds = args.kinds or ",".join(drafter_kinds())
    from deepspec.benchmarks.loss_memory import measure_loss_peak_memory

    report = {"target": "smollm2-135m (hidden 576, vocab 49152)", "features": "random", "block_size": 7,
              "anchors_per_seq": args.anchors, "seq_len": args.seq_len, "device": "cpu", "threads": 1, "kinds": {}}
    for kind in args.kinds.split(","):
        if kind not in drafter_kinds():
            report["kinds"][kind] = {"skipped": f"drafter kind {kind!r} is not registered"}
            continue
        report["kinds"][kind] = _run_worker(kind, args)
    ds, df = report["kinds"].get("dspark", {}), report["kinds"].get("dflash", {})
    if "step_ms" in ds and "step_ms" in df:
        report["dspark_over_dflash_step"] = round(ds["step_ms"] / df["step_ms"], 3)
    rows = 7 * args.anchors
    chunked = measure_loss_peak_memory(rows, 576, 49152, True)
    naive = measure_loss_peak_memory(rows, 576, 49152, False)
    report["loss"] = {"num_rows": rows, "loss_peak_mem_mb_chunked": round(chunked, 1),
                      "loss_peak_mem_mb_naive": round(naive, 1),
                      "naive_over_chunked": round(naive / max(chunked, 1e-9), 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
