"""Anchors and packed block batches for DFlash/DSpark training, built from cached samples.

Block convention (CONTRACTS "Block", `config.block_convention`): a block anchored at position a has
slots j = 0..g-1 with input x[a] (j = 0) or the mask token (j > 0) at position a + j. Draft k of the block
(k = 0..K-1) always predicts x[a + k + 1]: its label is that token when the position exists and is an
assistant (loss-masked) token and every earlier draft of the block is supervised too (`supervised_prefix`),
else -100; its target distribution is the cached final hidden state at a + k (the target's prediction for
x[a + k + 1]), with the target's log-normaliser at that position when the cache stores it (format v2; a
reduced draft vocabulary needs it); the previous token fed to DSpark's sequential head and
confidence head is the ground truth x[a + k] (draft 0: the anchor). Which slot holds draft k is the
convention, and nothing else depends on it: `draft_slots` below (anchor-predicts: slot k, K = g;
mask-predicts: slot k + 1, K = g - 1, slot 0 predicts nothing).

Anchors: positions a with a + 1 < T and loss_mask[a] & loss_mask[a + 1], up to
`max_anchors_per_seq` per sequence without replacement, resampled each epoch deterministically from
(seed, epoch, sample_id).

Packing: sequences are concatenated along tokens (no padding between them) with per-token sequence
ids; the context is each sequence's features, computed once; blocks are concatenated too.

Shape legend: T = packed context tokens, F = num_layers * H, H = hidden, B = blocks, G = block
size, S = B * G block slots (the inputs), K = drafts per block, N = B * K draft rows (labels, targets).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from deepspec.drafters.block.config import FIRST_DRAFT_SLOT
from deepspec.drafters.spec import BatchCounts, BatchSettings
from deepspec.losses.distribution import IGNORE_INDEX


class CachedSampleLike(Protocol):
    input_ids: torch.Tensor  # [T] long
    loss_mask: torch.Tensor  # [T] bool
    features: torch.Tensor  # [T, F]
    final_hidden: torch.Tensor  # [T, H]
    target_lse: torch.Tensor | None  # [T] fp32, or None (samples without it: the full-vocabulary head only)
    sample_id: object


@dataclass
class BlockBatch:
    context_features_1TF: torch.Tensor
    context_positions_1T: torch.Tensor
    context_seq_id_T: torch.Tensor
    block_input_ids_1S: torch.Tensor
    block_positions_1S: torch.Tensor
    anchor_positions_B: torch.Tensor
    block_seq_id_B: torch.Tensor
    labels_N: torch.Tensor  # per draft row
    target_hidden_NH: torch.Tensor
    prev_ids_N: torch.Tensor
    position_index_N: torch.Tensor  # draft k of each row (0..K-1)
    block_index_N: torch.Tensor  # block of each row
    block_size: int
    first_draft_slot: int  # the slot holding draft 0 (`draft_slots`)
    stats: dict[str, float] = field(default_factory=dict)
    target_lse_N: torch.Tensor | None = None  # fp32 log-normaliser of the target at each row's position

    @property
    def num_drafts(self) -> int:
        return self.block_size - self.first_draft_slot

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> BlockBatch:
        moved = {}
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                value = value.to(device)
                # The log-normaliser stays fp32: in bf16 it would move every p_t = exp(z - lse) by up to 1%.
                if dtype is not None and value.is_floating_point() and name != "target_lse_N":
                    value = value.to(dtype)
            moved[name] = value
        return BlockBatch(**moved)


# -- the block convention, in one place -------------------------------------------------------------
def draft_slots(block_size: int, block_convention: str) -> torch.Tensor:
    """`slot_K`: the block slot whose hidden state makes draft k. anchor-predicts: 0..g-1; mask-predicts: 1..g-1
    (slot 0, the anchor, is an input only). Everything else about a draft is the same in both conventions
    (`draft_targets`)."""
    if block_convention not in FIRST_DRAFT_SLOT:
        raise ValueError(f"block_convention={block_convention!r} must be one of {sorted(FIRST_DRAFT_SLOT)}")
    return torch.arange(FIRST_DRAFT_SLOT[block_convention], block_size)


def draft_targets(anchor_B: torch.Tensor, input_ids_T: torch.Tensor, loss_mask_T: torch.Tensor,
                  num_drafts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(label_BK, target_pos_BK, prev_BK) of the drafts of blocks anchored at `anchor_B`: draft k predicts
    x[a + k + 1] (-100 past the end, on a non-assistant token, and behind one: `supervised_prefix`), its target
    distribution is the final hidden at a + k and its previous token x[a + k]. Positions past the sequence are
    clamped (their labels are -100)."""
    num_tokens = input_ids_T.shape[0]
    pos_BK = anchor_B[:, None] + torch.arange(num_drafts)[None, :]  # a + k
    label_pos_BK = pos_BK + 1
    safe_label_pos = label_pos_BK.clamp(max=num_tokens - 1)
    supervised_BK = supervised_prefix((label_pos_BK < num_tokens) & loss_mask_T[safe_label_pos])
    label_BK = torch.where(supervised_BK, input_ids_T[safe_label_pos], torch.full_like(label_pos_BK, IGNORE_INDEX))
    target_pos_BK = pos_BK.clamp(max=num_tokens - 1)
    return label_BK, target_pos_BK, input_ids_T[target_pos_BK]


