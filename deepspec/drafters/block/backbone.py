"""The DFlash/DSpark backbone: context fusion + family decoder layers with context injection + final norm.

Draft layers are the draft family's own decoder layers (`family.decoder_layer_cls`: the target's, or
`layer_family`), whose attention is patched once, family-agnostically, by `attention.install_context_attention`.
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
        self.input_fusion = None  # config.anchor_fusion == "latest_context" (block/config.py)
        if getattr(config, "anchor_fusion", "none") == "latest_context":
            self.embed_norm = family.make_norm(hidden, eps)
            self.input_fusion = nn.Linear(2 * hidden, hidden, bias=False)
        self.output_adapter = None  # config.output_adapter == "zero" (block/config.py)
        if getattr(config, "output_adapter", "none") == "zero":
            self.output_adapter = nn.Linear(hidden, hidden, bias=False)

    @torch.no_grad()
    def reset_input_fusion(self) -> None:
        """`W_in = [I, I]`: at the start a slot's input is its normed embedding plus the latest context."""
        if self.input_fusion is not None:
            hidden = self.input_fusion.out_features
            eye = torch.eye(hidden, dtype=self.input_fusion.weight.dtype, device=self.input_fusion.weight.device)
            self.input_fusion.weight.copy_(torch.cat([eye, eye], dim=1))

    @torch.no_grad()
    def reset_output_adapter(self) -> None:
        """The output adapter starts at zero: the backbone adds nothing to the draft logits until it learns to."""
        if self.output_adapter is not None:
            self.output_adapter.weight.zero_()

    @torch.no_grad()
    def set_final_norm_scale(self, scale: float) -> None:
        """Every channel of the final norm multiplies by `scale`, whatever the family stores (`x * w`, or Gemma's
        `x * (1 + w)`): the stored value is solved from the norm's output on a constant probe (normalised to ones, far
        above eps), which is affine in w."""
        weight = self.norm.weight
        probe = torch.full((1, weight.shape[0]), 1024.0, dtype=weight.dtype, device=weight.device)  # normalised: 1
        weight.zero_()
        at_zero = self.norm(probe).float()[0]
        weight.fill_(1.0)
        slope = self.norm(probe).float()[0] - at_zero
        weight.copy_(((scale - at_zero) / slope).to(weight.dtype))

    def fuse_inputs(self, embeds_BNH: torch.Tensor, latest_context_BNH: torch.Tensor | None) -> torch.Tensor:
        """The block's input: the embeddings, or with anchor fusion `W_in [norm(emb); H_ctx(a - 1)]` (zeros where
        a block has no earlier context)."""
        if self.input_fusion is None:
            return embeds_BNH
        if latest_context_BNH is None:
            raise ValueError("anchor_fusion=latest_context needs the fused context at the position before each anchor")
        return self.input_fusion(torch.cat([self.embed_norm(embeds_BNH), latest_context_BNH.to(embeds_BNH.dtype)], -1))

    def rope(self, like: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.family.rotary(self.rotary, like, positions_BT, "full_attention")

    def context_kv(self, features_BTF: torch.Tensor, positions_BT: torch.Tensor) -> KeyValues:
        """Fused context -> every layer's context K/V (k-norm + RoPE applied)."""
        return self.context_kv_of(self.fusion(features_BTF), positions_BT)

    def context_kv_of(self, context_BTH: torch.Tensor, positions_BT: torch.Tensor) -> KeyValues:
        """Every layer's context K/V of an already fused context `H_ctx`."""
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
        normed_BNH = self.norm(hidden_BNH)
        return normed_BNH if self.output_adapter is None else self.output_adapter(normed_BNH)
