"""Training data from the feature cache: a deterministic batch order and the drafter kind's batcher.

The reader is a `FeatureSource` (deepspec.cache.source: the finished cache with data.features=offline, the target
computing the features online or hybrid): the order, micro batches and batcher below are the same in all modes.

Order: epoch e visits the train split in `randperm(seed, e)` order; optimizer step s of the epoch takes
the global batch `order[s*G:(s+1)*G]` (G = trainer.global_batch_size sequences) and micro step m of rank r
takes `micro` consecutive sequences at offset `(m * world + r) * micro` of it. Anchors are drawn from
(seed, epoch, sample id) inside the batcher. So the data of step s depends only on (seed, s), never on
the process that ran step s-1: a resumed run, or one resumed with another number of processes, sees the
same global batches.

The batcher is the drafter kind's (`DrafterSpec.make_batcher`): block drafters get `BlockBatch`es, chain
drafters packed `AutoregressiveBatch`es.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from deepspec.cache.source import FeatureSource, FeatureSourceConfig
from deepspec.drafters.spec import BatchCounts, BatchSettings, get_drafter_spec
from deepspec.training.config import DataSchema, TrainConfig, configured_rendering

log = logging.getLogger(__name__)


def feature_source_config(cfg: TrainConfig) -> FeatureSourceConfig:
    """Where this run's features come from, as the cache's feature sources read it (`data.features` and the
    sections it reads)."""
    d = cfg.data
    return FeatureSourceConfig(mode=d.features, cache_dir=d.cache_dir, batching=d.online_batch, conversations=d.source,
                               options=d.cache, rendering=configured_rendering(cfg), order_seed=cfg.trainer.seed)


class TrainingData:
    """The run's samples in training order (`data`), in global batches of `global_batch_size` sequences, micro
    batches of `micro_batch_size`, ordered from `seed` (`trainer.*`); validation on at most `val_max_samples`."""

    def __init__(self, settings: DataSchema, reader: FeatureSource, cache_layer_ids: list[int],
                 drafter_layer_ids: list[int], *, seed: int, global_batch_size: int, micro_batch_size: int,
                 val_max_samples: int | None = None):
        self.reader = reader
        self.settings = settings
        where = (f"data.cache_dir={settings.cache_dir!r}" if settings.features == "offline"
                 else f"data.source.prompts={settings.source.prompts!r}")
        self.seed = seed
        self.train_ids = reader.split(settings.train_split)
        self.val_ids = reader.split(settings.val_split)
        if val_max_samples is not None:
            self.val_ids = self.val_ids[:val_max_samples]
        if not self.val_ids:
            log.warning("%s has no '%s' samples (data.val_split): no validation metrics and no confidence "
                        "calibration for this run; rebuild the cache with data.val_fraction > 0 (online: "
                        "data.source.val_fraction)", where, settings.val_split)
        self.global_batch = global_batch_size
        self.micro_batch_size = micro_batch_size
        if len(self.train_ids) < self.global_batch:
            raise ValueError(f"{where} has {len(self.train_ids)} '{settings.train_split}' samples, "
                             f"fewer than trainer.global_batch_size={self.global_batch} (one "
                             "optimizer step): lower it, or cache more samples")
        self.cache_layer_ids = list(cache_layer_ids)
        self.drafter_layer_ids = list(drafter_layer_ids)
        self.batcher = self.val_batcher = None
        reader.expect_batches(*self.expected_batches())  # online: keeps validation's samples; hybrid: plans its cache

    def attach_drafter(self, drafter_config, pad_token_id: int) -> None:
        """The batcher needs the drafter's config (mask token, block size) and the tokenizer's pad id (known once
        both are loaded)."""
        spec, d = get_drafter_spec(drafter_config.drafter_kind), self.settings
        settings = BatchSettings(cache_layer_ids=self.cache_layer_ids, feature_layer_ids=self.drafter_layer_ids,
                                 max_anchors_per_seq=d.max_anchors_per_seq, max_tokens_per_row=d.max_tokens_per_row,
                                 pad_token_id=int(pad_token_id), seed=self.seed)
        self.batcher = self.val_batcher = spec.make_batcher(drafter_config, settings)
        if d.val_anchors_per_seq is not None and d.val_anchors_per_seq != d.max_anchors_per_seq:
            validation = dataclasses.replace(settings, max_anchors_per_seq=d.val_anchors_per_seq)
            self.val_batcher = spec.make_batcher(drafter_config, validation)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.train_ids) // self.global_batch  # the last partial batch is dropped

    def epoch_order(self, epoch: int) -> list[int]:
        self.reader.start_epoch(epoch)  # hybrid features finish their cache when epoch 1 starts
        return self._permutation(epoch)

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return [self.train_ids[i] for i in torch.randperm(len(self.train_ids), generator=generator).tolist()]

    def expected_batches(self) -> tuple[list[list[int]], list[list[int]]]:
        """(epoch 0's micro-batches in order, validation's): chunk k of each is rank k % world's
        (`micro_batch_ids`, `run_validation`), whatever the number of ranks."""
        micro = self.micro_batch_size
        order = self._permutation(0)[:self.steps_per_epoch * self.global_batch]
        return ([order[k:k + micro] for k in range(0, len(order), micro)],
                [self.val_ids[k:k + micro] for k in range(0, len(self.val_ids), micro)])

    def micro_batch_ids(self, order: list[int], step_in_epoch: int, micro_step: int, rank: int,
                        world: int) -> list[int]:
        micro = self.micro_batch_size
        start = step_in_epoch * self.global_batch + (micro_step * world + rank) * micro
        return order[start:start + micro]

    def collate(self, sample_ids: list[int], epoch: int):
        return self.batcher.collate(self.reader.batch(sample_ids), epoch)

    def collate_validation(self, sample_ids: list[int]):
        """Validation's batch of `sample_ids`: epoch 0's anchors, `data.val_anchors_per_seq` of them per sequence."""
        return self.val_batcher.collate(self.reader.batch(sample_ids), 0)

    def counts(self, batch) -> BatchCounts:
        return self.batcher.counts(batch)
