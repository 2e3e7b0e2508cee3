"""Eagle3 drafter: fused target features + one family decoder layer over [embedding; hidden], trained with TTT.

Architecture (SGLang `LlamaForCausalLMEagle3` / SpecForge semantics, family-agnostic):
- `fc: Linear(m*H -> H)` fuses the chosen target layers (`config.target_layer_ids`, "output of layer l").
- `midlayer`: ONE decoder layer of the draft family (the target's, or `layer_family`) whose q/k/v projections
  take 2H inputs: attention reads `[input_layernorm(embedding); hidden_norm(hidden)]` (embedding first), while the
  layer's residual stays on the H-wide *hidden* stream (residual = hidden), exactly like SGLang's Eagle3 midlayer.
  Reusing the family layer's own forward keeps each family's norm placement (Gemma 3 post-norms, Qwen3 q/k norms)
  without per-family copies: `install_eagle3_inputs` makes the layer's `input_layernorm` pass the hidden
  stream through unchanged and its attention take the embedding as an explicit keyword argument
  (`eagle3_embeds`, which transformers layers forward to `self_attn`) and build the 2H input itself.
  State-dict keys match SGLang: `midlayer.input_layernorm.weight` (the embedding norm),
  `midlayer.hidden_norm.weight`, `midlayer.self_attn.*`, ...
- `norm` (final norm) then the head: with a reduced draft vocabulary an own trainable
  `lm_head: Linear(H -> Vd)` (initialised from the target's head rows of the kept ids); with the full
  vocabulary the target's frozen LM head (no head parameters). `d2t`/`t2d` are persistent buffers,
  saved with the model (draft_vocab.py holds their semantics).
Drafter logits are never soft-capped (training and inference agree).

Training-time test (TTT), row convention. Rows are indexed by the target position t of the feature:
  step 0, row t: hidden = fc(features[t]), token = x[t+1], predicts x[t+2];
  step s, row t: hidden = the drafter's own output (pre-final-norm) of step s-1 at row t,
                 token = x[t+1+s], predicts x[t+2+s]; RoPE position = pos(t) + s.
So step s at row t is what inference computes for the (s+1)-th draft after the target's row t: the
hidden input comes from the drafter's previous step (one token further along), never from the
target feature of position t+s. Attention at step s (explicit boolean mask, SDPA): keys are the
concatenation [step-0 keys (T) | step-1 keys (T) | ... | step-s keys (T)]; row t attends to step-0
keys of rows j <= t of its own sequence (causal, packed) and, for each step 1..s, only to that step's
key at row t (the TTT "diagonal"). That is exactly the key set a chain draft sees at inference:
committed context keys plus its own earlier draft keys.

Inference (`propose`): the drafter keeps its own `DraftKVCache` of committed step-0 rows (target positions
whose next token is accepted; `new_decode_state()`); draft keys are appended during a round and cropped
afterwards.

Shape legend: B = batch, T = tokens, N = new rows, K = draft tokens, H = hidden, F = m*H,
V = target vocab, Vd = draft vocab, Q/L = query/key lengths.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import nn

from deepspec.decoding.kv_cache import DraftKVCache
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.sampling import DraftSampler
from deepspec.drafters.base import DrafterModel, draft_layer_config
from deepspec.drafters.chain.batching import packed_causal_mask, shift_within_sequence
from deepspec.drafters.chain.layer import causal_rows_mask, run_family_layer
from deepspec.drafters.draft_vocab import DraftVocabMixin
from deepspec.drafters.eagle3.config import Eagle3Config


@dataclass
class Eagle3DecodeState:
    cache: DraftKVCache = field(default_factory=DraftKVCache)
    num_committed: int = 0  # target positions whose step-0 keys are in the cache


def widen_attention_inputs(attention: nn.Module, in_features: int) -> None:
    """Re-create q/k/v projections with `in_features` inputs on whatever attention module the family built."""
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name)
        setattr(attention, name, nn.Linear(in_features, old.out_features, bias=old.bias is not None,
                                           dtype=old.weight.dtype))


def _pass_hidden_through(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
    """The midlayer's `input_layernorm` on the hidden stream: Eagle3 normalises inside attention instead."""
    return hidden_BTH


