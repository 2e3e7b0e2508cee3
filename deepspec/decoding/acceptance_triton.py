"""Triton kernels for `accept_draft`: same semantics as `acceptance_torch.accept_draft_torch`, from logits.

Two launches, neither writes a normalised dense copy of p_t:
1. `_row_stats_kernel`, one program per target row (B * (K+1)): online max / log-sum-exp over vocab
   tiles and the first-index argmax (for greedy).
2. `_accept_kernel`, one program per request: walks the drafts with the accept test
   `u * p_d(x) < exp(logit(x)/T - lse)` (scalar gathers only), then makes one pass over the vocab of
   row num_accepted computing p_t = exp(logit/T - lse) tile by tile, the residual max(0, p_t - p_d)
   and the exponential race (running argmax of residual / E and of p_t / E, plus the residual mass
   for the degenerate-residual fallback, see acceptance_torch.RESIDUAL_MASS_EPS).
Top-k/top-p are applied by the caller in torch (entries become -inf, which the kernels handle);
a plain temperature is applied inside the kernels. Vocab sizes need not be a multiple of the tile.

Shape legend: B = requests, K = max draft tokens, K1 = K + 1 target rows, V = vocab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepspec.decoding.acceptance_torch import RESIDUAL_MASS_EPS, AcceptResult
from deepspec.decoding.sampling import SamplingParams, process_logits

# Whether the kernels below were decorated under TRITON_INTERPRET=1 (CPU tensors then work).
INTERPRETED = bool(triton.knobs.runtime.interpret)

BLOCK_V = 1024


@triton.jit
def _row_stats_kernel(
    logits_ptr,  # [B * K1, V] float (any float dtype; read as float32)
    lse_ptr,  # [B * K1] float32 out: logsumexp(logits / T)
    argmax_ptr,  # [B * K1] int64 out: first index of the max logit
    vocab_size,
    temperature,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    # Per-lane running max / scaled sum / argmax; reduced across lanes once at the end.
    max_L = tl.full([BLOCK], float("-inf"), tl.float32)
    sum_L = tl.zeros([BLOCK], tl.float32)
    argmax_L = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + lanes
        logit_L = tl.load(logits_ptr + row * vocab_size + offs, mask=offs < vocab_size,
                          other=float("-inf")).to(tl.float32) / temperature
        improved = logit_L > max_L  # strict: keeps the earliest index per lane
        new_max_L = tl.maximum(max_L, logit_L)
        # A lane that has only seen -inf (masked token or padding) would give exp(-inf - -inf) = nan.
        safe_max_L = tl.where(new_max_L == float("-inf"), 0.0, new_max_L)
        sum_L = sum_L * tl.exp(max_L - safe_max_L) + tl.exp(logit_L - safe_max_L)
        argmax_L = tl.where(improved, offs, argmax_L)
        max_L = new_max_L
    row_max = tl.max(max_L, axis=0)
    row_sum = tl.sum(sum_L * tl.exp(max_L - row_max), axis=0)
    tl.store(lse_ptr + row, row_max + tl.log(row_sum))
    first_argmax = tl.min(tl.where(max_L == row_max, argmax_L, vocab_size), axis=0)
    tl.store(argmax_ptr + row, first_argmax.to(tl.int64))


@triton.jit
def _accept_kernel(
    logits_ptr,  # [B, K1, V] float: target logits (already top-k/top-p filtered)
    lse_ptr,  # [B, K1] float32: from _row_stats_kernel
    argmax_ptr,  # [B, K1] int64: from _row_stats_kernel
    draft_ids_ptr,  # [B, K] int64 (a 1-element dummy when K == 0)
    draft_probs_ptr,  # [B, K, V] float (dummy when HAS_DRAFT_PROBS is False)
    num_draft_ptr,  # [B] int32
    uniform_ptr,  # [B, K] float32 (dummy when GREEDY or K == 0)
    exponential_ptr,  # [B, V] float32 (dummy when GREEDY)
    output_ids_ptr,  # [B, K1] int64 out: accepted drafts, then recovered/bonus token, -1 padded
    num_accepted_ptr,  # [B] int64 out
    num_draft_max,
    last_draft_index,  # max(K - 1, 0): the draft slot read for a rejection (clamped for bonus rows)
    vocab_size,
    temperature,
    residual_mass_eps,
    GREEDY: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K1: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    num_rows = num_draft_max + 1
    num_draft = tl.load(num_draft_ptr + b)

    # Accept test along the chain; `alive` drops to 0 at the first rejection.
    num_accepted = tl.program_id(0) * 0
    alive = num_accepted + 1
    for j in range(0, num_draft):
        token = tl.load(draft_ids_ptr + b * num_draft_max + j)
        if GREEDY:
            accepted = token == tl.load(argmax_ptr + b * num_rows + j)
        else:
            row = b * num_rows + j
            logit = tl.load(logits_ptr + row * vocab_size + token).to(tl.float32) / temperature
            p_target = tl.exp(logit - tl.load(lse_ptr + row))
            if HAS_DRAFT_PROBS:
                p_draft = tl.load(draft_probs_ptr + (b * num_draft_max + j) * vocab_size + token).to(tl.float32)
            else:
                p_draft = 1.0
            accepted = tl.load(uniform_ptr + b * num_draft_max + j) * p_draft < p_target
        alive = alive * accepted.to(tl.int32)
        num_accepted += alive

    last_row = b * num_rows + num_accepted
    if GREEDY:
        last_token = tl.load(argmax_ptr + last_row)
    else:
        rejected = num_accepted < num_draft
        draft_slot = b * num_draft_max + tl.minimum(num_accepted, last_draft_index)
        rejected_token = tl.load(draft_ids_ptr + draft_slot)
        # p_draft is read only on a rejection row; as a bound (not a scalar bool) for the mask.
        draft_vocab_limit = tl.where(rejected, vocab_size, 0)
        last_lse = tl.load(lse_ptr + last_row)
        lanes = tl.arange(0, BLOCK)
        best_residual_L = tl.full([BLOCK], -1.0, tl.float32)
        best_residual_idx_L = tl.zeros([BLOCK], tl.int32)
        best_target_L = tl.full([BLOCK], -1.0, tl.float32)
        best_target_idx_L = tl.zeros([BLOCK], tl.int32)
        residual_mass_L = tl.zeros([BLOCK], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + lanes
            in_vocab = offs < vocab_size
            logit_L = tl.load(logits_ptr + last_row * vocab_size + offs, mask=in_vocab,
                              other=float("-inf")).to(tl.float32) / temperature
            p_target_L = tl.exp(logit_L - last_lse)
            if HAS_DRAFT_PROBS:
                p_draft_L = tl.load(draft_probs_ptr + draft_slot * vocab_size + offs,
                                    mask=offs < draft_vocab_limit, other=0.0).to(tl.float32)
            else:
                p_draft_L = tl.where((offs == rejected_token) & (offs < draft_vocab_limit), 1.0, 0.0)
            # A bonus row (not rejected) has p_draft = 0, so its residual is p_target itself.
            residual_L = tl.where(in_vocab, tl.maximum(p_target_L - p_draft_L, 0.0), 0.0)
            residual_mass_L += residual_L
            noise_L = tl.load(exponential_ptr + b * vocab_size + offs, mask=in_vocab, other=1.0)
            residual_score_L = tl.where(in_vocab, residual_L / noise_L, -1.0)
            target_score_L = tl.where(in_vocab, p_target_L / noise_L, -1.0)
            better_residual = residual_score_L > best_residual_L
            best_residual_L = tl.where(better_residual, residual_score_L, best_residual_L)
            best_residual_idx_L = tl.where(better_residual, offs, best_residual_idx_L)
            better_target = target_score_L > best_target_L
            best_target_L = tl.where(better_target, target_score_L, best_target_L)
            best_target_idx_L = tl.where(better_target, offs, best_target_idx_L)
        top_residual = tl.max(best_residual_L, axis=0)
        residual_token = tl.min(tl.where(best_residual_L == top_residual, best_residual_idx_L, vocab_size), axis=0)
        top_target = tl.max(best_target_L, axis=0)
        target_token = tl.min(tl.where(best_target_L == top_target, best_target_idx_L, vocab_size), axis=0)
        degenerate = tl.sum(residual_mass_L, axis=0) < residual_mass_eps
        last_token = tl.where(degenerate, target_token, residual_token).to(tl.int64)

    slots = tl.arange(0, BLOCK_K1)
    drafts = tl.load(draft_ids_ptr + b * num_draft_max + slots, mask=slots < num_accepted, other=-1)
    out = tl.where(slots == num_accepted, last_token, drafts)
    tl.store(output_ids_ptr + b * num_rows + slots, out, mask=slots < num_rows)
    tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))


def accept_draft_triton(
    draft_ids_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    target_logits_BK1V: torch.Tensor,
    num_draft_B: torch.Tensor,
    params: SamplingParams,
    noise,
):
    """Triton implementation of `acceptance.accept_draft` (inputs validated by the dispatcher)."""

    batch, num_draft = draft_ids_BK.shape
    vocab = target_logits_BK1V.shape[2]
    device = target_logits_BK1V.device
    if params.is_greedy:
        temperature = 1.0
    elif params.filters_vocab:
        target_logits_BK1V = process_logits(target_logits_BK1V, params)  # temperature applied here
        temperature = 1.0
    else:
        temperature = float(params.temperature)
    logits_BK1V = target_logits_BK1V.contiguous()
    lse_BK1 = torch.empty(batch, num_draft + 1, dtype=torch.float32, device=device)
    argmax_BK1 = torch.empty(batch, num_draft + 1, dtype=torch.int64, device=device)
    output_ids_BK1 = torch.empty(batch, num_draft + 1, dtype=torch.int64, device=device)
    num_accepted_B = torch.empty(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return AcceptResult(output_ids_BK1, num_accepted_B, num_accepted_B + 1)

    dummy_f32 = torch.zeros(1, dtype=torch.float32, device=device)
    draft_ids = draft_ids_BK.long().contiguous() if num_draft > 0 else torch.full((1,), -1, device=device)
    draft_probs = draft_probs_BKV.contiguous() if draft_probs_BKV is not None and num_draft > 0 else dummy_f32
    if params.is_greedy:
        uniform, exponential = dummy_f32, dummy_f32
    else:
        uniform = noise.uniform_BK.float().contiguous() if num_draft > 0 else dummy_f32
        exponential = noise.exponential_BV.float().contiguous()

    _row_stats_kernel[(batch * (num_draft + 1),)](
        logits_BK1V, lse_BK1, argmax_BK1, vocab, temperature, BLOCK=BLOCK_V
    )
    _accept_kernel[(batch,)](
        logits_BK1V, lse_BK1, argmax_BK1, draft_ids, draft_probs,
        num_draft_B.to(torch.int32).contiguous(), uniform, exponential,
        output_ids_BK1, num_accepted_B,
        num_draft, max(num_draft - 1, 0), vocab, temperature, RESIDUAL_MASS_EPS,
        GREEDY=params.is_greedy,
        HAS_DRAFT_PROBS=draft_probs_BKV is not None and num_draft > 0,
        BLOCK=BLOCK_V,
        BLOCK_K1=triton.next_power_of_2(num_draft + 1),
    )
    return AcceptResult(output_ids_BK1, num_accepted_B, num_accepted_B + 1)
