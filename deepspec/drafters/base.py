"""What every drafter shares: its HF config base, the frozen target parts (embedding / LM head), draft-layer configs.

The target's embedding and LM head are shared with the drafter *frozen*. They are held outside the
module tree (`FrozenTargetParts`), so they are never parameters of the drafter: not in the
optimizer, not sharded by ZeRO, not in saved drafter weights. `attach_target` wires them in after
construction or `from_pretrained`.

Draft layers (`draft_layer_config`, `DrafterConfig.family`) are decoder layers of the target's family, or of
`layer_family` (`drafter.layer_family`): that family's layers at the target's widths
(`deepspec.targets.family.convert_text_config`). Serving engines build their draft layers from a fixed family
whatever the target (vLLM/SGLang DFlash and DSpark: Qwen3; SGLang EAGLE-3: Llama), so a drafter trained with
their family can be served on targets of another. Only the draft layers change: the frozen embedding / LM head
and the target features stay the target's. The target's own family is recorded as null.

Shape legend: B = batch, T = tokens, H = hidden, V = vocabulary, N = flattened rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from deepspec.targets.family import (
    TargetFamily,
    conversion_refusal,
    convert_text_config,
    family_model_type,
    get_family,
    supported_model_types,
    text_config,
)
from deepspec.targets.layers import LAYER_ID_CONVENTION


class DrafterConfig(PretrainedConfig):
    """Fields common to all drafters. Subclasses add their own and set `model_type`.

    `target_config` is the target's (text) config as a plain dict: draft layers are built from the decoder-layer
    class of the target's family (or of `layer_family`, converted: module docstring) with this config, so
    `config.json` stays plain JSON and `from_pretrained` works without the target's weights. `data_format`,
    `chat_template` and `chat_template_kwargs` are the rendering its training data had (the cache's,
    deepspec.data.rendering: chat or text, a template given in the target config, the template options):
    evaluation renders prompts the same way.
    """

    model_type = "deepspec_drafter"
    drafter_kind = "base"

    def __init__(self, target_config: dict | None = None, target_name: str = "", target_revision: str = "",
                 target_layer_ids: list[int] | None = None, layer_id_convention: str = LAYER_ID_CONVENTION,
                 num_draft_layers: int = 1, init_from_target: bool = False,
                 target_fingerprint: dict | None = None, chat_template_kwargs: dict | None = None,
                 data_format: str = "chat", chat_template: str | None = None,
                 prompt_lookup_acceptance: dict | None = None, layer_family: str | None = None, **kwargs):
        self.target_config = dict(target_config or {})
        self.layer_family = None if layer_family is None else str(layer_family)
        self.target_name = target_name
        self.target_revision = target_revision
        self.target_layer_ids = list(target_layer_ids or [])
        self.layer_id_convention = layer_id_convention
        self.num_draft_layers = int(num_draft_layers)
        self.init_from_target = bool(init_from_target)
        self.target_fingerprint = dict(target_fingerprint or {})
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.data_format = data_format
        self.chat_template = chat_template
        # Prompt lookup's acceptance on the calibration data (`deepspec calibrate`; decoding/lookup.py
        # LookupAcceptance): what lets decoding choose per round between prompt lookup and this drafter.
        self.prompt_lookup_acceptance = None if prompt_lookup_acceptance is None else dict(prompt_lookup_acceptance)
        super().__init__(**kwargs)
        target_type = family_model_type(self.target_config["model_type"]) if self.target_config else None
        self.layer_family = checked_layer_family(self.layer_family, target_type, self.init_from_target)

    # -- derived views of the target ---------------------------------------------------------
    @property
    def target_text_config(self) -> PretrainedConfig:
        if not self.target_config:
            raise ValueError(f"{type(self).__name__}.target_config is empty: build the config with the target's config")
        cfg = dict(self.target_config)
        model_type = cfg.pop("model_type")
        return AutoConfig.for_model(model_type, **cfg)

    @property
    def hidden_size(self) -> int:
        return int(self.target_config["hidden_size"])

    @property
    def target_vocab_size(self) -> int:
        return int(self.target_config["vocab_size"])

    @property
    def target_num_layers(self) -> int:
        return int(self.target_config["num_hidden_layers"])

    @property
    def draft_layer_family(self) -> str:
        """model_type of the draft layers' family: `layer_family`, else the target's."""
        return family_model_type(self.layer_family or self.target_config["model_type"])

    @property
    def family(self) -> TargetFamily:
        """The draft layers' family (the target's, or `layer_family`): its decoder layer, rotary embedding, norm."""
        return get_family(self.draft_layer_family)

    @property
    def draft_config_dict(self) -> dict:
        """The draft layers' config at the target's widths and depth, as a plain dict: the target's text config
        itself, or its conversion into `layer_family` (what engine layouts write as the draft layers' config)."""
        if self.layer_family is None:
            return copy.deepcopy(self.target_config)
        return target_config_dict(convert_text_config(self.target_text_config, self.layer_family))

    def complete_from_target(self, target) -> None:
        """Fill target-derived defaults from a `LoadedTarget` (e.g. the block drafters' mask token); none here."""


def checked_layer_family(layer_family: str | None, target_model_type: str | None,
                         init_from_target: bool = False) -> str | None:
    """`layer_family` validated: a family DeepSpec builds and, with the target's family known, one its config
    converts into, without `init_from_target` (which copies the target's layers). Returns None for the target's
    own family (one spelling of the default)."""
    choices = supported_model_types()
    if layer_family is not None and layer_family not in choices:
        raise ValueError(f"layer_family={layer_family!r} must be null (the target's family) or one of {choices}")
    if layer_family is None or target_model_type is None:
        return layer_family
    if layer_family == family_model_type(target_model_type):
        return None
    refusal = conversion_refusal(target_model_type, layer_family)
    if refusal is not None:
        raise ValueError(refusal)
    if init_from_target:
        raise ValueError(f"layer_family={layer_family!r} with init_from_target=True: the target's {target_model_type} "
                         f"layers cannot be copied into {layer_family} draft layers; set drafter.init_from_target="
                         "false, or drafter.layer_family=null for layers of the target's family")
    return layer_family


def target_config_dict(target_config: PretrainedConfig) -> dict:
    """The target's text config as a JSON-able dict (what drafter configs store)."""
    cfg = text_config(target_config).to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "quantization_config", "dtype",
                "torch_dtype", "auto_map"):
        cfg.pop(key, None)
    return cfg


