"""Eagle3 drafter: fused target features + one family decoder layer over [embedding; hidden], trained with TTT.

Architecture (SGLang `LlamaForCausalLMEagle3` / SpecForge semantics, family-agnostic):
- `fc: Linear(m*H -> H)` fuses the chosen target layers (`config.target_layer_ids`, "output of layer l").
- `midlayer`: ONE decoder layer of the target's family whose q/k/v projections take 2H inputs. Its
  `input_layernorm` is re-classed so it returns `[input_layernorm(embedding); hidden_norm(hidden)]`
  (embedding first), while the layer's residual stays on the H-wide *hidden* stream (residual = hidden),
  exactly like SGLang's Eagle3 midlayer. Reusing the family layer's own forward keeps each family's
  norm placement (Gemma 3 post-norms, Qwen3 q/k norms) without per-family copies. State-dict keys match
  SGLang: `midlayer.input_layernorm.weight`, `midlayer.hidden_norm.weight`, `midlayer.self_attn.*`, ...
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

Inference (`propose`): the drafter keeps its own KV cache of committed step-0 rows (target positions
whose next token is accepted); draft keys are appended during a round and cropped afterwards.

Shape legend: B = batch, T = tokens, N = new rows, K = draft tokens, H = hidden, F = m*H,
V = target vocab, Vd = draft vocab, Q/L = query/key lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from deepspec.drafters.base import (
    DrafterConfig,
    DrafterModel,
    draft_layer_config,
    register_drafter,
)
from deepspec.drafters.batching_autoregressive import (
    packed_causal_mask,
    shift_within_sequence,
)
from deepspec.drafters.draft_vocab import check_draft_vocab, kept_target_ids
from deepspec.targets.family import cache_kwargs
from deepspec.targets.layers import default_feature_layers, validate_layer_ids

# (logits_BV over the target vocab, draft index k) -> (token_B target ids, probs_BV or None)
Sampler = Callable[[torch.Tensor, int], tuple[torch.Tensor, "torch.Tensor | None"]]


class DraftKVCache:
    """Append-only K/V store per layer: the `cache` object transformers' attention modules call `update` on.

    Lets the family's own attention run over extra keys (TTT steps, committed context) with SDPA and an
    explicit mask; `crop(n)` drops speculative keys after a draft round.
    """

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx in self.keys:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key_states], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value_states], dim=-2)
        else:
            self.keys[layer_idx], self.values[layer_idx] = key_states, value_states
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        """Keys stored for `layer_idx` (default: any layer; all layers of one cache advance together)."""
        if layer_idx is None:
            layer_idx = next(iter(self.keys), None)
        return int(self.keys[layer_idx].shape[-2]) if layer_idx in self.keys else 0

    def crop(self, length: int) -> None:
        for layer_idx in list(self.keys):
            self.keys[layer_idx] = self.keys[layer_idx][..., :length, :]
            self.values[layer_idx] = self.values[layer_idx][..., :length, :]


@dataclass
class AutoregressiveDraft:
    """One round of chain drafting: tokens in the TARGET vocabulary, probs over the target vocabulary."""

    token_ids_BK: torch.Tensor
    probs_BKV: torch.Tensor | None  # zero outside the draft vocabulary; None for a greedy sampler
    confidence_BK: None = None  # autoregressive drafters have no confidence head


@dataclass
class Eagle3DecodeState:
    cache: DraftKVCache = field(default_factory=DraftKVCache)
    num_committed: int = 0  # target positions whose step-0 keys are in the cache


def run_family_layer(layer: nn.Module, hidden_BQH: torch.Tensor, position_embeddings, mask_B1QL: torch.Tensor,
                     cache: DraftKVCache) -> torch.Tensor:
    """One family decoder layer with an explicit boolean mask over the cache's keys (+ the new ones)."""
    out = layer(hidden_BQH, attention_mask=mask_B1QL, position_embeddings=position_embeddings,
                **cache_kwargs(layer, cache), use_cache=True)
    return out[0] if isinstance(out, tuple) else out


