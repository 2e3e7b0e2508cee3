"""Peak memory of the distribution loss forward+backward, chunked vs one-shot (`deepspec bench loss-memory`).

On CPU each measurement runs in a fresh Python subprocess and reports the growth of the process's
peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) over a baseline taken after
the inputs exist and a small warm-up ran (so library initialisation is not counted); tracemalloc
does not see torch's allocator. On CUDA it reports ``torch.cuda.max_memory_allocated`` growth
in-process. The setup mirrors DSpark: one frozen LM head shared by draft and target, gradients into
the draft hidden states only, loss ``0.1 CE + 0.9 TV`` (+ soft CE computed too).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from deepspec.utils.errors import command_line
from deepspec.utils.io import emit_report

_CPU_SCRIPT = r"""
import json, resource, sys
import torch
from deepspec.benchmarks.loss_memory import _run_loss
torch.set_num_threads(1)
a = json.loads(sys.argv[1])
shape = (a["num_rows"], a["hidden"], a["vocab"], a["chunked"], a["chunk_rows"], "cpu")
_run_loss(8, a["hidden"], 64, a["chunked"], a["chunk_rows"], "cpu", seed=1)  # warm-up
inputs = _run_loss(*shape, build_only=True)
baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_run_loss(*shape, inputs=inputs)
peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mb": (peak_kb - baseline_kb) / 1024.0}))
"""


def _run_loss(num_rows, hidden, vocab, chunked, chunk_rows, device, seed=0, build_only=False,
              inputs=None):
    """Build inputs (``build_only``) or run one forward+backward on ``inputs``."""
    from deepspec.losses.distribution import TermsOptions, distribution_terms, distribution_terms_naive

    if inputs is None:
        generator = torch.Generator().manual_seed(seed)
        head_VH = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(device)
        draft_hidden_NH = torch.randn(num_rows, hidden, generator=generator).to(device)
        draft_hidden_NH.requires_grad_(True)
        target_hidden_NH = torch.randn(num_rows, hidden, generator=generator).to(device)
        labels_N = torch.randint(0, vocab, (num_rows,), generator=generator).to(device)
        inputs = (draft_hidden_NH, head_VH, target_hidden_NH, labels_N)
        if build_only:
            return inputs
    draft_hidden_NH, head_VH, target_hidden_NH, labels_N = inputs
    if chunked:
        terms = distribution_terms(draft_hidden_NH, head_VH, target_hidden_NH, head_VH, labels_N,
                                   options=TermsOptions(chunk_rows=chunk_rows))
    else:
        terms = distribution_terms_naive(draft_hidden_NH, head_VH, target_hidden_NH, head_VH, labels_N)
    loss = 0.1 * terms.ce_N.sum() + 0.9 * terms.tv_N.sum() + 0.0 * terms.soft_ce_N.sum()
    loss.backward()
    return inputs


def measure_loss_peak_memory(
    num_rows: int, hidden: int, vocab: int, chunked: bool, *, chunk_rows: int = 512,
    device: str = "cpu"
) -> float:
    """Extra peak memory (MB) of one loss forward+backward beyond its inputs."""
    sizes = (("num_rows", num_rows), ("hidden", hidden), ("vocab", vocab), ("chunk_rows", chunk_rows))
    for name, value in sizes:
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    shape = (num_rows, hidden, vocab, chunked, chunk_rows, device)
    if torch.device(device).type == "cuda":
        inputs = _run_loss(*shape, build_only=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        _run_loss(*shape, inputs=inputs)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
    if torch.device(device).type != "cpu":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    args = {"num_rows": num_rows, "hidden": hidden, "vocab": vocab, "chunked": chunked,
            "chunk_rows": chunk_rows}
    result = subprocess.run([sys.executable, "-c", _CPU_SCRIPT, json.dumps(args)], capture_output=True,
                            text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"memory measurement subprocess failed:\n{result.stderr[-2000:]}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"])


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/bench_loss_memory.json")
    parser.add_argument("--num-rows", type=int, default=7 * 512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-rows", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    return parser


@command_line("deepspec bench loss-memory")
def main(argv: list[str] | None = None) -> int:
    """One JSON object: the sizes, and the chunked and the naive loss's extra peak MB."""
    args = build_parser().parse_args(argv)
    report = {"num_rows": args.num_rows, "hidden": args.hidden, "vocab": args.vocab,
              "chunk_rows": args.chunk_rows, "device": args.device}
    for chunked in (True, False):
        peak = measure_loss_peak_memory(args.num_rows, args.hidden, args.vocab, chunked,
                                        chunk_rows=args.chunk_rows, device=args.device)
        report[("chunked" if chunked else "naive") + "_peak_mb"] = round(peak, 1)
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
