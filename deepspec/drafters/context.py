"""Target context for block drafters: fusion of the target's layer features, and the inference K/V cache.

`ContextFusion` is paper eq. 2: `H_ctx = RMSNorm(W_c [H(l1); ...; H(lm)])`, computed once per
token. In every draft layer the context's keys/values are that layer's own `k_proj/v_proj` of
`H_ctx` (+ its `k_norm` where the family has one) with RoPE at the context positions
(`block_attention.context_key_values`). At inference those per-layer K/V are computed once per
accepted token and kept in a `ContextKVCache`; the block's own K/V are never cached.

Shape legend: B = batch, C = cached context tokens, T = tokens, F = num_layers * H, H = hidden,
K = key/value heads, D = head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class ContextKVCache:
    """Per-draft-layer context keys/values of the accepted tokens, after k-norm and RoPE.

    All rows hold the same number of entries C; `positions_BC` are the tokens' absolute positions
    and `valid_BC` marks real entries (rows of a batch may advance by different counts). A block with
    anchor position a attends to entries with `valid & position < a`.
    """

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [B, K, C, D]
    values: list[torch.Tensor] = field(default_factory=list)  # per layer [B, K, C, D]
    positions_BC: torch.Tensor | None = None
    valid_BC: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.positions_BC is None else int(self.positions_BC.shape[1])

    def append(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions_BC: torch.Tensor,
               valid_BC: torch.Tensor) -> None:
        if self.positions_BC is None:
            self.keys, self.values = list(keys), list(values)
            self.positions_BC, self.valid_BC = positions_BC.clone(), valid_BC.clone()
            return
        if positions_BC.shape[0] != self.positions_BC.shape[0]:
            raise ValueError(f"batch size {positions_BC.shape[0]} differs from the cache's {self.positions_BC.shape[0]}")
        self.keys = [torch.cat([old, new], dim=2) for old, new in zip(self.keys, keys)]
        self.values = [torch.cat([old, new], dim=2) for old, new in zip(self.values, values)]
        self.positions_BC = torch.cat([self.positions_BC, positions_BC], dim=1)
        self.valid_BC = torch.cat([self.valid_BC, valid_BC], dim=1)

    def crop(self, length: int) -> None:
        """Keep the first `length` entries (drop context of rejected tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length {length} must lie in [0, {self.length}]")
        if self.positions_BC is None:
            return
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]
        self.positions_BC = self.positions_BC[:, :length]
        self.valid_BC = self.valid_BC[:, :length]

    def visible_BC(self, anchor_pos_B: torch.Tensor) -> torch.Tensor:
        """Which cached entries a block anchored at `anchor_pos_B` may attend to."""
        if self.positions_BC is None:
            return torch.zeros(anchor_pos_B.shape[0], 0, dtype=torch.bool, device=anchor_pos_B.device)
        return self.valid_BC & (self.positions_BC < anchor_pos_B[:, None])