def _eagle3_attention_forward(self, hidden_states: torch.Tensor, *args, eagle3_embeds: torch.Tensor | None = None,
                              **kwargs):
    """The family attention over `[input_layernorm(embedding); hidden_norm(hidden)]` (2H, embedding first)."""
    if eagle3_embeds is None:
        raise ValueError("Eagle3 midlayer called without eagle3_embeds= (use Eagle3Drafter.layer_forward)")
    embed_norm, hidden_norm = self._eagle3_embed_norm, self._eagle3_hidden_norm
    fused_BTX = torch.cat([type(embed_norm).forward(embed_norm, eagle3_embeds), hidden_norm(hidden_states)], dim=-1)
    return type(self).forward(self, fused_BTX, *args, **kwargs)


def install_eagle3_inputs(layer: nn.Module) -> None:
    """Rebind (per instance) the layer's input norm and attention forwards for Eagle3's 2H attention input.

    Parameters and state-dict names are unchanged; the forwards are bound methods, so `copy.deepcopy`
    rebinds them to the copy, and the norms are plain attributes the copy also gets.
    """
    object.__setattr__(layer.self_attn, "_eagle3_embed_norm", layer.input_layernorm)
    object.__setattr__(layer.self_attn, "_eagle3_hidden_norm", layer.hidden_norm)
    layer.input_layernorm.forward = types.MethodType(_pass_hidden_through, layer.input_layernorm)
    layer.self_attn.forward = types.MethodType(_eagle3_attention_forward, layer.self_attn)


