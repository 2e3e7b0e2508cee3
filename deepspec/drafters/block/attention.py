"""Block attention for DFlash/DSpark: the masks and the family-agnostic context-injecting attention.

Rule: a block attends bidirectionally within itself and to context positions strictly before its
anchor (of its own sequence); never to other blocks. Training packs many blocks of many sequences
into one row (keys = [all context tokens; all block tokens]); inference attends to a
`DraftKVCache` (deepspec.decoding.kv_cache) plus the block.

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

import torch
import torch.nn.functional as F
from torch import nn


def packed_block_mask(context_seq_id_T: torch.Tensor, context_pos_T: torch.Tensor, block_seq_id_B: torch.Tensor,
                      anchor_pos_B: torch.Tensor, block_size: int) -> torch.Tensor:
    """Dense boolean mask [N, T + N] (True = attend) for packed training, N = num_blocks * block_size."""
    num_blocks = block_seq_id_B.shape[0]
    sees_context_BT = (context_seq_id_T[None, :] == block_seq_id_B[:, None]) & (context_pos_T[None, :] < anchor_pos_B[:, None])
    sees_context_NT = sees_context_BT.repeat_interleave(block_size, dim=0)
    block_of_N = torch.arange(num_blocks, device=block_seq_id_B.device).repeat_interleave(block_size)
    same_block_NN = block_of_N[:, None] == block_of_N[None, :]
    return torch.cat([sees_context_NT, same_block_NN], dim=1)


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


def _context_attention_forward(self: nn.Module, hidden_states: torch.Tensor,
                               position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                               attention_mask: torch.Tensor | None = None,
                               context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                               **_ignored) -> tuple[torch.Tensor, None]:
    """Replacement forward of a family attention module (bound per instance)."""
    batch, num_tokens = hidden_states.shape[:2]
    q_BQND = _heads(self.q_proj(hidden_states), self.head_dim)
    q_norm = getattr(self, "q_norm", None)
    if q_norm is not None:
        q_BQND = q_norm(q_BQND)
    k_BKND = _keys(self, hidden_states)
    v_BKND = _heads(self.v_proj(hidden_states), self.head_dim)
    cos, sin = position_embeddings
    q_BQND, k_BKND = self._deepspec_apply_rotary(q_BQND, k_BKND, cos, sin)
    if context_kv is not None:
        ctx_k, ctx_v = context_kv
        if ctx_k.shape[0] != batch:  # one shared context for several blocks (e.g. tree/parity checks)
            ctx_k, ctx_v = ctx_k.expand(batch, -1, -1, -1), ctx_v.expand(batch, -1, -1, -1)
        k_BKND = torch.cat([ctx_k.to(k_BKND.dtype), k_BKND], dim=2)
        v_BKND = torch.cat([ctx_v.to(v_BKND.dtype), v_BKND], dim=2)
    groups = q_BQND.shape[1] // k_BKND.shape[1]
    k_BQND = k_BKND.repeat_interleave(groups, dim=1)
    v_BQND = v_BKND.repeat_interleave(groups, dim=1)
    mask = attention_mask if attention_mask is None or attention_mask.dim() == 4 else attention_mask[None, None]
    dropout = self.attention_dropout if self.training else 0.0
    softcap = getattr(self, "attn_logit_softcapping", None)
    if softcap:
        # SDPA has no logit soft-capping: compute the scores explicitly (Gemma 2-style configs only).
        scores = (q_BQND @ k_BQND.transpose(-1, -2)) * self.scaling
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = F.dropout(torch.softmax(scores.float(), dim=-1).to(q_BQND.dtype), p=dropout, training=self.training)
        out_BQND = probs @ v_BQND
    else:
        out_BQND = F.scaled_dot_product_attention(q_BQND, k_BQND, v_BQND, attn_mask=mask, dropout_p=dropout,
                                                  scale=self.scaling)
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
