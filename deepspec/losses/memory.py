"""Peak memory of the distribution loss forward+backward: chunked vs one-shot (naive).

On CPU the measurement runs in a fresh Python subprocess and reports the growth of the process's
peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) over a baseline taken after
the inputs exist and a small warm-up ran (so library initialisation is not counted); tracemalloc
does not see torch's allocator. On CUDA it reports ``torch.cuda.max_memory_allocated`` growth
in-process. The setup mirrors DSpark: one frozen LM head shared by draft and target, gradients into
the draft hidden states only, loss ``0.1 CE + 0.9 TV`` (+ soft CE computed too).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

_CPU_SCRIPT = r"""
import json, resource, sys
import torch
from deepspec.losses.memory import _run_loss
torch.set_num_threads(1)
args = json.loads(sys.argv[1])
_run_loss(8, args["hidden"], 64, args["chunked"], args["chunk_rows"], "cpu", seed=1)  # warm-up
inputs = _run_loss(args["num_rows"], args["hidden"], args["vocab"], args["chunked"], args["chunk_rows"], "cpu",
                   build_only=True)
baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_run_loss(args["num_rows"], args["hidden"], args["vocab"], args["chunked"], args["chunk_rows"], "cpu", inputs=inputs)
peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mb": (peak_kb - baseline_kb) / 1024.0}))
"""


def _run_loss(num_rows, hidden, vocab, chunked, chunk_rows, device, seed=0, build_only=False, inputs=None):
    """Build inputs (``build_only``) or run one forward+backward on ``inputs``."""
    from deepspec.losses.distribution import distribution_terms, distribution_terms_naive

    if inputs is None:
        generator = torch.Generator().manual_seed(seed)
        head_VH = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(device)
        draft_hidden_NH = torch.randn(num_rows, hidden, generator=generator).to(device).requires_grad_(True)
        target_hidden_NH = torch.randn(num_rows, hidden, generator=generator).to(device)
        labels_N = torch.randint(0, vocab, (num_rows,), generator=generator).to(device)
        inputs = (draft_hidden_NH, head_VH, target_hidden_NH, labels_N)
        if build_only:
            return inputs
    draft_hidden_NH, head_VH, target_hidden_NH, labels_N = inputs
    if chunked:
        terms = distribution_terms(draft_hidden_NH, head_VH, target_hidden_NH, head_VH, labels_N, chunk_rows=chunk_rows)
    else:
        terms = distribution_terms_naive(draft_hidden_NH, head_VH, target_hidden_NH, head_VH, labels_N)
    loss = 0.1 * terms.ce_N.sum() + 0.9 * terms.tv_N.sum() + 0.0 * terms.soft_ce_N.sum()
    loss.backward()
    return inputs


def measure_loss_peak_memory(
    num_rows: int, hidden: int, vocab: int, chunked: bool, *, chunk_rows: int = 512, device: str = "cpu"
) -> float:
    """Extra peak memory (MB) of one loss forward+backward beyond its inputs."""
    for name, value in (("num_rows", num_rows), ("hidden", hidden), ("vocab", vocab), ("chunk_rows", chunk_rows)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if torch.device(device).type == "cuda":
        inputs = _run_loss(num_rows, hidden, vocab, chunked, chunk_rows, device, build_only=True)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        _run_loss(num_rows, hidden, vocab, chunked, chunk_rows, device, inputs=inputs)
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
    if torch.device(device).type != "cpu":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {device!r}")
    args = {"num_rows": num_rows, "hidden": hidden, "vocab": vocab, "chunked": chunked, "chunk_rows": chunk_rows}
    result = subprocess.run(
        [sys.executable, "-c", _CPU_SCRIPT, json.dumps(args)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"memory measurement subprocess failed:\n{result.stderr[-2000:]}")
    return float(json.loads(result.stdout.strip().splitlines()[-1])["peak_mb"])


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rows", type=int, default=7 * 512)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk-rows", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    cli = parser.parse_args()
    for chunked in (True, False):
        peak = measure_loss_peak_memory(
            cli.num_rows, cli.hidden, cli.vocab, chunked, chunk_rows=cli.chunk_rows, device=cli.device
        )
        print(json.dumps({"chunked": chunked, "peak_mb": round(peak, 1)}))
