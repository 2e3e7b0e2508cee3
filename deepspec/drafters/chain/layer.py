"""Running one family decoder layer of a chain drafter over a `DraftKVCache` with an explicit mask.

Chain drafters (Eagle3's midlayer, MTP's modules) reuse the draft family's decoder layer as it is; its own
attention appends the new keys/values to the cache (`cache.update`) and attends over everything stored,
masked by an explicit boolean [B, 1, Q, L] mask (SDPA).

Shape legend: B = batch, Q = new rows, L = keys (cached + new), H = hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from deepspec.decoding.kv_cache import DraftKVCache
from deepspec.targets.family import cache_kwargs


def run_family_layer(layer: nn.Module, hidden_BQH: torch.Tensor, position_embeddings, mask_B1QL: torch.Tensor,
                     cache: DraftKVCache, **layer_kwargs) -> torch.Tensor:
    """One family decoder layer with an explicit boolean mask over the cache's keys (+ the new ones).

    `layer_kwargs` reach the layer's attention module (transformers layers forward extra keyword
    arguments to `self_attn`).
    """
    out = layer(hidden_BQH, attention_mask=mask_B1QL, position_embeddings=position_embeddings,
                **cache_kwargs(layer, cache), use_cache=True, **layer_kwargs)
    return out[0] if isinstance(out, tuple) else out


def causal_rows_mask(first_row: int, num_rows: int, batch: int, num_keys: int, device) -> torch.Tensor:
    """[B, 1, Q, L] mask of rows first_row..first_row+Q-1 over keys 0..L-1 of one sequence: key <= row."""
    rows_Q = torch.arange(first_row, first_row + num_rows, device=device)
    keys_L = torch.arange(num_keys, device=device)
    return (keys_L[None, :] <= rows_Q[:, None]).expand(batch, 1, num_rows, num_keys)