def widen_attention_inputs(attention: nn.Module, in_features: int) -> None:
    """Re-create q/k/v projections with `in_features` inputs on whatever attention module the family built."""
    for name in ("q_proj", "k_proj", "v_proj"):
        old = getattr(attention, name)
        setattr(attention, name, nn.Linear(in_features, old.out_features, bias=old.bias is not None,
                                           dtype=old.weight.dtype))


_FUSED_NORM_CLASSES: dict[type, type] = {}


def fused_input_norm_class(norm_cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of the family norm returning `[norm(pending embedding); hidden_norm(hidden)]` (2H)."""
    if norm_cls not in _FUSED_NORM_CLASSES:
        def forward(self, hidden_BTH):
            embeds_BTH = self._pending_embedding
            if embeds_BTH is None:
                raise RuntimeError("Eagle3 midlayer called without an embedding (use Eagle3Drafter.layer_forward)")
            return torch.cat([norm_cls.forward(self, embeds_BTH), self._hidden_norm(hidden_BTH)], dim=-1)

        _FUSED_NORM_CLASSES[norm_cls] = type(f"Eagle3Fused{norm_cls.__name__}", (norm_cls,), {"forward": forward})
    return _FUSED_NORM_CLASSES[norm_cls]


class Eagle3Config(DrafterConfig):
    """Eagle3 drafter config: TTT depth and decay, optional reduced draft vocabulary."""

    model_type = "deepspec_eagle3"
    drafter_kind = "eagle3"

    def __init__(self, ttt_steps: int = 7, ttt_decay: float = 0.8, draft_vocab_size: int | None = None,
                 pad_token_id_for_shift: int = 0, **kwargs):
        self.ttt_steps = int(ttt_steps)
        self.ttt_decay = float(ttt_decay)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.pad_token_id_for_shift = int(pad_token_id_for_shift)  # embedded past a sequence end (never scored)
        super().__init__(**kwargs)
        if self.target_config and not self.target_layer_ids:
            self.target_layer_ids = default_feature_layers(self.target_num_layers, "eagle3")
        self.validate_architecture()

    def validate_architecture(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"eagle3.ttt_steps={self.ttt_steps} must be >= 1")
        if not self.ttt_decay > 0:
            raise ValueError(f"eagle3.ttt_decay={self.ttt_decay} must be > 0")
        if self.num_draft_layers != 1:
            raise ValueError(f"eagle3.num_draft_layers={self.num_draft_layers}: Eagle3 has exactly one draft layer")
        if self.target_config:
            validate_layer_ids(self.target_layer_ids, self.target_num_layers, "eagle3.target_layer_ids")
            if not self.target_layer_ids:
                raise ValueError("eagle3.target_layer_ids must name at least one target layer")
            if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.target_vocab_size:
                raise ValueError(f"eagle3.draft_vocab_size={self.draft_vocab_size} must be in "
                                 f"[1, {self.target_vocab_size}] (or None for the full vocabulary)")


@register_drafter("eagle3")
class Eagle3Drafter(DrafterModel):
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
        norm = self.midlayer.input_layernorm
        norm.__class__ = fused_input_norm_class(type(norm))
        object.__setattr__(norm, "_hidden_norm", self.midlayer.hidden_norm)
        object.__setattr__(norm, "_pending_embedding", None)
        self.norm = family.make_norm(hidden, eps)
        self.rotary_emb = family.rotary_cls(config=layer_config)
        if config.draft_vocab_size is not None:
            vocab_d = config.draft_vocab_size
            self.lm_head = nn.Linear(hidden, vocab_d, bias=False)
            # Identity until set_draft_vocab: draft id i = target id i.
            self.register_buffer("d2t", torch.zeros(vocab_d, dtype=torch.long))
            t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
            t2d[:vocab_d] = True
            self.register_buffer("t2d", t2d)
            self.register_buffer("draft_head_initialized", torch.zeros((), dtype=torch.bool))
        else:
            self.lm_head = None
        self.post_init()

    # -- vocabulary --------------------------------------------------------------------------
    @property
    def reduced_vocab(self) -> bool:
        return self.lm_head is not None

    def target_vocab_index(self) -> torch.Tensor | None:
        """Target id of each draft id (LongTensor [Vd]), or None with the full vocabulary."""
        return kept_target_ids(self.d2t) if self.reduced_vocab else None

    def set_draft_vocab(self, d2t_Vd: torch.Tensor, t2d_V: torch.Tensor) -> None:
        """Install `build_draft_vocab` buffers; re-initialises the draft head from the target if attached."""
        if not self.reduced_vocab:
            raise ValueError("set_draft_vocab: this Eagle3 drafter uses the full vocabulary (draft_vocab_size=None)")
        if d2t_Vd.shape != self.d2t.shape or t2d_V.shape != self.t2d.shape:
            raise ValueError(f"d2t/t2d shapes {tuple(d2t_Vd.shape)}/{tuple(t2d_V.shape)} do not match "
                             f"draft_vocab_size={self.d2t.shape[0]} / target vocab {self.t2d.shape[0]}")
        check_draft_vocab(d2t_Vd, t2d_V.bool())
        self.d2t.copy_(d2t_Vd.long())
        self.t2d.copy_(t2d_V.bool())
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
        norm = self.midlayer.input_layernorm
        object.__setattr__(norm, "_pending_embedding", embeds_BQH.to(hidden_BQH.dtype))
        try:
            return run_family_layer(self.midlayer, hidden_BQH, position_embeddings, mask_B1QL, cache)
        finally:
            object.__setattr__(norm, "_pending_embedding", None)

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
            tokens_BT, _ = shift_within_sequence(input_ids_BT, sequence_ids_BT, 1 + step, self.config.pad_token_id_for_shift)
            embeds_BTH = self.target_parts.embed(tokens_BT)
            mask_B1TL = torch.cat([context_mask_B1TT] + [diagonal_B1TT] * step, dim=-1)
            hidden_BTH = self.layer_forward(embeds_BTH, hidden_BTH, position_ids_BT + step, mask_B1TL, cache)
            step_hidden.append(hidden_BTH)
        return step_hidden

    # -- inference ---------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, features_BNF: torch.Tensor, next_token_ids_BN: torch.Tensor, num_draft: int, sampler: Sampler,
                state: Eagle3DecodeState | None = None) -> tuple[AutoregressiveDraft, Eagle3DecodeState]:
        """Draft `num_draft` tokens after committing N new target rows.

        `features_BNF`: target features of the N newly committed positions c..c+N-1 (c = state.num_committed;
        all rows of the batch advance together); `next_token_ids_BN`: the accepted token that follows each
        of them (x[c+1..c+N], the last one being the target's newest token). Returns target-vocab tokens and
        probs; the cache keeps only the committed rows afterwards.
        """
        if num_draft < 1:
            raise ValueError(f"num_draft={num_draft} must be >= 1")
        if features_BNF.shape[:2] != next_token_ids_BN.shape or features_BNF.shape[1] < 1:
            raise ValueError(f"features_BNF {tuple(features_BNF.shape)} and next_token_ids_BN "
                             f"{tuple(next_token_ids_BN.shape)} must share [B, N] with N >= 1")
        state = state if state is not None else Eagle3DecodeState()
        batch, num_new = next_token_ids_BN.shape
        start = state.num_committed
        device = next_token_ids_BN.device
        positions_N = torch.arange(start, start + num_new, device=device)
        keys_L = torch.arange(start + num_new, device=device)
        mask_B1NL = (keys_L[None, :] <= positions_N[:, None]).expand(batch, 1, num_new, start + num_new)
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
        return AutoregressiveDraft(token_ids_BK=torch.stack(tokens, dim=1), probs_BKV=probs_BKV), state


def greedy_sampler(logits_BV: torch.Tensor, position: int) -> tuple[torch.Tensor, None]:
    """Argmax over the (target-vocab) logits; no probabilities (greedy verification needs none)."""
    return logits_BV.argmax(dim=-1), None


def multinomial_sampler(generator: torch.Generator, temperature: float = 1.0) -> Sampler:
    """Seeded sampling at `temperature`; returns the probabilities it sampled from."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")

    def sample(logits_BV: torch.Tensor, position: int):
        probs_BV = torch.softmax(logits_BV.float() / temperature, dim=-1)
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(1), probs_BV

    return sample
