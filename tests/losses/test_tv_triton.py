"""Fused Triton CE/TV/soft-CE kernel == PyTorch reference, under TRITON_INTERPRET=1 on CPU.

TRITON_INTERPRET must be set before triton is imported, and other test modules may already have
imported it in this process, so the checks run in a fresh subprocess (this file run as a script).
"""

import json
import os
import subprocess
import sys

import pytest

TOLERANCE = 1e-5


def _run_checks() -> dict:
    import torch

    from deepspec.losses.distribution import (
        ReducedVocab,
        TermsOptions,
        distribution_terms,
        distribution_terms_naive,
        row_terms_from_logits,
    )
    from deepspec.losses.tv_triton import fused_row_terms

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    num_rows, vocab = 3, 300  # vocab not a multiple of the 128-wide tile
    draft_logits = torch.randn(num_rows, vocab, generator=g) * 2
    target_logits = torch.randn(num_rows, vocab, generator=g) * 2
    target_logits[1] = draft_logits[1]  # identical row: tv == 0, sign == 0 everywhere
    labels = torch.tensor([5, -100, 299])
    upstream = torch.randn(3, num_rows, generator=g)
    diffs = {}

    def weighted(outputs):
        return sum((w * out).sum() for w, out in zip(upstream, outputs))

    fused_in = draft_logits.clone().requires_grad_(True)
    reference_in = draft_logits.clone().requires_grad_(True)
    fused = fused_row_terms(fused_in, target_logits, labels, block_v=128)
    reference = row_terms_from_logits(reference_in, target_logits, labels)
    for name, a, b in zip(("ce", "tv", "soft_ce"), fused, reference):
        diffs[f"kernel_{name}"] = float((a - b).abs().max())
    diffs["kernel_tv_identical_row"] = float(fused[1][1].abs())
    diffs["kernel_ce_ignored_row"] = float(fused[0][1].abs())
    grad_fused = torch.autograd.grad(weighted(fused), fused_in)[0]
    grad_reference = torch.autograd.grad(weighted(reference), reference_in)[0]
    diffs["kernel_grad"] = float((grad_fused - grad_reference).abs().max())

    # Through the dispatcher: checkpointed chunks with the fused kernel vs the one-shot reference.
    hidden, rank = 8, 4
    draft_hidden = torch.randn(num_rows, hidden, generator=g).requires_grad_(True)
    head = torch.randn(vocab, hidden, generator=g) * 0.5
    target_hidden = torch.randn(num_rows, hidden, generator=g)
    bias_in = torch.randn(num_rows, rank, generator=g).requires_grad_(True)
    bias_out = (torch.randn(rank, vocab, generator=g) * 0.5).requires_grad_(True)
    leaves = (draft_hidden, bias_in, bias_out)
    kwargs = {"draft_bias": (bias_in, bias_out)}
    triton_terms = distribution_terms(draft_hidden, head, target_hidden, head, labels, **kwargs,
                                      options=TermsOptions(chunk_rows=2, use_triton=True))
    naive_terms = distribution_terms_naive(draft_hidden, head, target_hidden, head, labels, **kwargs)
    for name in ("ce", "tv", "soft_ce"):
        diffs[f"dispatch_{name}"] = float((triton_terms.term(name) - naive_terms.term(name)).abs().max())
    grads_triton = torch.autograd.grad(weighted((triton_terms.ce_N, triton_terms.tv_N, triton_terms.soft_ce_N)), leaves)
    grads_naive = torch.autograd.grad(weighted((naive_terms.ce_N, naive_terms.tv_N, naive_terms.soft_ce_N)), leaves)
    for name, a, b in zip(("hidden", "bias_in", "bias_out"), grads_triton, grads_naive):
        diffs[f"dispatch_grad_{name}"] = float((a - b).abs().max())

    # Reduced draft vocabulary with the target's log-normaliser: the kernel runs on the rows extended by the
    # "outside" column (draft -inf); the reference computes TV + outside mass directly.
    kept = torch.sort(torch.randperm(vocab, generator=g)[:100]).values
    lse = torch.logsumexp(target_hidden @ head.T, dim=-1)
    reduced = ReducedVocab(kept, lse)
    draft_labels = torch.tensor([5, -100, 99])
    triton_terms = distribution_terms(draft_hidden, head[kept], target_hidden, head, draft_labels, reduced=reduced,
                                      options=TermsOptions(need=("ce", "tv"), chunk_rows=2, use_triton=True))
    naive_terms = distribution_terms_naive(draft_hidden, head[kept], target_hidden, head, draft_labels, reduced=reduced,
                                           need=("ce", "tv"))
    for name in ("ce", "tv"):
        diffs[f"lse_{name}"] = float((triton_terms.term(name) - naive_terms.term(name)).abs().max())
    grad_triton = torch.autograd.grad((triton_terms.ce_N + triton_terms.tv_N).sum(), draft_hidden)[0]
    grad_naive = torch.autograd.grad((naive_terms.ce_N + naive_terms.tv_N).sum(), draft_hidden)[0]
    diffs["lse_grad"] = float((grad_triton - grad_naive).abs().max())
    return diffs


def test_fused_kernel_matches_reference_under_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    diffs = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(diffs) == 15
    for name, diff in diffs.items():
        assert diff <= TOLERANCE, f"{name}: max abs difference {diff}"


if __name__ == "__main__":
    print(json.dumps(_run_checks()))
