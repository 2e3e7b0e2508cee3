"""Target families: the transformers classes a drafter borrows from its target's architecture.

Draft layers are built from the target family's own decoder-layer class
(`family.decoder_layer_cls(config, layer_idx)`), never from a hand-copied layer per family.
Adding a family is one registry entry (model_type -> module) plus a tiny test config.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import PretrainedConfig

# model_type -> (transformers modeling module, class-name prefix). Gemma 3 text-only checkpoints
# report model_type "gemma3_text" but live in the gemma3 module.
_FAMILY_MODULES: dict[str, tuple[str, str]] = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "gemma3_text": ("transformers.models.gemma3.modeling_gemma3", "Gemma3"),
}


@dataclass(frozen=True)
class TargetFamily:
    """The pieces of one architecture family that drafters reuse."""

    model_type: str
    decoder_layer_cls: type[torch.nn.Module]  # (config, layer_idx) -> layer
    rotary_cls: type[torch.nn.Module]  # (config) -> rotary embedding module
    norm_cls: type[torch.nn.Module]  # (hidden_size, eps) -> RMSNorm of the family
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, cos, sin) -> (q, k)
    rotary_takes_layer_type: bool  # Gemma 3: separate sliding/full-attention RoPE tables

    def make_norm(self, hidden_size: int, eps: float) -> torch.nn.Module:
        return self.norm_cls(hidden_size, eps=eps)

    def rotary(self, rotary_module: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor,
               layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for `position_ids` [B, T]; layer_type only matters for Gemma 3."""
        if self.rotary_takes_layer_type:
            return rotary_module(x, position_ids, layer_type or "full_attention")
        return rotary_module(x, position_ids)


def supported_model_types() -> list[str]:
    return sorted(_FAMILY_MODULES)


def get_family(config_or_model_type: PretrainedConfig | str) -> TargetFamily:
    """Resolve the family of a target config (or a model_type string)."""
    model_type = config_or_model_type if isinstance(config_or_model_type, str) else config_or_model_type.model_type
    if model_type == "gemma3":  # multimodal wrapper: drafters use its text config
        model_type = "gemma3_text"
    if model_type not in _FAMILY_MODULES:
        raise ValueError(
            f"target model_type {model_type!r} is not supported by DeepSpec drafters; "
            f"supported: {', '.join(supported_model_types())}"
        )
    module_name, prefix = _FAMILY_MODULES[model_type]
    module = importlib.import_module(module_name)
    rotary_cls = getattr(module, f"{prefix}RotaryEmbedding")
    return TargetFamily(
        model_type=model_type,
        decoder_layer_cls=getattr(module, f"{prefix}DecoderLayer"),
        rotary_cls=rotary_cls,
        norm_cls=getattr(module, f"{prefix}RMSNorm"),
        apply_rotary=module.apply_rotary_pos_emb,
        rotary_takes_layer_type=model_type == "gemma3_text",
    )


def cache_kwargs(module: torch.nn.Module, cache) -> dict[str, Any]:
    """The KV-cache keyword of a transformers model/layer forward: `cache=` in recent transformers 5.x,
    `past_key_values=` before (e.g. 5.17, as on the GPU machine; later versions accept it only as a
    deprecated alias). Passing the wrong one is silently swallowed by `**kwargs`: no cache is used."""
    return {_cache_keyword(type(module)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(module_cls: type) -> str:
    return "cache" if "cache" in inspect.signature(module_cls.forward).parameters else "past_key_values"


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder config of a target (multimodal wrappers keep it under `text_config`)."""
    return getattr(config, "text_config", None) or config


def describe(config: PretrainedConfig) -> dict[str, Any]:
    cfg = text_config(config)
    return {
        "model_type": cfg.model_type,
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
    }
