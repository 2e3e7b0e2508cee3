"""Target context for block drafters: fusion of the target's layer features (paper eq. 2).

`ContextFusion` is paper eq. 2: `H_ctx = RMSNorm(W_c [H(l1); ...; H(lm)])`, computed once per
token. In every draft layer the context's keys/values are that layer's own `k_proj/v_proj` of
`H_ctx` (+ its `k_norm` where the family has one) with RoPE at the context positions
(`attention.context_key_values`). At inference those per-layer K/V are computed once per
accepted token and kept in a `deepspec.decoding.kv_cache.DraftKVCache`; the block's own K/V are never cached.

Shape legend: B = batch, C = cached context tokens, T = tokens, F = num_layers * H, H = hidden,
K = key/value heads, D = head dim.
"""

from __future__ import annotations

import torch
from torch import nn


class ContextFusion(nn.Module):
    """`H_ctx = norm(W_c features)`: projects the concatenated target layers to the hidden size."""

    def __init__(self, num_feature_layers: int, hidden_size: int, norm: nn.Module):
        super().__init__()
        if num_feature_layers < 1:
            raise ValueError("a block drafter needs at least one target feature layer (target_layer_ids is empty)")
        self.num_feature_layers = num_feature_layers
        self.proj = nn.Linear(num_feature_layers * hidden_size, hidden_size, bias=False)
        self.norm = norm

    def forward(self, features_BTF: torch.Tensor) -> torch.Tensor:
        if features_BTF.shape[-1] != self.proj.in_features:
            raise ValueError(f"context features have width {features_BTF.shape[-1]}, expected "
                             f"{self.proj.in_features} (= {self.num_feature_layers} layers x hidden)")
        return self.norm(self.proj(features_BTF))
