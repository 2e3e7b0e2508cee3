"""Target families: the transformers classes a drafter borrows from its target's architecture.

Draft layers are built from a family's own decoder-layer class (`family.decoder_layer_cls(config, layer_idx)`),
never from a hand-copied layer per family: the target's family by default, another one with `drafter.layer_family`
(`convert_text_config` turns the target's text config into that family's config at the target's widths).
Adding a family is one registry entry (model_type -> module) plus a tiny test config.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import AutoConfig, PretrainedConfig

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


def family_model_type(config_or_model_type: PretrainedConfig | str) -> str:
    """The registry key of a config's (or model_type's) family; the multimodal Gemma 3 wrapper is its text family."""
    model_type = config_or_model_type if isinstance(config_or_model_type, str) else config_or_model_type.model_type
    return "gemma3_text" if model_type == "gemma3" else model_type


def get_family(config_or_model_type: PretrainedConfig | str) -> TargetFamily:
    """Resolve the family of a target config (or a model_type string)."""
    model_type = family_model_type(config_or_model_type)
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


# What a converted config sets besides the widths, per family: draft layers attend over the whole context, so a
# family whose config defaults to a sliding window gets none.
_CONVERTED_SETTINGS: dict[str, dict[str, Any]] = {"mistral": {"sliding_window": None}}
# Families a config of another family is never converted into, and why.
_NOT_CONVERTED_INTO = {
    "gemma3_text": "Gemma 3 layers need settings only a Gemma 3 config defines (query_pre_attn_scalar, a sliding and "
                   "a full-attention RoPE table, the sliding window), which DeepSpec would have to invent for this "
                   "target; no serving engine builds Gemma 3 draft layers either",
}


def conversion_refusal(target_model_type: str, model_type: str) -> str | None:
    """Why a `target_model_type` text config cannot become a `model_type` one (None: it can, or it is the same)."""
    source, family = family_model_type(target_model_type), family_model_type(model_type)
    if source == family or family not in _NOT_CONVERTED_INTO:
        return None
    return (f"layer_family={model_type!r} for a {target_model_type} target: {_NOT_CONVERTED_INTO[family]}; set "
            f"drafter.layer_family to another family (e.g. qwen3 or llama), or null for the target's own")


def full_attention_rope(config: PretrainedConfig) -> dict[str, Any]:
    """The RoPE parameters of a config's full-attention layers (Gemma 3 keeps one set per layer type)."""
    rope = getattr(config, "rope_parameters", None)
    if not rope:
        raise ValueError(f"{config.model_type} config has no rope_parameters: cannot convert it to another family")
    return dict(rope.get("full_attention", rope))


def convert_text_config(target: PretrainedConfig, model_type: str) -> PretrainedConfig:
    """The target's text config as a `model_type` config at the target's widths: the config of draft layers of
    another family (`drafter.layer_family`). Its own family: the target's config, unchanged.

    Field by field: the widths (hidden, MLP, heads, key/value heads, head dim), RMSNorm eps, the full-attention
    RoPE parameters, max positions, vocabulary, depth (a drafter sets its own), init range, attention dropout and
    the special token ids come from the target. What makes the family is the family's own default: its activation,
    attention biases (Qwen2: q/k/v), q/k norms (Qwen3), norm form.
    """
    target = text_config(target)
    source, family = family_model_type(target), get_family(model_type).model_type
    if source == family:
        return copy.deepcopy(target)
    refusal = conversion_refusal(source, family)
    if refusal is not None:
        raise ValueError(refusal)
    heads = int(target.num_attention_heads)
    fields = {
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(target.hidden_size),
        "intermediate_size": int(target.intermediate_size),
        "num_hidden_layers": int(target.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(target, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(target, "head_dim", None) or int(target.hidden_size) // heads),
        "rms_norm_eps": float(target.rms_norm_eps),
        "rope_parameters": full_attention_rope(target),
        "max_position_embeddings": int(target.max_position_embeddings),
        "initializer_range": float(getattr(target, "initializer_range", 0.02)),
        "attention_dropout": float(getattr(target, "attention_dropout", 0.0)),
        "tie_word_embeddings": bool(getattr(target, "tie_word_embeddings", False)),
        "bos_token_id": getattr(target, "bos_token_id", None),
        "eos_token_id": getattr(target, "eos_token_id", None),
        "pad_token_id": getattr(target, "pad_token_id", None),
    }
    return AutoConfig.for_model(family, **fields, **_CONVERTED_SETTINGS.get(family, {}))


def cache_kwargs(module: torch.nn.Module, cache) -> dict[str, Any]:
    """The KV-cache keyword of a transformers model/layer forward: `cache=` in recent transformers 5.x,
    `past_key_values=` before (e.g. 5.17, still found on GPU images; later versions accept it only as a
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
