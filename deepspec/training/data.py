"""Training data from the feature cache: a deterministic batch order and the drafter kind's collator.

Order: epoch e visits the train split in `randperm(seed, e)` order; optimizer step s of the epoch takes
the global batch `order[s*G:(s+1)*G]` (G = trainer.global_batch_size sequences) and micro step m of rank r
takes `micro` consecutive sequences at offset `(m * world + r) * micro` of it. Anchors are drawn from
(seed, epoch, sample id) inside the collator. So the data of step s depends only on (seed, s), never on
the process that ran step s-1: a resumed run, or one resumed with another number of processes, sees the
same global batches.

Block drafters (DSpark/DFlash) get `BlockBatch`es (deepspec.drafters.batching), Eagle3/MTP packed
`AutoregressiveBatch`es (deepspec.drafters.batching_autoregressive).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepspec.cache.reader import CacheReader
from deepspec.drafters.batching import BlockBatchBuilder
from deepspec.drafters.batching_autoregressive import collate_autoregressive
from deepspec.training.config import BLOCK_KINDS, TrainConfig

log = logging.getLogger(__name__)


def positions_per_chain(drafter_config) -> int:
    """Draft positions per chain: block size (block drafters), TTT steps (Eagle3), modules (MTP)."""
    for name in ("block_size", "ttt_steps", "num_mtp_modules"):
        value = getattr(drafter_config, name, None)
        if value:
            return int(value)
    raise ValueError(f"{type(drafter_config).__name__} has no block_size/ttt_steps/num_mtp_modules")


@dataclass
class BatchCounts:
    tokens: int  # context tokens read from the cache
    anchors: int  # draft chains trained (blocks, or supervised positions for Eagle3/MTP)


class TrainingData:
    def __init__(self, cfg: TrainConfig, reader: CacheReader, cache_layer_ids: list[int],
                 drafter_layer_ids: list[int]):
        self.reader = reader
        self.cfg = cfg
        self.seed = cfg.trainer.seed
        self.train_ids = reader.split(cfg.data.train_split)
        self.val_ids = reader.split(cfg.data.val_split)
        if cfg.trainer.val_max_samples is not None:
            self.val_ids = self.val_ids[: cfg.trainer.val_max_samples]
        if not self.val_ids:
            log.warning("data.cache_dir=%r has no '%s' samples (data.val_split): no validation metrics and no "
                        "confidence calibration for this run; rebuild the cache with data.val_fraction > 0",
                        cfg.data.cache_dir, cfg.data.val_split)
        self.global_batch = cfg.trainer.global_batch_size
        if len(self.train_ids) < self.global_batch:
            raise ValueError(f"data.cache_dir={cfg.data.cache_dir!r} has {len(self.train_ids)} "
                             f"'{cfg.data.train_split}' samples, fewer than trainer.global_batch_size={self.global_batch}")
        self.block = cfg.drafter.kind in BLOCK_KINDS
        self.cache_layer_ids = list(cache_layer_ids)
        self.drafter_layer_ids = list(drafter_layer_ids)
        self.pad_token_id = 0
        self.builder: BlockBatchBuilder | None = None

    def attach_drafter(self, drafter_config, pad_token_id: int) -> None:
        """Collators need the drafter's mask token and the tokenizer's pad id (known once both are loaded)."""
        self.pad_token_id = int(pad_token_id)
        if self.block:
            self.builder = BlockBatchBuilder(drafter_config.block_size, drafter_config.mask_token_id,
                                             self.cfg.data.max_anchors_per_seq, self.seed)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_ids) // self.global_batch  # the last partial batch is dropped

    def epoch_order(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return [self.train_ids[i] for i in torch.randperm(len(self.train_ids), generator=generator).tolist()]

    def micro_batch_ids(self, order: list[int], step_in_epoch: int, micro_step: int, rank: int, world: int) -> list[int]:
        micro = self.cfg.trainer.micro_batch_size
        start = step_in_epoch * self.global_batch + (micro_step * world + rank) * micro
        return order[start:start + micro]

    def collate(self, sample_ids: list[int], epoch: int):
        samples = [self.reader[i] for i in sample_ids]
        if self.block:
            return self.builder.collate(samples, epoch)
        return collate_autoregressive(samples, cache_layer_ids=self.cache_layer_ids,
                                      feature_layer_ids=self.drafter_layer_ids,
                                      max_tokens_per_row=self.cfg.data.max_tokens_per_row,
                                      pad_token_id=self.pad_token_id)

    @staticmethod
    def counts(batch) -> BatchCounts:
        if hasattr(batch, "stats"):  # BlockBatch
            return BatchCounts(int(batch.stats["num_context_tokens"]), int(batch.stats["num_blocks"]))
        return BatchCounts(int(batch.valid_BT.sum()), int(batch.loss_mask_BT.sum()))
