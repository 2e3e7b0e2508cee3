"""Throughput of batched speculative decoding: fixed-length vs static threshold vs the prefix scheduler.

Usage:
  deepspec bench scheduler [--tiny] [--target smollm2-135m] [--drafter DIR] [--concurrency 1,4,16]
      [--requests-per-slot 2] [--max-new-tokens 32] [--temperature 1.0] [--threshold 0.5]
      [--prompts FILE.jsonl] [--context-len 128] [--out outputs/bench_scheduler.json] [--sps-dir DIR]
      [--dtype float32|bfloat16] [--sglang-sps-table sps.json]

For each concurrency R the target's SPS(B) table is profiled (or reused: stored with the environment
fingerprint under --sps-dir), then the same R * requests-per-slot requests are served by the
batched loop (`deepspec.decoding.batched`) under each verification policy, same seed, side by side:
  fixed      - verify the full block of every request;
  threshold  - static: up to the first position whose calibrated c_k < --threshold;
  scheduler  - Algorithm 1 with the profiled SPS table;
plus the same batched loop without a drafter ("autoregressive") as the baseline.
Reports total tokens/s (all generated tokens / wall time, prefills included), per-request tokens/s
(tokens / time from admission to finish), mean tau, tokens verified and computed (with padding) per
round. One JSON object to stdout and --out. Without --drafter an *untrained* DSpark drafter is used
(a smoke run: its confidences carry no information); `"drafter"` in the output says which.
`--tiny` uses a tiny random target (with the embedded tokenizer) for a quick run. `--sglang-sps-table PATH` also
writes the target's cost of R full blocks for every R of --concurrency in the table SGLang's DSpark scheduler reads
(`--speculative-dspark-sps-table-path`; deepspec.export.sglang_sps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from deepspec.decoding.acceptance import Acceptance
from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
from deepspec.decoding.profiling import profile_target_sps
from deepspec.decoding.proposers import NoDraftBatchProposer
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.scheduler import VerificationPolicy
from deepspec.drafters.proposers import make_batch_proposer
from deepspec.drafters.spec import capabilities_of
from deepspec.export.sglang_sps import write_sglang_sps_table
from deepspec.utils.errors import command_line
from deepspec.utils.io import emit_report

DEFAULT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of Python.",
    "How many legs does a spider have?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet.",
]
MODES = ("fixed", "threshold", "scheduler")
BASELINE = "autoregressive"  # the same batched loop without drafts


def _ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency must be a comma-separated list of ints >= 1, got {text!r}")
    return values


def load_prompt_texts(path: str | None, limit: int) -> list[str]:
    if path is None:
        return DEFAULT_PROMPTS
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--prompts {file}: file not found")
    texts = []
    for line_no, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        turns = record.get("turns") if isinstance(record, dict) else None
        if not turns or not isinstance(turns[0], str):
            raise ValueError(f"{file}:{line_no}: expected {{\"turns\": [\"...\"]}}")
        texts.append(turns[0])  # first turn only (paper protocol)
        if len(texts) >= limit:
            break
    if not texts:
        raise ValueError(f"--prompts {file}: no prompts")
    return texts


def render_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        prompts.append(list(ids))
    return prompts


def load_models(args):
    from deepspec.drafters.build import build_drafter, load_drafter

    if args.tiny:
        from deepspec.targets.load import make_tiny_target

        target = make_tiny_target("llama")
    else:
        from deepspec.targets.load import load_target

        target = load_target(args.target, dtype=args.dtype, device=args.device)
    if args.drafter:
        drafter = load_drafter(args.drafter, target).eval()
        label = f"trained: {args.drafter}"
    else:
        torch.manual_seed(args.seed)
        drafter = build_drafter("dspark", target, num_draft_layers=1).eval()
        label = "untrained DSpark (1 layer, random init): smoke run, confidences carry no information"
    if not capabilities_of(drafter).confidence_head:
        raise ValueError("threshold and scheduler modes need a drafter with a confidence head (DSpark)")
    return target, drafter, label


def run_mode(target, drafter, prompts, mode, args, sps, concurrency, acceptance: Acceptance | str = "auto") -> dict:
    requests = [BatchRequest(prompts[i % len(prompts)], args.max_new_tokens, request_id=i)
                for i in range(concurrency * args.requests_per_slot)]
    policy = VerificationPolicy("fixed" if mode == BASELINE else mode, threshold=args.threshold)
    proposer = NoDraftBatchProposer() if mode == BASELINE else make_batch_proposer(drafter)
    eos = [target.tokenizer.eos_token_id] if args.stop_at_eos and target.tokenizer.eos_token_id is not None else []
    device = next(target.model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(args.seed)
    serving = ServingSettings(max_concurrency=concurrency, layer_ids=drafter.config.target_layer_ids,
                              eos_token_ids=eos, sps=sps, acceptance_backend=acceptance)
    out = batched_speculative_generate(target.model, proposer, requests, SamplingParams(temperature=args.temperature),
                                       policy=policy, generator=generator, settings=serving)
    per_request = [r.tokens_per_s for r in out.requests]
    rounds = out.rounds
    accepted = [a for r in rounds for a in r.accepted]
    return {
        "total_tokens": out.total_tokens, "wall_s": out.wall_s, "tokens_per_s": out.tokens_per_s,
        "per_request_tokens_per_s_mean": statistics.mean(per_request),
        "per_request_tokens_per_s_median": statistics.median(per_request),
        "mean_tau": sum(a + 1 for a in accepted) / max(len(accepted), 1),
        "rounds": len(rounds),
        "mean_tokens_verified_per_round": statistics.mean(r.tokens_verified for r in rounds) if rounds else 0.0,
        "mean_tokens_computed_per_round": statistics.mean(r.tokens_computed for r in rounds) if rounds else 0.0,
        "mean_verified_drafts_per_request_round":
            statistics.mean(n for r in rounds for n in r.lengths) if rounds else 0.0,
        "draft_s": sum(r.draft_s for r in rounds), "schedule_s": sum(r.schedule_s for r in rounds),
        "verify_s": sum(r.verify_s for r in rounds),
    }


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random target (fast smoke run)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafter", default=None, help="trained DSpark drafter dir (default: untrained smoke drafter)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threshold", type=float, default=0.5)
    parser.add_argument("--prompts", default=None, help='JSONL of {"turns": [...]} (default: 8 built-in prompts)')
    parser.add_argument("--max-prompts", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=128, help="KV length used when profiling SPS")
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--stop-at-eos", action="store_true", help="stop requests at EOS (default: fixed lengths)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable timings on a shared host)")
    parser.add_argument("--out", default="outputs/bench_scheduler.json")
    parser.add_argument("--sps-dir", default=None, help="where SPS tables are stored (default: next to --out)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the target's weights (float32: the modes' tokens compare exactly; bfloat16 as served)")
    parser.add_argument("--sglang-sps-table", type=Path, default=None, metavar="PATH",
                        help="also write the full-block point of every concurrency's SPS table here, in SGLang's "
                             "DSpark format (SGLang's own profiler times its engine; this times transformers')")
    return parser


@command_line("deepspec bench scheduler")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests_per_slot < 1 or args.max_new_tokens < 1:
        raise ValueError("--requests-per-slot and --max-new-tokens must be >= 1")
    concurrencies = _ints(args.concurrency)
    if args.threads < 1:
        raise ValueError(f"--threads={args.threads} must be >= 1")
    torch.set_num_threads(args.threads)

    target, drafter, drafter_label = load_models(args)
    prompts = render_prompts(target.tokenizer, load_prompt_texts(args.prompts, args.max_prompts))
    out_path = Path(args.out)
    sps_dir = Path(args.sps_dir) if args.sps_dir else out_path.parent / "sps"
    block = int(drafter.config.num_drafts)  # drafts per round (the block convention: g or g - 1)
    # Warm-up: first calls allocate and pick kernels; keep them out of the first measured mode.
    run_mode(target, drafter, prompts, "fixed", argparse.Namespace(**{**vars(args), "max_new_tokens": 4,
                                                                      "requests_per_slot": 1}), None, 1)
    acceptance = Acceptance()  # one backend choice for every run of this benchmark
    results, tables = [], {}
    for concurrency in concurrencies:
        t0 = time.perf_counter()
        sps = tables[concurrency] = profile_target_sps(target.model, target.name, sps_dir, num_rows=concurrency,
                                                       max_block=block, context_len=args.context_len,
                                                       repeats=args.profile_repeats)
        profile_s = time.perf_counter() - t0
        modes = {mode: run_mode(target, drafter, prompts, mode, args, sps, concurrency, acceptance)
                 for mode in (BASELINE, *MODES)}
        fixed_tps = modes["fixed"]["tokens_per_s"]
        results.append({
            "concurrency": concurrency, "num_requests": concurrency * args.requests_per_slot,
            "sps_table": {"batch_sizes": sps.batch_sizes, "steps_per_second": sps.steps_per_second},
            "profile_s": profile_s, "modes": modes,
            "speedup_vs_fixed": {m: modes[m]["tokens_per_s"] / fixed_tps for m in MODES},
            "speedup_vs_autoregressive": {m: modes[m]["tokens_per_s"] / modes[BASELINE]["tokens_per_s"] for m in MODES},
        })
    summary = {
        "target": target.name, "drafter": drafter_label, "block_size": int(drafter.config.block_size),
        "num_drafts": block,
        "device": str(next(target.model.parameters()).device), "num_threads": torch.get_num_threads(),
        "temperature": args.temperature, "threshold": args.threshold, "max_new_tokens": args.max_new_tokens,
        "calibration_temperatures": drafter.config.calibration_temperatures,
        "results": results,
        "note": "wall-clock on a shared machine: +-10% noise between modes is expected",
    }
    if args.sglang_sps_table is not None:
        summary["sglang_sps_table"] = {"path": str(args.sglang_sps_table),
                                       **write_sglang_sps_table(args.sglang_sps_table, tables, block)}
    emit_report(summary, out_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
