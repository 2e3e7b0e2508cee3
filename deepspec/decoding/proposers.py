"""Drafters seen from the decoding loop: one small `Proposer` adapter per drafter kind, and `make_proposer`.

Each adapter owns the drafter's per-request inference state and translates the loop's calls:
  * `reset(prompt, features, final_hidden)` - target outputs of the prompt (positions 0..T-1);
  * `propose(anchor, anchor_pos, sampling, generator)` - draft after the anchor (not yet in the
    target cache), drawing every draft token with `draft_sampler(sampling, generator)`;
  * `on_accept(tokens, features, final_hidden)` - target outputs of the previous anchor and the
    accepted drafts (positions anchor_pos..anchor_pos+n), i.e. the tokens whose target K/V were kept.

Block drafters (DSpark/DFlash) append the kept tokens' context K/V to their `ContextKVCache`; the block's
own K/V are never cached (DESIGN §11). Chain drafters (Eagle3, MTP) commit a target row t together
with the token that follows it (x[t+1]); the row of the newest kept token is committed at the next
`propose`, once its successor (the new anchor) is known.

The sampler is what makes verification lossless at T > 0: it returns the *processed* distribution
(`process_logits`: temperature, top-k, top-p) the token was drawn from, which `accept_draft` uses as p_d.
Greedy sampling returns argmax with probs None. Confidence is the drafter's calibrated conditional
survival c_k (`BlockDrafter.propose` already applies `config.calibration_temperatures`:
c = sigmoid(logit / T_k)); adapters pass it through untouched so a length policy can truncate.

Adapters are registered by drafter kind (`register_proposer`); shared code never branches on kinds.

Shape legend: B = 1 request, T = prompt tokens, N = kept tokens, K/G = draft tokens, F = feature width,
H = hidden, V = target vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from deepspec.decoding.proposal import DraftProposal, Proposer
from deepspec.decoding.sampling import SamplingParams, probs_from_logits

# (logits_BV, draft position) -> (token_B, probs_BV the token was drawn from, or None when greedy)
DraftSampler = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]

_PROPOSERS: dict[str, Callable[..., Proposer]] = {}


def register_proposer(*kinds: str):
    """Class decorator: the adapter builds proposers for drafters whose `config.drafter_kind` is in `kinds`."""

    def wrap(cls):
        for kind in kinds:
            _PROPOSERS[kind] = cls
        return cls

    return wrap


def registered_proposer_kinds() -> list[str]:
    return sorted(_PROPOSERS)


def draft_sampler(sampling: SamplingParams, generator: torch.Generator | None) -> DraftSampler:
    """The loop's SamplingParams as a drafter sampler callable (see module docstring)."""
    if sampling.is_greedy:
        def greedy(logits_BV: torch.Tensor, position: int):
            return logits_BV.argmax(dim=-1), None

        return greedy

    def sample(logits_BV: torch.Tensor, position: int):
        probs_BV = probs_from_logits(logits_BV, sampling)
        # Exponential race: argmax(p / E), E ~ Exp(1), is an exact sample from p (as sample_from_logits).
        noise_BV = torch.empty_like(probs_BV).exponential_(generator=generator)
        token_B = (probs_BV / noise_BV.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
        return token_B, probs_BV

    return sample


def _drafter_kind(drafter) -> str:
    kind = getattr(getattr(drafter, "config", None), "drafter_kind", None)
    if not isinstance(kind, str):
        raise ValueError(f"{type(drafter).__name__} has no config.drafter_kind: not a DeepSpec drafter")
    return kind


def make_proposer(drafter, target_model=None, **opts) -> Proposer:
    """A per-request `Proposer` for `drafter` (any registered kind).

    `target_model` (optional) is attached as the drafter's frozen embedding/LM head source if the
    drafter has none yet. Options: `num_draft_tokens` (drafts per round; block drafters: at most their
    block size, the block is truncated; chain drafters: chain length, default their trained depth).
    """
    kind = _drafter_kind(drafter)
    if kind not in _PROPOSERS:
        raise ValueError(f"no proposer adapter for drafter kind {kind!r}; known: {registered_proposer_kinds()}")
    if target_model is not None and getattr(drafter, "_target_parts", None) is None:
        drafter.attach_target(target_model)
    drafter.eval()
    return _PROPOSERS[kind](drafter, **opts)


def _check_num_draft(num_draft_tokens, default: int, limit: int | None, kind: str) -> int:
    if num_draft_tokens is None:
        return default
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be an int >= 1")
    if limit is not None and num_draft_tokens > limit:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the {kind} drafter's block size {limit}")
    return num_draft_tokens


@register_proposer("dspark", "dflash")
class BlockDrafterProposer:
    """DSpark/DFlash: one parallel block forward per round plus the (optional) sequential head."""

    def __init__(self, drafter, num_draft_tokens: int | None = None):
        block_size = drafter.config.block_size
        self.drafter = drafter
        self.max_tokens = _check_num_draft(num_draft_tokens, block_size, block_size, drafter.config.drafter_kind)
        self.cache = None
        self.next_position = 0  # absolute position of the next token whose context K/V will be appended

    def _append(self, features_NF: torch.Tensor) -> None:
        num = features_NF.shape[0]
        positions_1N = torch.arange(self.next_position, self.next_position + num, device=features_NF.device)[None]
        self.drafter.extend_context(self.cache, features_NF[None], positions_1N)
        self.next_position += num

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.cache = self.drafter.new_context_cache()
        self.next_position = 0
        self._append(features_TF)

    def propose(self, anchor_id: int, anchor_pos: int, sampling: SamplingParams, generator) -> DraftProposal:
        if anchor_pos != self.next_position:
            raise RuntimeError(f"anchor position {anchor_pos} but the drafter's context ends at {self.next_position}")
        device = self.cache.positions_BC.device
        block = self.drafter.propose(self.cache, torch.tensor([anchor_id], device=device),
                                     torch.tensor([anchor_pos], device=device), draft_sampler(sampling, generator))
        return DraftProposal(block.token_ids_BG, block.probs_BGV, block.confidence_BG).truncate(self.max_tokens)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        self._append(features_NF)


class ChainDrafterProposer(ABC):
    """Chain drafters (Eagle3, MTP): target rows are committed with the token that follows each of them.

    Subclasses pick the target tensor the drafter reads per row (`row_inputs`) and call its `propose`.
    """

    def __init__(self, drafter, num_draft_tokens: int | None = None):
        self.drafter = drafter
        self.max_tokens = _check_num_draft(num_draft_tokens, self.default_num_draft(drafter), None,
                                           drafter.config.drafter_kind)
        self.state = None
        self.pending_tokens_N: torch.Tensor | None = None  # kept tokens whose rows are not committed yet
        self.pending_rows_NX: torch.Tensor | None = None

    @staticmethod
    @abstractmethod
    def default_num_draft(drafter) -> int:
        """Drafts per round when the caller does not choose."""

    @staticmethod
    @abstractmethod
    def row_inputs(features_NF: torch.Tensor, final_hidden_NH: torch.Tensor) -> torch.Tensor:
        """The per-row target tensor this drafter reads."""

    @abstractmethod
    def draft(self, rows_1NX, next_tokens_1N, sampler):
        """Commit the rows and draft `self.max_tokens` tokens -> (AutoregressiveDraft, new state)."""

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.state = None
        self.pending_tokens_N = prompt_ids_T
        self.pending_rows_NX = self.row_inputs(features_TF, final_hidden_TH)

    def propose(self, anchor_id: int, anchor_pos: int, sampling: SamplingParams, generator) -> DraftProposal:
        if self.pending_tokens_N is None:
            raise RuntimeError("propose called twice without on_accept (or before reset)")
        anchor_1 = torch.tensor([anchor_id], device=self.pending_tokens_N.device)
        # Row t is committed with x[t+1]: the pending tokens shifted by one, closed by the anchor.
        next_tokens_1N = torch.cat([self.pending_tokens_N[1:], anchor_1])[None]
        draft, self.state = self.draft(self.pending_rows_NX[None], next_tokens_1N, draft_sampler(sampling, generator))
        self.pending_tokens_N = self.pending_rows_NX = None
        return DraftProposal(draft.token_ids_BK, draft.probs_BKV, None)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        self.pending_tokens_N = token_ids_N
        self.pending_rows_NX = self.row_inputs(features_NF, final_hidden_NH)


@register_proposer("eagle3")
class Eagle3Proposer(ChainDrafterProposer):
    """Eagle3 reads the fused target layer features of each row; the chain length defaults to its TTT depth."""

    @staticmethod
    def default_num_draft(drafter) -> int:
        return drafter.config.ttt_steps

    @staticmethod
    def row_inputs(features_NF, final_hidden_NH):
        return features_NF

    def draft(self, rows_1NX, next_tokens_1N, sampler):
        return self.drafter.propose(rows_1NX, next_tokens_1N, self.max_tokens, sampler, state=self.state)


@register_proposer("mtp")
class MTPProposer(ChainDrafterProposer):
    """MTP reads the target's final (post-norm) hidden of each row; the chain length defaults to D modules."""

    @staticmethod
    def default_num_draft(drafter) -> int:
        return drafter.config.num_mtp_modules

    @staticmethod
    def row_inputs(features_NF, final_hidden_NH):
        return final_hidden_NH

    def draft(self, rows_1NX, next_tokens_1N, sampler):
        return self.drafter.propose(rows_1NX, next_tokens_1N, sampler, num_draft=self.max_tokens, state=self.state)
