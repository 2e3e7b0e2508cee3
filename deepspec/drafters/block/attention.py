"""Block attention for DFlash/DSpark: the masks and the family-agnostic context-injecting attention.

Rule: a block attends bidirectionally within itself and to context positions strictly before its
anchor (of its own sequence); never to other blocks. Training packs many blocks of many sequences
into one row (keys = [all context tokens; all block tokens]); inference attends to a
`DraftKVCache` (deepspec.decoding.kv_cache) plus the block.

Training masks (`PackedBlocks`, the index form of the rule; `config.training_attention`):
- "dense": the boolean [N, T + N] mask `packed_block_mask`, one SDPA call. The exact reference, but
  O(N x (T + N)) to build and to attend: every block row scores every context token of every sequence
  and every other block.
- "segmented" (CPU default): blocks are cut into segments of consecutive blocks of one sequence
  (`SEGMENT_ROWS` query rows); a segment's keys are gathered as [its sequence's context up to the largest
  anchor in it; the segment's own block keys], with the same boolean rule on that small key set. Exact
  (the same keys, the same SDPA), O(N x context + N x SEGMENT_ROWS), no dense mask.
- "flex" (CUDA default): `flex_attention` with a `BlockMask` built once per batch from the same rule
  (`mask_mod`), compiled on CUDA; tiles with nothing to attend are skipped. On CPU it runs eagerly
  (a slow debugging path, used by the equality tests).

`install_context_attention(attn, apply_rotary)` patches one attention module of the target family
(Llama/Qwen/Mistral/Gemma 3, anything with q/k/v/o projections and optional q_norm/k_norm) so that
the decoder layer's own forward - its norms and MLP, whatever the family - runs unchanged while the
attention prepends the context K/V passed as `context_kv=(k, v)` and applies an explicit boolean
mask through `scaled_dot_product_attention`.

Shape legend: B = batch, T = context tokens, N = block tokens (blocks * G), G = block size,
Q = query heads, K = key/value heads, D = head dim, H = hidden, C = cached context entries.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


def packed_block_mask(context_seq_id_T: torch.Tensor, context_pos_T: torch.Tensor, block_seq_id_B: torch.Tensor,
                      anchor_pos_B: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dense boolean mask [N, T + N] (True = attend) for packed training, N = num_blocks * block_size."""
    num_blocks = block_seq_id_B.shape[0]
    sees_context_BT = ((context_seq_id_T[None, :] == block_seq_id_B[:, None])
                       & (context_pos_T[None, :] < anchor_pos_B[:, None]))
    sees_context_NT = sees_context_BT.repeat_interleave(block_size, dim=0)
    block_of_N = torch.arange(num_blocks, device=block_seq_id_B.device).repeat_interleave(block_size)
    same_block_NN = block_of_N[:, None] == block_of_N[None, :]
    return torch.cat([sees_context_NT, same_block_NN], dim=1)


TRAINING_ATTENTION = ("auto", "segmented", "flex", "dense")
SEGMENT_ROWS = 256  # query rows per segment of the "segmented" path (its own-block keys are O(rows))


def resolve_training_attention(mode: str, device: torch.device) -> str:
    if mode not in TRAINING_ATTENTION:
        raise ValueError(f"training_attention={mode!r} must be one of {TRAINING_ATTENTION}")
    if mode == "auto":
        return "flex" if device.type == "cuda" else "segmented"
    return mode


@dataclass(frozen=True)
class Segment:
    rows: slice  # block rows (queries) of consecutive blocks of one sequence
    keys: slice  # the context positions they may see (one sequence, up to the largest anchor)
    mask_RK: torch.Tensor  # boolean [rows, keys + rows]: context part by the rule, own part block-diagonal


