"""Fused Triton kernel for per-row CE / TV / soft-CE between draft and target logit rows (GPU path).

Same signature and results as ``distribution.row_terms_from_logits`` (the PyTorch reference).
Forward, one program per row, tile by tile over the vocabulary:
  pass 1: online max / sum-exp for both rows -> lse_d, lse_t;
  pass 2: p_d, p_t per tile -> tv = sum |p_d - p_t|, <p_d, s> with s = sign(p_d - p_t),
          sum p_t z_d (soft_ce = lse_d - sum p_t z_d), and ce = lse_d - z_d[label].
Backward (one pass per row), gradient w.r.t. the draft logits only:
  d tv / dz = p_d * (s - <p_d, s>);  d ce / dz = p_d - onehot(label);  d soft_ce / dz = p_d - p_t.
Nothing of size [rows, vocab] is stored besides the inputs; per-row lse_d, lse_t, <p_d, s> are kept.
On CPU the kernels run only under ``TRITON_INTERPRET=1`` (set before triton is imported).

Shape legend: N = rows, V = vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

IGNORE_INDEX = -100
MAX_BLOCK_V = 4096


@triton.jit
def _fused_terms_fwd_kernel(
    draft_ptr,  # [rows, vocab] draft logits
    target_ptr,  # [rows, vocab] target logits
    labels_ptr,  # [rows] int64, ignore_index = ignored
    lse_d_ptr,  # [rows] fp32 out
    lse_t_ptr,  # [rows] fp32 out
    dot_ps_ptr,  # [rows] fp32 out: <p_d, sign(p_d - p_t)>
    ce_ptr,  # [rows] fp32 out
    tv_ptr,  # [rows] fp32 out
    soft_ce_ptr,  # [rows] fp32 out
    vocab,
    stride_draft,
    stride_target,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    draft_row = draft_ptr + row * stride_draft
    target_row = target_ptr + row * stride_target
    # Pass 1: online log-sum-exp of both rows.
    max_d = float("-inf")
    sum_d = 0.0
    max_t = float("-inf")
    sum_t = 0.0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab
        z_d = tl.load(draft_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        z_t = tl.load(target_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        new_max_d = tl.maximum(max_d, tl.max(z_d, axis=0))
        sum_d = sum_d * tl.exp(max_d - new_max_d) + tl.sum(tl.exp(z_d - new_max_d), axis=0)
        max_d = new_max_d
        new_max_t = tl.maximum(max_t, tl.max(z_t, axis=0))
        sum_t = sum_t * tl.exp(max_t - new_max_t) + tl.sum(tl.exp(z_t - new_max_t), axis=0)
        max_t = new_max_t
    lse_d = max_d + tl.log(sum_d)
    lse_t = max_t + tl.log(sum_t)
    # Pass 2: probabilities tile by tile.
    tv = 0.0
    dot_ps = 0.0
    pt_zd = 0.0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab
        z_d = tl.load(draft_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        z_t = tl.load(target_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        p_d = tl.exp(z_d - lse_d)
        p_t = tl.exp(z_t - lse_t)
        diff = p_d - p_t
        sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        tv += tl.sum(tl.abs(diff), axis=0)
        dot_ps += tl.sum(p_d * sign, axis=0)
        # Where p_t == 0 the product must be 0 even for z_d == -inf (padding lanes, masked vocab).
        pt_zd += tl.sum(p_t * tl.where(p_t > 0, z_d, 0.0), axis=0)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    safe_label = tl.where(valid, label, 0)
    z_label = tl.load(draft_row + safe_label).to(tl.float32)
    tl.store(lse_d_ptr + row, lse_d)
    tl.store(lse_t_ptr + row, lse_t)
    tl.store(dot_ps_ptr + row, dot_ps)
    tl.store(ce_ptr + row, tl.where(valid, lse_d - z_label, 0.0))
    tl.store(tv_ptr + row, tv)
    tl.store(soft_ce_ptr + row, lse_d - pt_zd)


@triton.jit
def _fused_terms_bwd_kernel(
    draft_ptr,  # [rows, vocab] draft logits
    target_ptr,  # [rows, vocab] target logits
    labels_ptr,  # [rows] int64
    lse_d_ptr,  # [rows] fp32
    lse_t_ptr,  # [rows] fp32
    dot_ps_ptr,  # [rows] fp32
    grad_ce_ptr,  # [rows] fp32 upstream gradient
    grad_tv_ptr,  # [rows] fp32 upstream gradient
    grad_soft_ce_ptr,  # [rows] fp32 upstream gradient
    grad_draft_ptr,  # [rows, vocab] out, same dtype as draft logits
    vocab,
    stride_draft,
    stride_target,
    stride_grad,
    ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    draft_row = draft_ptr + row * stride_draft
    target_row = target_ptr + row * stride_target
    grad_row = grad_draft_ptr + row * stride_grad
    lse_d = tl.load(lse_d_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    dot_ps = tl.load(dot_ps_ptr + row)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    grad_ce = tl.where(valid, tl.load(grad_ce_ptr + row), 0.0)
    grad_tv = tl.load(grad_tv_ptr + row)
    grad_soft_ce = tl.load(grad_soft_ce_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        in_vocab = offs < vocab
        z_d = tl.load(draft_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        z_t = tl.load(target_row + offs, mask=in_vocab, other=float("-inf")).to(tl.float32)
        p_d = tl.exp(z_d - lse_d)
        p_t = tl.exp(z_t - lse_t)
        diff = p_d - p_t
        sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        onehot = tl.where(offs == label, 1.0, 0.0)
        grad = grad_tv * p_d * (sign - dot_ps) + grad_ce * (p_d - onehot) + grad_soft_ce * (p_d - p_t)
        tl.store(grad_row + offs, grad.to(grad_draft_ptr.dtype.element_ty), mask=in_vocab)


def _block_v(vocab: int, block_v: int | None) -> int:
    if block_v is None:
        return min(triton.next_power_of_2(max(vocab, 1)), MAX_BLOCK_V)
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a positive power of two, got {block_v}")
    return block_v


class FusedDistributionTerms(torch.autograd.Function):
    """Autograd wrapper: (draft_logits_NV, target_logits_NV, labels_N) -> (ce_N, tv_N, soft_ce_N)."""

    @staticmethod
    def forward(ctx, draft_logits_NV, target_logits_NV, labels_N, ignore_index, block_v):
        draft_logits_NV = draft_logits_NV.contiguous()
        target_logits_NV = target_logits_NV.detach().contiguous()
        labels_N = labels_N.long().contiguous()
        num_rows, vocab = draft_logits_NV.shape
        per_row = [torch.empty(num_rows, dtype=torch.float32, device=draft_logits_NV.device) for _ in range(6)]
        lse_d_N, lse_t_N, dot_ps_N, ce_N, tv_N, soft_ce_N = per_row
        if num_rows:
            _fused_terms_fwd_kernel[(num_rows,)](
                draft_logits_NV, target_logits_NV, labels_N, lse_d_N, lse_t_N, dot_ps_N, ce_N, tv_N, soft_ce_N,
                vocab, draft_logits_NV.stride(0), target_logits_NV.stride(0), ignore_index, BLOCK_V=block_v,
            )
        ctx.save_for_backward(draft_logits_NV, target_logits_NV, labels_N, lse_d_N, lse_t_N, dot_ps_N)
        ctx.ignore_index = ignore_index
        ctx.block_v = block_v
        return ce_N, tv_N, soft_ce_N

    @staticmethod
    def backward(ctx, grad_ce_N, grad_tv_N, grad_soft_ce_N):
        draft_logits_NV, target_logits_NV, labels_N, lse_d_N, lse_t_N, dot_ps_N = ctx.saved_tensors
        num_rows, vocab = draft_logits_NV.shape
        grad_draft_NV = torch.empty_like(draft_logits_NV)
        if num_rows:
            _fused_terms_bwd_kernel[(num_rows,)](
                draft_logits_NV, target_logits_NV, labels_N, lse_d_N, lse_t_N, dot_ps_N,
                grad_ce_N.float().contiguous(), grad_tv_N.float().contiguous(), grad_soft_ce_N.float().contiguous(),
                grad_draft_NV, vocab, draft_logits_NV.stride(0), target_logits_NV.stride(0), grad_draft_NV.stride(0),
                ctx.ignore_index, BLOCK_V=ctx.block_v,
            )
        return grad_draft_NV, None, None, None, None


def fused_row_terms(
    draft_logits_NV: torch.Tensor,
    target_logits_NV: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused fp32 (ce_N, tv_N, soft_ce_N); gradients flow into the draft logits only."""
    if draft_logits_NV.dim() != 2 or draft_logits_NV.shape != target_logits_NV.shape:
        raise ValueError(
            f"draft_logits_NV and target_logits_NV must both be [N, V]; got {tuple(draft_logits_NV.shape)} "
            f"and {tuple(target_logits_NV.shape)}"
        )
    if labels_N.shape != draft_logits_NV.shape[:1]:
        raise ValueError(f"labels_N must be [{draft_logits_NV.shape[0]}]; got {tuple(labels_N.shape)}")
    block = _block_v(draft_logits_NV.shape[1], block_v)
    return FusedDistributionTerms.apply(draft_logits_NV, target_logits_NV, labels_N, ignore_index, block)
