"""The target side of speculative decoding: KV-cached scoring of proposed prefixes, cropped exactly.

The verifier keeps the target's KV cache equal to the tokens whose K/V were kept so far. The
anchor (last emitted token) is never in the cache when a round starts: `verify([anchor, d1..dK])`
appends K+1 entries and returns K+1 next-token logits; after acceptance the loop calls
`keep(n + 1)` to drop the K - n rejected entries. Features of the chosen layers (and the final
hidden state) of the scored tokens are returned for drafters that read target context.

Shape legend: B = 1 request, T = tokens, V = vocabulary, F = feature width, H = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from deepspec.targets.family import cache_kwargs, text_config
from deepspec.targets.features import LayerOutputHooks, decoder_stack, target_logits

__all__ = ["ScoredTokens", "TargetVerifier", "target_logits"]


@dataclass
class ScoredTokens:
    logits_BTV: torch.Tensor  # float32 next-token logits after each scored token
    features_BTF: torch.Tensor
    final_hidden_BTH: torch.Tensor


class TargetVerifier:
    def __init__(self, model: PreTrainedModel, layer_ids: list[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self.cache: DynamicCache | None = None
        layer_types = getattr(text_config(model.config), "layer_types", None) or []
        self._sliding = any(t == "sliding_attention" for t in layer_types)

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        if self._sliding and hasattr(self.cache, "activate_past_recording"):
            # Sliding-window layers must remember past states to allow cropping after a rejection.
            self.cache.activate_past_recording()

    @torch.no_grad()
    def score(self, token_ids_BT: torch.Tensor) -> ScoredTokens:
        """Append `token_ids_BT` to the cache and return their next-token logits and features."""
        if self.cache is None:
            self.reset()
        with LayerOutputHooks(self.model, self.layer_ids) as hooks:
            stack = decoder_stack(self.model)
            out = stack(input_ids=token_ids_BT, **cache_kwargs(stack, self.cache), use_cache=True)
            hidden_BTH = out.last_hidden_state
            features_BTF = hooks.features(hidden_BTH)
        return ScoredTokens(target_logits(self.model, hidden_BTH), features_BTF, hidden_BTH)

    def keep(self, num_scored: int, num_keep: int) -> None:
        """After scoring `num_scored` tokens, keep the K/V of the first `num_keep` of them."""
        drop = num_scored - num_keep
        if drop < 0:
            raise ValueError(f"cannot keep {num_keep} of {num_scored} scored tokens")
        if drop:
            self.cache.crop(-drop)