@dataclass
class PackedBlocks:
    """Which keys each packed training block sees: the index form of `packed_block_mask` (module docstring).

    Passed to the draft layers as their `attention_mask`; `mode` is "segmented", "flex" or "dense". The
    derived structures (segments, flex BlockMask) are built once per batch and shared by every layer.
    """

    context_seq_id_T: torch.Tensor
    context_pos_T: torch.Tensor
    block_seq_id_B: torch.Tensor
    anchor_pos_B: torch.Tensor
    block_size: int
    mode: str = "segmented"
    _built: dict = field(default_factory=dict, repr=False)

    def dense_mask(self) -> torch.Tensor:
        if "dense" not in self._built:
            self._built["dense"] = packed_block_mask(self.context_seq_id_T, self.context_pos_T, self.block_seq_id_B,
                                                     self.anchor_pos_B, self.block_size)
        return self._built["dense"]

    def segments(self) -> list[Segment]:
        if "segments" not in self._built:
            self._built["segments"] = self._make_segments()
        return self._built["segments"]

    def _make_segments(self) -> list[Segment]:
        g = self.block_size
        seq_T = self.context_seq_id_T.tolist()
        start_of_seq: dict[int, int] = {}
        for t, seq in enumerate(seq_T):
            if seq not in start_of_seq:
                start_of_seq[seq] = t
            elif seq_T[t - 1] != seq:
                raise ValueError("packed context tokens of a sequence must be contiguous (context_seq_id_T)")
        seq_B, anchor_B = self.block_seq_id_B.tolist(), self.anchor_pos_B.tolist()
        blocks_per_segment = max(1, SEGMENT_ROWS // g)
        segments, first = [], 0
        device = self.context_seq_id_T.device
        while first < len(seq_B):
            last = first + 1
            while last < len(seq_B) and last - first < blocks_per_segment and seq_B[last] == seq_B[first]:
                last += 1
            start = start_of_seq.get(seq_B[first], 0)
            stop = start + max(anchor_B[first:last])  # the largest anchor: no block sees past it
            keys = slice(start, stop)
            rows = slice(first * g, last * g)
            # The rule on the gathered keys: the same sequence (guaranteed by the range) and pos < anchor.
            anchor_R = self.anchor_pos_B[first:last].repeat_interleave(g)
            sees_context_RK = self.context_pos_T[keys][None, :] < anchor_R[:, None]
            block_of_R = torch.arange(last - first, device=device).repeat_interleave(g)
            own_RR = block_of_R[:, None] == block_of_R[None, :]
            segments.append(Segment(rows, keys, torch.cat([sees_context_RK, own_RR], dim=1)))
            first = last
        return segments

    def flex_block_mask(self):
        if "flex" not in self._built:
            from torch.nn.attention.flex_attention import create_block_mask

            num_context, g = self.context_seq_id_T.shape[0], self.block_size
            ctx_seq_T, ctx_pos_T = self.context_seq_id_T, self.context_pos_T
            blk_seq_B, anchor_B = self.block_seq_id_B, self.anchor_pos_B

            def mask_mod(b, h, q_idx, kv_idx):
                block = q_idx // g
                ctx = kv_idx.clamp(max=num_context - 1)
                sees_context = ((kv_idx < num_context) & (ctx_seq_T[ctx] == blk_seq_B[block])
                                & (ctx_pos_T[ctx] < anchor_B[block]))
                sees_own = (kv_idx >= num_context) & ((kv_idx - num_context) // g == block)
                return sees_context | sees_own

            num_rows = blk_seq_B.shape[0] * g
            self._built["flex"] = create_block_mask(mask_mod, None, None, num_rows, num_context + num_rows,
                                                    device=ctx_seq_T.device)
        return self._built["flex"]


def cached_block_mask(visible_BC: torch.Tensor, block_size: int) -> torch.Tensor:
    """Boolean mask [B, 1, G, C + G] for one block per row over cached context + the block itself."""
    batch = visible_BC.shape[0]
    ctx_BGC = visible_BC[:, None, :].expand(batch, block_size, visible_BC.shape[1])
    own_BGG = torch.ones(batch, block_size, block_size, dtype=torch.bool, device=visible_BC.device)
    return torch.cat([ctx_BGC, own_BGG], dim=2)[:, None]


def _heads(x_BTX: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[B, T, heads*D] -> [B, heads, T, D]."""
    return x_BTX.view(*x_BTX.shape[:2], -1, head_dim).transpose(1, 2)


def _keys(attn: nn.Module, x_BTH: torch.Tensor) -> torch.Tensor:
    k_BKTD = _heads(attn.k_proj(x_BTH), attn.head_dim)
    k_norm = getattr(attn, "k_norm", None)
    return k_BKTD if k_norm is None else k_norm(k_BKTD)


def _rotate(apply_rotary: Callable, x_BXTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # apply_rotary rotates a (q, k) pair; rotating x as both costs one extra elementwise op.
    rotated, _ = apply_rotary(x_BXTD, x_BXTD, cos, sin)
    return rotated


def context_key_values(attn: nn.Module, context_BTH: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's keys/values of the fused context, after k-norm and RoPE at the context positions."""
    apply_rotary = attn._deepspec_apply_rotary
    k_BKTD = _rotate(apply_rotary, _keys(attn, context_BTH), cos, sin)
    v_BKTD = _heads(attn.v_proj(context_BTH), attn.head_dim)
    return k_BKTD, v_BKTD


def _attend(self: nn.Module, q_BQND: torch.Tensor, k_BKMD: torch.Tensor, v_BKMD: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA (or explicit soft-capped scores) of queries over keys with a boolean mask (True = attend).

    Grouped-query heads share their key/value head inside SDPA (`enable_gqa`): the same outputs as repeating the
    keys/values per query head, without saving the repeated copies for backward (at Qwen3 widths, 32 query heads
    over 8 key/value heads, they were 4x the keys/values of every attention call of a training step)."""
    dropout = self.attention_dropout if self.training else 0.0
    softcap = getattr(self, "attn_logit_softcapping", None)
    if softcap:
        # SDPA has no logit soft-capping: compute the scores explicitly (Gemma 2-style configs only).
        groups = q_BQND.shape[1] // k_BKMD.shape[1]
        k_BQMD = k_BKMD.repeat_interleave(groups, dim=1)
        v_BQMD = v_BKMD.repeat_interleave(groups, dim=1)
        scores = (q_BQND @ k_BQMD.transpose(-1, -2)) * self.scaling
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(q_BQND.dtype), p=dropout, training=self.training)
        return probs @ v_BQMD
    return F.scaled_dot_product_attention(q_BQND, k_BKMD, v_BKMD, attn_mask=mask, dropout_p=dropout,
                                          scale=self.scaling, enable_gqa=q_BQND.shape[1] != k_BKMD.shape[1])


_COMPILED_FLEX = {}


def _flex_attend(self: nn.Module, q_BQND: torch.Tensor, k_BKMD: torch.Tensor, v_BKMD: torch.Tensor,
                 layout: PackedBlocks) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if self.training and self.attention_dropout:
        raise ValueError("training_attention='flex' has no attention dropout; use 'segmented'")
    softcap = getattr(self, "attn_logit_softcapping", None)
    score_mod = None
    if softcap:
        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / softcap) * softcap
    attend = flex_attention
    if q_BQND.device.type == "cuda":  # eager flex attention is a slow reference path; compiled it is fused
        attend = _COMPILED_FLEX.setdefault("fn", torch.compile(flex_attention))
    return attend(q_BQND, k_BKMD, v_BKMD, score_mod=score_mod, block_mask=layout.flex_block_mask(),
                  scale=self.scaling, enable_gqa=q_BQND.shape[1] != k_BKMD.shape[1])


def _packed_attend(self: nn.Module, q_1QND: torch.Tensor, k_1KND: torch.Tensor, v_1KND: torch.Tensor,
                   context_kv: tuple[torch.Tensor, torch.Tensor], layout: PackedBlocks) -> torch.Tensor:
    """Training attention of packed blocks over [their sequence's context; their own block] (module docstring)."""
    ctx_k, ctx_v = context_kv
    ctx_k, ctx_v = ctx_k.to(k_1KND.dtype), ctx_v.to(v_1KND.dtype)
    if layout.mode == "segmented":
        outs = []
        for segment in layout.segments():
            rows, keys = segment.rows, segment.keys
            k_1KMD = torch.cat([ctx_k[:, :, keys], k_1KND[:, :, rows]], dim=2)
            v_1KMD = torch.cat([ctx_v[:, :, keys], v_1KND[:, :, rows]], dim=2)
            outs.append(_attend(self, q_1QND[:, :, rows], k_1KMD, v_1KMD, segment.mask_RK[None, None]))
        return torch.cat(outs, dim=2)
    k_1KMD, v_1KMD = torch.cat([ctx_k, k_1KND], dim=2), torch.cat([ctx_v, v_1KND], dim=2)
    if layout.mode == "flex":
        return _flex_attend(self, q_1QND, k_1KMD, v_1KMD, layout)
    if layout.mode == "dense":
        return _attend(self, q_1QND, k_1KMD, v_1KMD, layout.dense_mask()[None, None])
    raise ValueError(f"PackedBlocks.mode={layout.mode!r} must be one of {TRAINING_ATTENTION[1:]}")


def _context_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                               position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                               attention_mask: torch.Tensor | PackedBlocks | None = None,
                               context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                               **_ignored) -> tuple[torch.Tensor, None]:
    """Replacement forward of a family attention module (bound per instance).

    `attention_mask` is a boolean mask over [context; block] keys (inference, tests) or, in training, the
    packed blocks' `PackedBlocks` (then `context_kv` is the whole packed context)."""
    batch, num_tokens = hidden_states.shape[:2]
    q_BQND = _heads(self.q_proj(hidden_states), self.head_dim)
    q_norm = getattr(self, "q_norm", None)
    if q_norm is not None:
        q_BQND = q_norm(q_BQND)
    k_BKND = _keys(self, hidden_states)
    v_BKND = _heads(self.v_proj(hidden_states), self.head_dim)
    cos, sin = position_embeddings
    q_BQND, k_BKND = self._deepspec_apply_rotary(q_BQND, k_BKND, cos, sin)
    if isinstance(attention_mask, PackedBlocks):
        out_BQND = _packed_attend(self, q_BQND, k_BKND, v_BKND, context_kv, attention_mask)
    else:
        if context_kv is not None:
            ctx_k, ctx_v = context_kv
            if ctx_k.shape[0] != batch:  # one shared context for several blocks (e.g. tree/parity checks)
                ctx_k, ctx_v = ctx_k.expand(batch, -1, -1, -1), ctx_v.expand(batch, -1, -1, -1)
            k_BKND = torch.cat([ctx_k.to(k_BKND.dtype), k_BKND], dim=2)
            v_BKND = torch.cat([ctx_v.to(v_BKND.dtype), v_BKND], dim=2)
        mask = attention_mask if attention_mask is None or attention_mask.dim() == 4 else attention_mask[None, None]
        out_BQND = _attend(self, q_BQND, k_BKND, v_BKND, mask)
    out_BNX = out_BQND.transpose(1, 2).reshape(batch, num_tokens, -1)
    return self.o_proj(out_BNX), None


def install_context_attention(attn: nn.Module, apply_rotary: Callable) -> nn.Module:
    """Make `attn` (a family attention module) accept `context_kv` and explicit boolean masks.

    The module keeps its parameters and state-dict names; only its forward is rebound per instance
    (a bound method, so `copy.deepcopy` rebinds it to the copy).
    """
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"):
        if not hasattr(attn, name):
            raise ValueError(f"{type(attn).__name__} has no attribute {name!r}: not a supported attention module")
    attn._deepspec_apply_rotary = apply_rotary
    attn.forward = types.MethodType(_context_attention_forward, attn)
    return attn
