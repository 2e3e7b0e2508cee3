"""The DFlash/DSpark backbone: context fusion + family decoder layers with context injection + final norm.

Draft layers are the target family's own decoder layers (`family.decoder_layer_cls`), whose
attention is patched once, family-agnostically, by `attention.install_context_attention`.
The layer's own forward (norms, MLP, Gemma 3's extra feed-forward norms) runs unchanged.

Shape legend: B = batch, T = context tokens, N = block tokens, F = num_layers * H, H = hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from deepspec.drafters.base import DrafterConfig, draft_layer_config
from deepspec.drafters.block.attention import (
    context_key_values,
    install_context_attention,
)
from deepspec.drafters.block.context import ContextFusion

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # per draft layer (k_BKTD, v_BKTD)


class BlockBackbone(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        family = config.family
        layer_config = draft_layer_config(config)
        hidden, eps = config.hidden_size, layer_config.rms_norm_eps
        self.family = family
        self.fusion = ContextFusion(len(config.target_layer_ids), hidden, family.make_norm(hidden, eps))
        self.layers = nn.ModuleList(family.decoder_layer_cls(layer_config, i) for i in range(config.num_draft_layers))
        for layer in self.layers:
            install_context_attention(layer.self_attn, family.apply_rotary)
        self.norm = family.make_norm(hidden, eps)
        self.rotary = family.rotary_cls(config=layer_config)

    def rope(self, like: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.family.rotary(self.rotary, like, positions_BT, "full_attention")

    def context_kv(self, features_BTF: torch.Tensor, positions_BT: torch.Tensor) -> KeyValues:
        """Fused context -> every layer's context K/V (k-norm + RoPE applied)."""
        context_BTH = self.fusion(features_BTF)
        cos, sin = self.rope(context_BTH, positions_BT)
        return [context_key_values(layer.self_attn, context_BTH, cos, sin) for layer in self.layers]

    def forward(self, embeds_BNH: torch.Tensor, positions_BN: torch.Tensor, context: KeyValues,
                mask: torch.Tensor) -> torch.Tensor:
        """Block hidden states after the final norm; `mask` is boolean [.., N, T + N] (context first)."""
        position_embeddings = self.rope(embeds_BNH, positions_BN)
        hidden_BNH = embeds_BNH
        for layer, context_kv in zip(self.layers, context):
            out = layer(hidden_BNH, attention_mask=mask, position_embeddings=position_embeddings,
                        position_ids=positions_BN, context_kv=context_kv)
            hidden_BNH = out[0] if isinstance(out, tuple) else out
        return self.norm(hidden_BNH)
