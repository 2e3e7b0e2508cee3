"""Reduced draft vocabulary (Eagle3, DFlash, DSpark): choose the kept target ids, build SGLang/vLLM `d2t` / `t2d`.

Semantics (identical to SGLang's and vLLM's Eagle3 loaders, so exported buffers work unchanged):
- the kept target ids are sorted ascending; draft id `i` stands for target id `kept[i]`;
- `d2t` (LongTensor [Vd]) holds OFFSETS, not absolute ids: `d2t[i] = kept[i] - i`, so
  `target_id = draft_id + d2t[draft_id]`;
- `t2d` (BoolTensor [V]) marks the kept target ids: `t2d[kept[i]] = True`.
Counts come from assistant tokens only (the cache's loss_mask), the tokens a drafter is asked to
predict; special tokens (eos, bos, pad, ...) are always kept so a draft can end a turn.

Drafters with `config.draft_vocab_size` mix in `DraftVocabMixin` (the d2t/t2d buffers, identity until
`set_draft_vocab`) and name `prepare_draft_vocabulary` as their spec's `prepare_for_training`: the
vocabulary is built from the training split before step 1 and saved with the weights (a resumed run
reloads it).

Shape legend: V = target vocabulary, Vd = draft vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


def count_assistant_tokens(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Token counts [V] over the assistant (loss-mask) tokens of cached samples.

    `samples` yields objects with `input_ids` [T] and `loss_mask` [T] (e.g. `CachedSample`s of a cache reader).
    """
    counts_V = torch.zeros(vocab_size, dtype=torch.long)
    for index, sample in enumerate(samples):
        ids_T = torch.as_tensor(sample.input_ids).long().reshape(-1)
        mask_T = torch.as_tensor(sample.loss_mask).bool().reshape(-1)
        if ids_T.shape != mask_T.shape:
            raise ValueError(f"sample {index}: input_ids {tuple(ids_T.shape)} and "
                             f"loss_mask {tuple(mask_T.shape)} differ")
        kept_T = ids_T[mask_T]
        if kept_T.numel() and (int(kept_T.min()) < 0 or int(kept_T.max()) >= vocab_size):
            raise ValueError(f"sample {index}: token ids must lie in [0, {vocab_size})")
        counts_V += torch.bincount(kept_T, minlength=vocab_size)
    return counts_V