class Eagle3Drafter(DraftVocabMixin, DrafterModel):
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        family = config.family
        layer_config = draft_layer_config(config, 1)
        hidden = config.hidden_size
        eps = getattr(layer_config, "rms_norm_eps", 1e-6)
        self.fc = nn.Linear(len(config.target_layer_ids) * hidden, hidden, bias=False)
        self.midlayer = family.decoder_layer_cls(layer_config, 0)
        widen_attention_inputs(self.midlayer.self_attn, 2 * hidden)
        self.midlayer.hidden_norm = family.make_norm(hidden, eps)
        install_eagle3_inputs(self.midlayer)
        self.norm = family.make_norm(hidden, eps)
        self.rotary_emb = family.rotary_cls(config=layer_config)
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.register_draft_vocab(config)  # identity until set_draft_vocab: draft id i = target id i
            self.register_buffer("draft_head_initialized", torch.zeros((), dtype=torch.bool))
        else:
            self.lm_head = None
        self.post_init()

    # -- vocabulary --------------------------------------------------------------------------
    def on_draft_vocab_set(self) -> None:
        """A new vocabulary re-initialises the draft head from the target's rows (now, or when attached)."""
        self.draft_head_initialized.fill_(False)
        if self._target_parts is not None:
            self._init_draft_head_from_target()

    def attach_target(self, parts) -> Eagle3Drafter:
        super().attach_target(parts)
        if self.reduced_vocab and not bool(self.draft_head_initialized):
            self._init_draft_head_from_target()
        return self

    @torch.no_grad()
    def _init_draft_head_from_target(self) -> None:
        # A fresh draft head starts as the target's head restricted to the kept ids (a loaded one is kept).
        rows = self.target_parts.lm_head_weight.index_select(0, self.target_vocab_index().to(self.d2t.device))
        self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
        self.draft_head_initialized.fill_(True)

    def draft_head_weight(self) -> torch.Tensor:
        """[Vd, H] trainable head, or the frozen target head [V, H] with the full vocabulary."""
        return self.lm_head.weight if self.reduced_vocab else self.target_parts.lm_head_weight

    def draft_logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd] (V with the full vocabulary) from pre-norm drafter hidden states."""
        return self.norm(hidden_NH) @ self.draft_head_weight().T.to(hidden_NH.dtype)

    def target_vocab_logits(self, hidden_NH: torch.Tensor) -> torch.Tensor:
        """Logits over the TARGET vocabulary, -inf outside the draft vocabulary (what samplers/verifiers use)."""
        logits = self.draft_logits(hidden_NH)
        if not self.reduced_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), float("-inf"))
        full[..., self.target_vocab_index()] = logits
        return full

    # -- the layer -------------------------------------------------------------------------
    def layer_forward(self, embeds_BQH: torch.Tensor, hidden_BQH: torch.Tensor, position_ids_BQ: torch.Tensor,
                      mask_B1QL: torch.Tensor, cache: DraftKVCache) -> torch.Tensor:
        """The midlayer on [emb; hidden] queries against cache keys + the new keys; returns pre-norm hidden."""
        position_embeddings = self.config.family.rotary(self.rotary_emb, hidden_BQH, position_ids_BQ, "full_attention")
        return run_family_layer(self.midlayer, hidden_BQH, position_embeddings, mask_B1QL, cache,
                                eagle3_embeds=embeds_BQH.to(hidden_BQH.dtype))

    def fuse_features(self, features_BTF: torch.Tensor) -> torch.Tensor:
        return self.fc(features_BTF.to(self.fc.weight.dtype))

    # -- training ----------------------------------------------------------------------------
    def ttt_forward(self, input_ids_BT: torch.Tensor, features_BTF: torch.Tensor, sequence_ids_BT: torch.Tensor,
                    position_ids_BT: torch.Tensor, num_steps: int | None = None) -> list[torch.Tensor]:
        """Unrolled TTT; returns the pre-norm hidden [B, T, H] of every step (row convention: module doc)."""
        num_steps = self.config.ttt_steps if num_steps is None else int(num_steps)
        num_tokens = input_ids_BT.shape[1]
        context_mask_B1TT = packed_causal_mask(sequence_ids_BT)
        diagonal_B1TT = torch.eye(num_tokens, dtype=torch.bool, device=input_ids_BT.device).expand_as(context_mask_B1TT)
        hidden_BTH = self.fuse_features(features_BTF)
        cache = DraftKVCache()
        step_hidden: list[torch.Tensor] = []
        for step in range(num_steps):
            tokens_BT, _ = shift_within_sequence(input_ids_BT, sequence_ids_BT, 1 + step,
                                                 self.config.pad_token_id_for_shift)
            embeds_BTH = self.target_parts.embed(tokens_BT)
            mask_B1TL = torch.cat([context_mask_B1TT] + [diagonal_B1TT] * step, dim=-1)
            hidden_BTH = self.layer_forward(embeds_BTH, hidden_BTH, position_ids_BT + step, mask_B1TL, cache)
            step_hidden.append(hidden_BTH)
        return step_hidden

    # -- inference ---------------------------------------------------------------------------
    def new_decode_state(self) -> Eagle3DecodeState:
        return Eagle3DecodeState()

    @torch.no_grad()
    def propose(self, state: Eagle3DecodeState, features_BNF: torch.Tensor, next_token_ids_BN: torch.Tensor,
                sampler: DraftSampler, num_draft: int | None = None) -> DraftProposal:
        """Draft `num_draft` tokens (default: `ttt_steps`) after committing N new target rows.

        `features_BNF`: target features of the N newly committed positions c..c+N-1 (c = state.num_committed;
        all rows of the batch advance together); `next_token_ids_BN`: the accepted token that follows each
        of them (x[c+1..c+N], the last one being the target's newest token). Returns target-vocab tokens and
        probs; the cache keeps only the committed rows afterwards.
        """
        num_draft = self.config.ttt_steps if num_draft is None else int(num_draft)
        if num_draft < 1:
            raise ValueError(f"num_draft={num_draft} must be >= 1")
        if features_BNF.shape[:2] != next_token_ids_BN.shape or features_BNF.shape[1] < 1:
            raise ValueError(f"features_BNF {tuple(features_BNF.shape)} and next_token_ids_BN "
                             f"{tuple(next_token_ids_BN.shape)} must share [B, N] with N >= 1")
        batch, num_new = next_token_ids_BN.shape
        start = state.num_committed
        device = next_token_ids_BN.device
        positions_N = torch.arange(start, start + num_new, device=device)
        mask_B1NL = causal_rows_mask(start, num_new, batch, start + num_new, device)
        hidden_BNH = self.layer_forward(self.target_parts.embed(next_token_ids_BN), self.fuse_features(features_BNF),
                                        positions_N.expand(batch, num_new), mask_B1NL, state.cache)
        state.num_committed = start + num_new
        hidden_B1H = hidden_BNH[:, -1:]
        last_position = start + num_new - 1
        tokens, probs = [], []
        for k in range(num_draft):
            token_B, probs_BV = sampler(self.target_vocab_logits(hidden_B1H[:, 0]), k)
            tokens.append(token_B)
            probs.append(probs_BV)
            if k == num_draft - 1:
                break
            # Draft k+1: the drafter's own hidden + the sampled token, one position further (TTT step k+1).
            length = state.cache.get_seq_length()
            mask_B11L = torch.ones(batch, 1, 1, length + 1, dtype=torch.bool, device=device)
            position_B1 = torch.full((batch, 1), last_position + k + 1, device=device, dtype=torch.long)
            hidden_B1H = self.layer_forward(self.target_parts.embed(token_B[:, None]), hidden_B1H, position_B1,
                                            mask_B11L, state.cache)
        state.cache.crop(state.num_committed)
        probs_BKV = None if any(p is None for p in probs) else torch.stack(probs, dim=1)
        return DraftProposal(torch.stack(tokens, dim=1), probs_BKV)
