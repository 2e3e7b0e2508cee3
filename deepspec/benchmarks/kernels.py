"""Time accept_draft: torch reference vs Triton kernels (Triton only on a CUDA device).

Usage: deepspec bench kernels [--out outputs/bench_kernels.json] [--iters 5]
Prints one JSON object and writes it to --out. Times exclude noise drawing and input creation.
"""

import argparse
import functools
import json
import time

import torch

from deepspec.decoding.acceptance import AcceptanceNoise, accept_draft
from deepspec.decoding.sampling import SamplingParams
from deepspec.utils.errors import command_line
from deepspec.utils.io import atomic_write_json


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _time_ms(fn, iters: int, device: torch.device) -> float:
    fn()  # warm-up (Triton compiles on the first call)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1000.0 * (time.perf_counter() - start) / iters


def run(batch_sizes, vocab_sizes, num_draft, iters, seed) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = ["torch", "triton"] if device.type == "cuda" else ["torch"]
    generator = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for vocab in vocab_sizes:
        for batch in batch_sizes:
            logits_BK1V = torch.randn(batch, num_draft + 1, vocab, device=device, generator=generator)
            draft_probs_BKV = torch.softmax(logits_BK1V[:, :num_draft] + 0.5, dim=-1)
            draft_ids_BK = draft_probs_BKV.argmax(-1)
            num_draft_B = torch.full((batch,), num_draft, device=device)
            noise = AcceptanceNoise.draw(batch, num_draft, vocab, generator, device)
            for mode, params, probs in (("greedy", SamplingParams(temperature=0.0), None),
                                        ("sampled", SamplingParams(temperature=1.0), draft_probs_BKV)):
                row = {"batch": batch, "num_draft": num_draft, "vocab": vocab, "mode": mode}
                for backend in backends:
                    call = functools.partial(accept_draft, draft_ids_BK, probs, logits_BK1V, num_draft_B, params,
                                             noise, backend)
                    row[f"{backend}_ms"] = round(_time_ms(call, iters, device), 4)
                if "triton_ms" in row:
                    row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 3)
                rows.append(row)
    note = "" if device.type == "cuda" else "Triton unavailable without a CUDA device: torch reference only"
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch_threads": torch.get_num_threads(), "iters": iters, "note": note, "results": rows}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_kernels.json")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 8, 32])
    parser.add_argument("--vocab-sizes", type=_ints, default=[49152, 151936])
    parser.add_argument("--num-draft", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    return parser


@command_line("deepspec bench kernels")
def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.iters < 1 or args.num_draft < 0:
        parser.error(f"--iters={args.iters} must be >= 1 and --num-draft={args.num_draft} >= 0")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    report = run(args.batch_sizes, args.vocab_sizes, args.num_draft, args.iters, args.seed)
    print(json.dumps(report))
    atomic_write_json(args.out, report)


if __name__ == "__main__":
    main()