def draft_layer_config(config: DrafterConfig, num_layers: int | None = None) -> PretrainedConfig:
    """Config for the draft decoder layers: the draft layers' family (`config.family`) at the target's
    widths, `num_layers` deep.

    Layer types (Gemma 3 sliding/full) are taken from the target's last layers' pattern truncated
    to the draft depth; attention runs through SDPA with explicit masks.
    """
    cfg = dict(config.draft_config_dict)
    cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    n = config.num_draft_layers if num_layers is None else num_layers
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None) is not None:
        # Draft layers attend over context + block explicitly; use full attention everywhere so a
        # sliding window never silently cuts the context.
        cfg.layer_types = ["full_attention"] * n
    cfg._attn_implementation = "sdpa"
    return cfg


@dataclass
class FrozenTargetParts:
    """The target's embedding module and LM head weight, shared read-only with a drafter."""

    embed_tokens: nn.Module  # the target's own module (Gemma scales by sqrt(H) inside it)
    lm_head_weight: torch.Tensor  # [V, H]
    final_logit_softcapping: float | None = None

    @classmethod
    def from_target(cls, model: PreTrainedModel, copies: dict | None = None) -> "FrozenTargetParts":
        """The parts of `model`; `copies` (a ZeRO-3 target's `frozen_copies`): its whole copies of them instead."""
        embed = model.get_input_embeddings() if copies is None else copies["input_embeddings"]
        embed.requires_grad_(False)
        head = model.get_output_embeddings().weight if copies is None else copies["lm_head_weight"]
        head.requires_grad_(False)
        softcap = getattr(text_config(model.config), "final_logit_softcapping", None)
        return cls(embed_tokens=embed, lm_head_weight=head, final_logit_softcapping=softcap)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def logits(self, hidden_NH: torch.Tensor, head_VH: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits of `hidden_NH`; `head_VH` restricts the head to some of its rows."""
        head_VH = self.lm_head_weight if head_VH is None else head_VH
        logits = hidden_NH @ head_VH.T.to(hidden_NH.dtype)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


class DrafterModel(PreTrainedModel):
    """Base class: holds the frozen target parts outside the module tree."""

    config_class = DrafterConfig
    base_model_prefix = "drafter"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        object.__setattr__(self, "_target_parts", None)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, then every tensor moved into its own fresh allocation.

        transformers memory-maps the safetensors file, so loaded tensors are views at arbitrary byte
        offsets of it. CPU BLAS kernels take other vector paths (another summation order) for
        unaligned rows, so the same weights computed last-bit differently from the model that was
        saved (seen with AVX2 kernels in the confidence head's 1-output Linear). Fresh, allocator-aligned
        storage makes a reloaded drafter run exactly the computation of the one it was saved from.
        """
        model = super().from_pretrained(*args, **kwargs)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.data = tensor.data.clone(memory_format=torch.contiguous_format)
        return model

    def attach_target(self, parts: FrozenTargetParts | PreTrainedModel) -> "DrafterModel":
        if isinstance(parts, PreTrainedModel):
            parts = FrozenTargetParts.from_target(parts)
        object.__setattr__(self, "_target_parts", parts)
        return self

    def initialize_from(self, target) -> None:
        """Weights a freshly built drafter takes from elsewhere (`build_drafter` calls it with the `LoadedTarget`):
        the target's layers with `init_from_target=True`; a kind that wraps a pretrained model loads it here."""
        if self.config.init_from_target:
            self.init_from_target_model(target.model)

    def init_from_target_model(self, target_model: PreTrainedModel) -> None:
        """Copy target weights into the drafter (`init_from_target=True`); kinds that can override this."""
        raise ValueError(f"drafter kind {self.config.drafter_kind!r} does not support init_from_target")

    @property
    def target_parts(self) -> FrozenTargetParts:
        parts = self._target_parts
        if parts is None:
            raise RuntimeError(f"{type(self).__name__}: call attach_target(target_model) before running the drafter")
        return parts

    def _init_weights(self, module: nn.Module) -> None:
        # RoPE tables are non-persistent buffers that from_pretrained re-initialises through this
        # hook: recompute them from the module's own config (a fresh module's buffers).
        if isinstance(module, self.config.family.rotary_cls):
            fresh = type(module)(config=module.config)
            for name, buffer in fresh.named_buffers():
                module.get_buffer(name).copy_(buffer)
            return
        std = getattr(self.config.target_text_config, "initializer_range", 0.02)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
        elif hasattr(module, "weight") and module.weight is not None and module.weight.ndim == 1:
            # RMSNorm families differ: Gemma stores (weight - 1) and initialises zeros, others ones.
            fill = 0.0 if "Gemma" in type(module).__name__ else 1.0
            nn.init.constant_(module.weight, fill)


def describe_params(model: nn.Module) -> dict[str, Any]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    parts = getattr(model, "_target_parts", None)
    if parts is not None:  # the shared target embedding/LM head (counted once when tied)
        shared = {t.data_ptr(): t.numel() for t in (parts.lm_head_weight, *parts.embed_tokens.parameters())}
        frozen += sum(shared.values())
    return {"trainable_params": trainable, "frozen_params": frozen}