def supervised_prefix(supervised_BK: torch.Tensor) -> torch.Tensor:
    """Cut each block's draft mask at its first unsupervised draft: draft k stays supervised only if drafts 0..k
    all are (the DSpark reference's cumulative product of the slot masks). A draft is accepted left to
    right, so a draft behind an unsupervised one (past a turn's end, into the next assistant turn) is never
    reached at inference and must not be trained as if it were. Independent of the block convention (it acts on
    drafts, whichever slots hold them)."""
    return torch.cumprod(supervised_BK.long(), dim=-1).bool()


def _seed_for(seed: int, epoch: int, sample_id: object) -> int:
    digest = hashlib.sha256(f"{seed}:{epoch}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BlockBatchBuilder:
    """Samples anchors per sequence and collates sequences into packed `BlockBatch`es."""

    def __init__(self, block_size: int, mask_token_id: int, max_anchors_per_seq: int = 512, seed: int = 0, *,
                 block_convention: str):
        if block_size < 2:
            raise ValueError(f"block_size={block_size} must be >= 2")
        if max_anchors_per_seq < 1:
            raise ValueError(f"max_anchors_per_seq={max_anchors_per_seq} must be >= 1")
        self.block_size = int(block_size)
        self.slot_K = draft_slots(self.block_size, block_convention)
        self.mask_token_id = int(mask_token_id)
        self.max_anchors_per_seq = int(max_anchors_per_seq)
        self.seed = int(seed)

    def candidate_anchors(self, loss_mask_T: torch.Tensor) -> torch.Tensor:
        mask = loss_mask_T.bool()
        if mask.dim() != 1:
            raise ValueError(f"loss_mask must be 1-D, got shape {tuple(mask.shape)}")
        return torch.nonzero(mask[:-1] & mask[1:]).flatten()

    def sample_anchors(self, sample: CachedSampleLike, epoch: int) -> torch.Tensor:
        """Sorted anchor positions for this (seed, epoch, sample_id)."""
        candidates = self.candidate_anchors(sample.loss_mask)
        if candidates.numel() <= self.max_anchors_per_seq:
            return candidates
        generator = torch.Generator().manual_seed(_seed_for(self.seed, epoch, sample.sample_id))
        chosen = torch.randperm(candidates.numel(), generator=generator)[: self.max_anchors_per_seq]
        return candidates[chosen].sort().values

    @classmethod
    def for_drafter(cls, config, max_anchors_per_seq: int = 512, seed: int = 0) -> BlockBatchBuilder:
        """The builder of a block drafter's config (block size, mask token, convention)."""
        return cls(config.block_size, config.mask_token_id, max_anchors_per_seq, seed,
                   block_convention=config.block_convention)

    def collate(self, samples: Sequence[CachedSampleLike], epoch: int = 0) -> BlockBatch:
        if not samples:
            raise ValueError("collate needs at least one sample")
        g, num_drafts = self.block_size, self.slot_K.shape[0]
        offsets_j = torch.arange(g)
        feats, ctx_pos, ctx_seq = [], [], []
        ids, positions, anchors, blk_seq, labels, tgt_hidden, prev, tgt_lse = [], [], [], [], [], [], [], []
        for seq, sample in enumerate(samples):
            input_ids, loss_mask = sample.input_ids.long(), sample.loss_mask.bool()
            num_tokens = input_ids.shape[0]
            for name in ("features", "final_hidden", "loss_mask"):
                if getattr(sample, name).shape[0] != num_tokens:
                    raise ValueError(f"sample {sample.sample_id}: {name} has {getattr(sample, name).shape[0]} rows, "
                                     f"input_ids has {num_tokens}")
            feats.append(sample.features)
            ctx_pos.append(torch.arange(num_tokens))
            ctx_seq.append(torch.full((num_tokens,), seq, dtype=torch.long))
            anchor_B = self.sample_anchors(sample, epoch)
            pos_BG = anchor_B[:, None] + offsets_j[None, :]  # a + j
            block_ids_BG = torch.full_like(pos_BG, self.mask_token_id)
            block_ids_BG[:, 0] = input_ids[anchor_B]
            label_BK, target_pos_BK, prev_BK = draft_targets(anchor_B, input_ids, loss_mask, num_drafts)
            ids.append(block_ids_BG.flatten())
            positions.append(pos_BG.flatten())
            anchors.append(anchor_B)
            blk_seq.append(torch.full_like(anchor_B, seq))
            labels.append(label_BK.flatten())
            tgt_hidden.append(sample.final_hidden[target_pos_BK.flatten()])
            lse_T = getattr(sample, "target_lse", None)
            if lse_T is not None:
                if lse_T.shape != (num_tokens,):
                    raise ValueError(f"sample {sample.sample_id}: target_lse has shape {tuple(lse_T.shape)}, "
                                     f"expected ({num_tokens},)")
                tgt_lse.append(lse_T[target_pos_BK.flatten()].float())
            prev.append(prev_BK.flatten())
        if tgt_lse and len(tgt_lse) != len(samples):
            raise ValueError("some samples carry the target log-normaliser (target_lse) and some do not")
        anchor_positions_B = torch.cat(anchors)
        num_blocks = anchor_positions_B.shape[0]
        labels_N = torch.cat(labels)
        num_label_tokens = int((labels_N != IGNORE_INDEX).sum())
        stats = {"num_blocks": float(num_blocks), "num_label_tokens": float(num_label_tokens),
                 "num_context_tokens": float(sum(f.shape[0] for f in feats)),
                 "padded_fraction": 1.0 - num_label_tokens / max(labels_N.numel(), 1)}
        return BlockBatch(
            context_features_1TF=torch.cat(feats)[None],
            context_positions_1T=torch.cat(ctx_pos)[None],
            context_seq_id_T=torch.cat(ctx_seq),
            block_input_ids_1S=torch.cat(ids)[None],
            block_positions_1S=torch.cat(positions)[None],
            anchor_positions_B=anchor_positions_B,
            block_seq_id_B=torch.cat(blk_seq),
            labels_N=labels_N,
            target_hidden_NH=torch.cat(tgt_hidden),
            prev_ids_N=torch.cat(prev),
            position_index_N=torch.arange(num_drafts).repeat(num_blocks),
            block_index_N=torch.arange(num_blocks).repeat_interleave(num_drafts),
            block_size=g,
            first_draft_slot=int(self.slot_K[0]),
            stats=stats,
            target_lse_N=torch.cat(tgt_lse) if tgt_lse else None,
        )

    def group_by_tokens(self, samples: Iterable[CachedSampleLike],
                        token_budget: int) -> Iterator[list[CachedSampleLike]]:
        """Consecutive groups whose total tokens stay within `token_budget` (a longer sequence goes alone)."""
        if token_budget < 1:
            raise ValueError(f"token_budget={token_budget} must be >= 1")
        group, used = [], 0
        for sample in samples:
            length = int(sample.input_ids.shape[0])
            if group and used + length > token_budget:
                yield group
                group, used = [], 0
            group.append(sample)
            used += length
        if group:
            yield group

    def batches(self, samples: Iterable[CachedSampleLike], epoch: int, token_budget: int) -> Iterator[BlockBatch]:
        """Packed batches of one epoch; sequences without any anchor are skipped."""
        usable = (s for s in samples if self.candidate_anchors(s.loss_mask).numel() > 0)
        for group in self.group_by_tokens(usable, token_budget):
            yield self.collate(group, epoch)


class BlockBatcher:
    """The spec's batcher for block drafters: anchors sampled per (seed, epoch, sample), packed `BlockBatch`es.

    Block drafters read every cached layer (the context fusion is built for them), so the cached features
    are used as they are.
    """

    def __init__(self, config, settings: BatchSettings):
        self.builder = BlockBatchBuilder.for_drafter(config, settings.max_anchors_per_seq, settings.seed)

    def collate(self, samples: Sequence[CachedSampleLike], epoch: int = 0) -> BlockBatch:
        return self.builder.collate(samples, epoch)

    @staticmethod
    def counts(batch: BlockBatch) -> BatchCounts:
        return BatchCounts(int(batch.stats["num_context_tokens"]), int(batch.stats["num_blocks"]))