def build_draft_vocab(token_counts, draft_vocab_size: int, *, vocab_size: int | None = None,
                      always_keep: Iterable[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent tokens (plus `always_keep`) as `(d2t [Vd] offsets, t2d [V] bool)`.

    `token_counts` is a count tensor [V] or an iterable of cached samples (counted over their loss mask;
    then `vocab_size` is required). Ties break toward the lower id; ids in `always_keep` (special/eos
    tokens) take precedence over frequency.
    """
    if isinstance(token_counts, torch.Tensor):
        counts_V = token_counts.long().reshape(-1)
        if vocab_size is not None and counts_V.shape[0] != vocab_size:
            raise ValueError(f"token_counts has {counts_V.shape[0]} entries but vocab_size={vocab_size}")
    else:
        if vocab_size is None:
            raise ValueError("build_draft_vocab: vocab_size is required when counting from cached samples")
        counts_V = count_assistant_tokens(token_counts, vocab_size)
    num_vocab = counts_V.shape[0]
    if int(draft_vocab_size) != draft_vocab_size or not 1 <= draft_vocab_size <= num_vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size!r} must be an integer in [1, {num_vocab}]")
    special = sorted({int(i) for i in always_keep})
    for token in special:
        if not 0 <= token < num_vocab:
            raise ValueError(f"always_keep id {token} is outside the vocabulary [0, {num_vocab})")
    if len(special) > draft_vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} is smaller than the {len(special)} always-kept tokens")
    # Rank by count (descending), ties by id (ascending): stable sort on -count keeps id order.
    order_V = torch.sort(-counts_V, stable=True).indices
    keep_V = torch.zeros(num_vocab, dtype=torch.bool)
    keep_V[special] = True
    remaining = draft_vocab_size - len(special)
    candidates = order_V[~keep_V[order_V]]
    keep_V[candidates[:remaining]] = True
    kept_Vd = torch.nonzero(keep_V).squeeze(1)  # ascending target ids
    d2t_Vd = kept_Vd - torch.arange(kept_Vd.shape[0])
    return d2t_Vd, keep_V


def kept_target_ids(d2t_Vd: torch.Tensor) -> torch.Tensor:
    """Absolute target ids of the draft vocabulary, `arange(Vd) + d2t` (LongTensor [Vd])."""
    return torch.arange(d2t_Vd.shape[0], device=d2t_Vd.device) + d2t_Vd.long()


def draft_to_target(draft_ids: torch.Tensor, d2t_Vd: torch.Tensor) -> torch.Tensor:
    """Map draft-vocabulary ids to target ids: `ids + d2t[ids]` (any shape)."""
    draft_ids = draft_ids.long()
    if draft_ids.numel() and (int(draft_ids.min()) < 0 or int(draft_ids.max()) >= d2t_Vd.shape[0]):
        raise ValueError(f"draft ids must lie in [0, {d2t_Vd.shape[0]})")
    return draft_ids + d2t_Vd.long()[draft_ids]


def target_to_draft(target_ids: torch.Tensor, t2d_V: torch.Tensor, check_values: bool = True) -> torch.Tensor:
    """Map target ids to draft ids; ids outside the draft vocabulary map to -1 (any shape). `check_values=False`
    skips the range check (a host sync): for ids already checked, e.g. a training step's labels."""
    target_ids = target_ids.long()
    if check_values and target_ids.numel() and (int(target_ids.min()) < 0 or int(target_ids.max()) >= t2d_V.shape[0]):
        raise ValueError(f"target ids must lie in [0, {t2d_V.shape[0]})")
    # Draft id of a kept target id = number of kept ids below it.
    rank_V = torch.cumsum(t2d_V.long(), dim=0) - 1
    return torch.where(t2d_V[target_ids], rank_V[target_ids], torch.full_like(target_ids, -1))


def check_draft_vocab(d2t_Vd: torch.Tensor, t2d_V: torch.Tensor) -> None:
    """Raise ValueError unless d2t and t2d describe the same ascending kept set."""
    if d2t_Vd.dim() != 1 or t2d_V.dim() != 1 or t2d_V.dtype != torch.bool:
        raise ValueError("d2t must be a 1-D LongTensor [Vd] and t2d a 1-D BoolTensor [V]")
    kept_Vd = kept_target_ids(d2t_Vd)
    if (int(t2d_V.sum()) != d2t_Vd.shape[0]
            or not torch.equal(torch.nonzero(t2d_V).squeeze(1), kept_Vd.to(t2d_V.device))):
        raise ValueError("d2t offsets and t2d mask disagree: d2t must be kept_ids - arange(Vd) of t2d's kept ids")


class DraftVocabMixin:
    """d2t/t2d buffers of a drafter whose config has `draft_vocab_size` (None: the full target vocabulary).

    Mixed into a `DrafterModel` subclass (before it in the bases); call `register_draft_vocab(config)` in
    `__init__`. Buffers are persistent (saved with the weights) and describe the identity vocabulary
    (ids 0..Vd-1) until `set_draft_vocab`; `on_draft_vocab_set` is the subclass hook run after it.
    """

    def register_draft_vocab(self, config) -> None:
        size = config.draft_vocab_size
        if size is None:
            return
        self.register_buffer("d2t", torch.zeros(size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[:size] = True
        self.register_buffer("t2d", t2d)

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size is not None

    def target_vocab_index(self) -> torch.Tensor | None:
        """Target id of each draft id (LongTensor [Vd], ascending), or None with the full vocabulary."""
        return kept_target_ids(self.d2t) if self.reduced_vocab else None

    def set_draft_vocab(self, d2t_Vd: torch.Tensor, t2d_V: torch.Tensor) -> None:
        """Install `build_draft_vocab` buffers (then `on_draft_vocab_set`)."""
        if not self.reduced_vocab:
            raise ValueError(f"set_draft_vocab: this {self.config.drafter_kind} drafter uses the full vocabulary "
                             f"(draft_vocab_size=None)")
        if d2t_Vd.shape != self.d2t.shape or t2d_V.shape != self.t2d.shape:
            raise ValueError(f"d2t/t2d shapes {tuple(d2t_Vd.shape)}/{tuple(t2d_V.shape)} do not match "
                             f"draft_vocab_size={self.d2t.shape[0]} / target vocab {self.t2d.shape[0]}")
        check_draft_vocab(d2t_Vd, t2d_V.bool())
        with torch.no_grad():
            self.d2t.copy_(d2t_Vd.long())
            self.t2d.copy_(t2d_V.bool())
        self.on_draft_vocab_set()

    def on_draft_vocab_set(self) -> None:
        """Subclass hook after `set_draft_vocab` (Eagle3 re-initialises its own head); nothing here."""


def prepare_draft_vocabulary(drafter, samples: Iterable, tokenizer) -> None:
    """A spec's `prepare_for_training`: with `draft_vocab_size`, keep the most frequent assistant tokens of
    `samples` (objects with input_ids and loss_mask: the training split) plus the tokenizer's special tokens."""
    size = drafter.config.draft_vocab_size
    if not size:
        return
    d2t, t2d = build_draft_vocab(samples, size, vocab_size=drafter.config.target_vocab_size,
                                 always_keep=tokenizer.all_special_ids)
    drafter.set_draft_vocab(d2t.to(drafter.d2t.device), t2d.to(drafter.t2d.device))
    log.info("draft vocabulary: the %d most frequent assistant tokens of the training split", size)
