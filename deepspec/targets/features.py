"""Capture the target features a drafter trains on, in one forward pass.

Returns, per token, the chosen layers' outputs concatenated (layer-id convention in
`deepspec.targets.layers`) and the final hidden state after the final norm, from which the frozen
LM head recomputes target probabilities later. Full-vocabulary logits are never stored: only their
log-normaliser per token (`log_normalizer`, 4 bytes), which lets a reduced draft vocabulary compute the
target's probabilities of its own tokens from those rows of the head alone, p_t(v) = exp(h.w_v - lse).

Shape legend: B = batch, T = tokens, H = hidden size, F = num_layers * H, V = vocabulary, C = rows of a chunk.
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
    layers = getattr(decoder_stack(model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected .model.layers)")
    return layers


class LayerOutputHooks:
    """Context manager that records the outputs of chosen decoder layers during any forward.

    A forward hook on decoder layer l sees exactly `hidden_states[l + 1]` without keeping every
    layer's activations alive. Used by the cache writer and by KV-cached verification alike.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: list[int]):
        num_layers = text_config(model.config).num_hidden_layers
        self.layer_ids = validate_layer_ids(layer_ids, num_layers)
        self._layers = decoder_layers(model)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> "LayerOutputHooks":
        def make_hook(layer_id: int):
            def hook(_module, _inputs, output):
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
            return hook

        self._handles = [self._layers[i].register_forward_hook(make_hook(i)) for i in self.layer_ids]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def features(self, like_BTH: torch.Tensor) -> torch.Tensor:
        """Concatenated outputs of the last forward, [B, T, num_layers * H]."""
        if not self.layer_ids:
            return like_BTH.new_zeros(*like_BTH.shape[:2], 0)
        return torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)


def decoder_stack(model: PreTrainedModel) -> torch.nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


@torch.no_grad()
def capture_features(model: PreTrainedModel, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None,
                     layer_ids: list[int]) -> TargetFeatures:
    """One forward of the target's decoder stack (no LM head) recording the chosen layers' outputs."""
    with LayerOutputHooks(model, layer_ids) as hooks:
        out = decoder_stack(model)(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
        final_hidden_BTH = out.last_hidden_state
        features_BTF = hooks.features(final_hidden_BTH)
    return TargetFeatures(features_BTF=features_BTF, final_hidden_BTH=final_hidden_BTH)


def lm_head_weight(model: PreTrainedModel) -> torch.Tensor:
    """The frozen LM head weight [V, H] (tied to the embedding for SmolLM2/Gemma)."""
    return model.get_output_embeddings().weight


def final_logit_softcapping(model: PreTrainedModel) -> float | None:
    """Gemma-style logit soft-capping that must be applied to target logits, if any."""
    return getattr(text_config(model.config), "final_logit_softcapping", None)


def head_logits(hidden_CH: torch.Tensor, head_VH: torch.Tensor) -> torch.Tensor:
    """fp32 ``hidden @ head.T``, multiplied in the wider of the two dtypes: a bf16 drafter reads the frozen
    head of a target that may be kept in fp32 (never round the target's head down to the drafter's dtype)."""
    dtype = torch.promote_types(hidden_CH.dtype, head_VH.dtype)
    return (hidden_CH.to(dtype) @ head_VH.to(dtype).T).float()


@torch.no_grad()
def log_normalizer(final_hidden_TH: torch.Tensor, head_VH: torch.Tensor, softcap: float | None = None,
                   chunk_rows: int = 512) -> torch.Tensor:
    """logsumexp over the whole vocabulary of the target logits `head_logits(final_hidden, head)` (soft-capped
    when the target caps them), float32 [T]; `chunk_rows` rows at a time so [T, V] never exists at once.

    Pass the final hidden state *as stored* (e.g. rounded to bf16): the normaliser is then exactly the one of
    the logits the training losses recompute from the cache."""
    out_T = torch.empty(final_hidden_TH.shape[0], dtype=torch.float32, device=final_hidden_TH.device)
    for start in range(0, final_hidden_TH.shape[0], chunk_rows):
        logits_CV = head_logits(final_hidden_TH[start:start + chunk_rows], head_VH)
        if softcap:
            logits_CV = torch.tanh(logits_CV / softcap) * softcap
        out_T[start:start + chunk_rows] = torch.logsumexp(logits_CV, dim=-1)
    return out_T


def target_log_normalizer(model: PreTrainedModel, final_hidden_TH: torch.Tensor) -> torch.Tensor:
    """`log_normalizer` with the target's own LM head and soft-capping."""
    return log_normalizer(final_hidden_TH, lm_head_weight(model), final_logit_softcapping(model))
