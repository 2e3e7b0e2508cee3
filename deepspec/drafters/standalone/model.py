"""Standalone drafter: a separate causal LM that drafts autoregressively with its own KV cache.

`self.lm` is the draft language model, built from `config.lm_config` with transformers' own classes (any
family a wrapped model comes from):
- own embedding and head (a wrapped model, or a built one with `share_target_embeddings=False`): the causal-LM
  class (`AutoModelForCausalLM`), so its state dict is that class's layout and its ties are its own;
- shared target embedding and head (built): the decoder stack only (`AutoModel`, its embedding removed: built
  with a one-row placeholder, then dropped); tokens enter as the target's embeddings (through `embed_proj` when
  the widths differ) and logits leave through the target's frozen LM head (after `head_proj`).
Either way `logits()` covers the *target's* vocabulary: a wrapped model whose embedding matrix has more rows
than the tokenizer has tokens (padding rows) is cut to the target's vocabulary, one with fewer gets -inf
logits there (never drafted).

Training (`sequence_hidden`): packed rows (chain/batching.py) under a block-diagonal causal mask with per-sequence
positions; row t predicts x[t+1]. Inference: `proposer.py` drives `hidden_states` over a batched KV cache.

Shape legend: B = rows, T = tokens, W = draft width, H = target hidden, V = target vocabulary, X = any rows.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from deepspec.drafters.base import DrafterModel
from deepspec.drafters.chain.batching import packed_causal_mask
from deepspec.drafters.standalone.config import StandaloneConfig
from deepspec.losses.distribution import head_logits
from deepspec.targets.family import cache_kwargs

UNSUPPORTED_LOGIT_TRANSFORMS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


def lm_text_config(lm_config: dict) -> PretrainedConfig:
    """The draft LM's transformers config (SDPA attention: training passes explicit boolean masks)."""
    fields = dict(lm_config)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    return config


class StandaloneDrafter(DrafterModel):
    config_class = StandaloneConfig

    def __init__(self, config: StandaloneConfig):
        super().__init__(config)
        if config.lm_config is None:
            raise ValueError("StandaloneConfig.lm_config is empty: build the drafter with build_drafter('standalone', "
                             "target, ...) (it fills the draft LM's config from the target or the base model)")
        lm_config = lm_text_config(config.lm_config)
        present = [name for name in UNSUPPORTED_LOGIT_TRANSFORMS
                   if getattr(lm_config, name, None) not in (None, 1, 1.0)]
        if present:
            raise ValueError(f"draft model {config.base_model or lm_config.model_type!r} scales its logits "
                             f"({present}): not supported by the standalone drafter's logits and losses")
        cls = AutoModel if config.share_target_embeddings else AutoModelForCausalLM
        self.lm = cls.from_config(lm_config, attn_implementation="sdpa")
        if config.share_target_embeddings:
            self.lm.set_input_embeddings(None)  # the one-row placeholder: tokens enter as the target's embeddings
        if config.projects_embeddings:  # a shared target embedding/head of another width
            self.embed_proj = nn.Linear(config.hidden_size, config.draft_width, bias=False)
            self.head_proj = nn.Linear(config.draft_width, config.hidden_size, bias=False)
        self.post_init()

    # -- pieces ----------------------------------------------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        """The draft LM's decoder stack (embedding, layers, final norm)."""
        return self.lm if self.config.share_target_embeddings else self.lm.base_model

    def embed(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """Input embeddings [B, T, W] (the draft's own, or the target's through `embed_proj`)."""
        if not self.config.share_target_embeddings:
            return self.decoder.get_input_embeddings()(ids_BT)
        embeds_BTH = self.target_parts.embed(ids_BT).to(self.dtype)
        return self.embed_proj(embeds_BTH) if self.config.projects_embeddings else embeds_BTH

    def head(self, hidden_XW: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden rows, head weight [Vd, .]) whose product are the logits (before soft-capping / vocab fit)."""
        if not self.config.share_target_embeddings:
            return hidden_XW, self.lm.get_output_embeddings().weight
        rows = self.head_proj(hidden_XW) if self.config.projects_embeddings else hidden_XW
        return rows, self.target_parts.lm_head_weight

    @property
    def logit_softcap(self) -> float | None:
        if self.config.share_target_embeddings:
            return self.target_parts.final_logit_softcapping
        return getattr(self.lm.config, "final_logit_softcapping", None)

    def logits(self, hidden_XW: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary."""
        rows, head_VW = self.head(hidden_XW)
        logits_XV = head_logits(rows, head_VW)
        if self.logit_softcap:
            logits_XV = torch.tanh(logits_XV / self.logit_softcap) * self.logit_softcap
        return fit_vocabulary(logits_XV, self.config.target_vocab_size)

    def hidden_states(self, embeds_BTW: torch.Tensor, attention_mask: torch.Tensor, position_ids_BT: torch.Tensor,
                      cache=None) -> torch.Tensor:
        """The draft LM's last hidden states (after its final norm) [B, T, W]."""
        out = self.decoder(inputs_embeds=embeds_BTW, attention_mask=attention_mask, position_ids=position_ids_BT,
                           **cache_kwargs(self.decoder, cache), use_cache=cache is not None)
        return out.last_hidden_state

    # -- training ----------------------------------------------------------------------------------
    def sequence_hidden(self, input_ids_BT: torch.Tensor, sequence_ids_BT: torch.Tensor,
                        position_ids_BT: torch.Tensor) -> torch.Tensor:
        """Hidden states of packed rows: each token attends to the earlier tokens of its own sequence."""
        return self.hidden_states(self.embed(input_ids_BT), packed_causal_mask(sequence_ids_BT), position_ids_BT)

    # -- initialisation ------------------------------------------------------------------------------
    def initialize_from(self, target) -> None:
        """A wrapped drafter loads its base model's weights (like targets are loaded); a built one may copy the
        target's layers (`init_from_target`)."""
        if not self.config.base_model:
            super().initialize_from(target)
            return
        from deepspec.targets.load import load_target

        source = load_target(self.config.base_model, dtype=target.model.dtype, device="cpu",
                             revision=self.config.base_model_revision)
        missing, unexpected = self.lm.load_state_dict(source.model.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"drafter.base_model={self.config.base_model!r}: its weights do not fit its config "
                             f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")

    @torch.no_grad()
    def init_from_target_model(self, target_model) -> None:
        """Copy target layers `config.default_init_layers()` and the final norm into the draft layers (and the
        embedding/head into an own, same-width one)."""
        from deepspec.targets.features import decoder_layers, decoder_stack

        target_layers = decoder_layers(target_model)
        for draft_layer, index in zip(self.decoder.layers, self.config.default_init_layers()):
            draft_layer.load_state_dict(target_layers[index].state_dict())
        self.decoder.norm.load_state_dict(decoder_stack(target_model).norm.state_dict())
        if not self.config.share_target_embeddings:
            self.decoder.get_input_embeddings().weight.copy_(target_model.get_input_embeddings().weight)
            self.lm.get_output_embeddings().weight.copy_(target_model.get_output_embeddings().weight)


def fit_vocabulary(logits_XV: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over exactly `vocab_size` ids: extra (padding) rows cut, missing ids at -inf."""
    have = logits_XV.shape[-1]
    if have == vocab_size:
        return logits_XV
    if have > vocab_size:
        return logits_XV[..., :vocab_size]
    pad = logits_XV.new_full((*logits_XV.shape[:-1], vocab_size - have), float("-inf"))
    return torch.cat([logits_XV, pad], dim=-1)
