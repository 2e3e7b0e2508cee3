"""Capture the target features a drafter trains on, in one forward pass.

Returns, per token, the chosen layers' outputs concatenated (layer-id convention in
`deepspec.targets.layers`) and the final hidden state after the final norm, from which the frozen
LM head recomputes target probabilities later. Full-vocabulary logits are never computed here.

Shape legend: B = batch, T = tokens, H = hidden size, F = num_layers * H.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from deepspec.targets.family import text_config
from deepspec.targets.layers import validate_layer_ids


@dataclass
class TargetFeatures:
    features_BTF: torch.Tensor  # chosen layers' outputs, concatenated along the last dim
    final_hidden_BTH: torch.Tensor  # after the final norm


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The decoder-layer list of a causal LM (model.model.layers for every supported family)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected .model.layers)")
    return layers


@torch.no_grad()
def capture_features(model: PreTrainedModel, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None,
                     layer_ids: list[int]) -> TargetFeatures:
    """One forward of the target's decoder stack (no LM head), hooking the chosen layers' outputs.

    A forward hook on decoder layer l sees exactly `hidden_states[l + 1]` without keeping every
    layer's activations alive, which keeps memory flat in the number of layers.
    """
    num_layers = text_config(model.config).num_hidden_layers
    layer_ids = validate_layer_ids(layer_ids, num_layers)
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(layer_id: int):
        def hook(_module, _inputs, output):
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    handles = [layers[i].register_forward_hook(make_hook(i)) for i in layer_ids]
    try:
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        out = base(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    final_hidden_BTH = out.last_hidden_state
    if layer_ids:
        features_BTF = torch.cat([captured[i] for i in layer_ids], dim=-1)
    else:
        features_BTF = final_hidden_BTH.new_zeros(*final_hidden_BTH.shape[:2], 0)
    return TargetFeatures(features_BTF=features_BTF, final_hidden_BTH=final_hidden_BTH)


def lm_head_weight(model: PreTrainedModel) -> torch.Tensor:
    """The frozen LM head weight [V, H] (tied to the embedding for SmolLM2/Gemma)."""
    return model.get_output_embeddings().weight


def final_logit_softcapping(model: PreTrainedModel) -> float | None:
    """Gemma-style logit soft-capping that must be applied to target logits, if any."""
    return getattr(text_config(model.config), "final_logit_softcapping", None)
