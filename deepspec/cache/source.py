"""The one interface training reads target features through (`FeatureSource`), and how a training run's feature
mode opens one (`FeatureSourceConfig`): offline reads a finished cache (`CacheReader`), online computes the features
with the frozen target inside training (`OnlineFeatures`, online.py), hybrid computes them in epoch 0 while writing
the cache and reads that cache after (`HybridFeatures`, hybrid.py).

Training asks a source for samples and micro-batches and tells it the run's milestones; it never learns how the
features were made, so batching, anchor sampling, packing and data order are the same code in all three modes.
Opening takes two steps because the target is loaded between them: `prepare()` reads what needs no weights (the
cache's meta and index, or the conversations: a broken file fails before minutes of loading), `open(target, ...)`
then makes the source.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from deepspec.cache.config import DEFAULT_CACHE_DIR, FEATURE_MODES, CacheDataSchema, CacheSchema
from deepspec.cache.hybrid import HybridFeatures
from deepspec.cache.online import OnlineFeatures
from deepspec.cache.reader import CachedSample, CacheReader
from deepspec.data.rendering import Rendering


@runtime_checkable
class FeatureSource(Protocol):
    """What training reads its features through (defaults: `deepspec.cache.reader.SampleIndex`)."""

    samples: list[dict]  # the index's records, in global order: id, split, length, position, num_loss_tokens
    vocab_size: int | None  # every token id read is checked against it
    meta: object  # the cache's `CacheMeta` (online: the fields a cache of these samples would record)

    # --- samples -------------------------------------------------------------------------------------------
    def __len__(self) -> int: ...
    def split(self, name: str) -> list[int]: ...  # indices of one split's samples
    def lengths(self) -> list[int]: ...
    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...  # (input_ids [T], loss_mask [T]), no features
    def __getitem__(self, i: int) -> CachedSample: ...
    def batch(self, ids: list[int]) -> list[CachedSample]: ...  # one micro-batch, in order
    def target_next_tokens(self, i: int, head_VH: torch.Tensor) -> torch.Tensor | None: ...

    # --- the run's milestones ------------------------------------------------------------------------------
    def expect_batches(self, train_batches: list[list[int]], val_batches: list[list[int]]) -> None: ...
    def acquire_lock(self) -> None: ...  # once open, before any sample is read
    def start_epoch(self, epoch: int) -> None: ...
    def finish(self) -> None: ...  # training ended (also inside epoch 0)
    def close(self) -> None: ...  # the run ended


def load_conversations(conversations: CacheDataSchema) -> tuple[dict, dict]:
    """(conversations by split, the `source` record of meta.json) as the cache job loads them; a malformed or
    truncated record fails here, naming file and line (the cache job counts and skips them; a training run that
    computes its own features refuses to start on a broken file instead)."""
    from deepspec.cache.pipeline import load_and_split

    splits, source = load_and_split(dataclasses.asdict(conversations))
    report = source["load_report"]
    broken = report.get("num_malformed", 0) + report.get("num_truncated", 0)
    if broken:
        problems = "\n  ".join(report.get("problems", []))
        raise ValueError(f"data.source.prompts={conversations.prompts!r}: {broken} malformed or truncated record(s) "
                         f"(online/hybrid features refuse a broken file; fix or remove them):\n  {problems}")
    return splits, source


@dataclass(frozen=True)
class FeatureSourceConfig:
    """Where a training run's features come from: the training config's `data.*` fields the cache reads."""

    mode: str = "offline"  # data.features: offline | online | hybrid
    cache_dir: str = DEFAULT_CACHE_DIR  # data.cache_dir: offline reads it, hybrid writes it
    batching: str = "micro_batch"  # data.online_batch: one target forward per micro-batch, or per sample
    conversations: CacheDataSchema = field(default_factory=CacheDataSchema)  # data.source (online, hybrid)
    options: CacheSchema = field(default_factory=CacheSchema)  # data.cache: max_length, storage, content (ditto)
    rendering: Rendering = field(default_factory=Rendering)  # data.source.format + the target's template settings
    order_seed: int = 0  # trainer.seed: hybrid's stage records the order its batches were computed in

    def prepare(self) -> PreparedFeatures:
        """Everything that needs no target weights: the finished cache opened (offline: its meta and index
        checked), or the conversations loaded (online, hybrid)."""
        if self.mode not in FEATURE_MODES:
            raise ValueError(f"data.features={self.mode!r} must be one of {list(FEATURE_MODES)}")
        if self.mode == "offline":
            return PreparedFeatures(self, reader=CacheReader(self.cache_dir))
        return PreparedFeatures(self, conversations=load_conversations(self.conversations))


@dataclass
class PreparedFeatures:
    """A feature source up to its target (`FeatureSourceConfig.prepare`)."""

    config: FeatureSourceConfig
    reader: CacheReader | None = None  # offline
    conversations: tuple[dict, dict] | None = None  # online, hybrid: (by split, meta.json's source record)

    def open(self, target, layer_ids: list[int], rank: int = 0, world_size: int = 1,
             target_lse: bool = True) -> FeatureSource:
        """The source over the loaded target; `layer_ids`: the layers the features are taken from; `target_lse`:
        whether the drafter reads the target's log-normaliser (online computes it only then)."""
        c = self.config
        if c.mode == "offline":
            return self.reader
        splits, source = self.conversations
        common = dict(options=c.options, rendering=c.rendering, batching=c.batching,
                      where=f"data.source.prompts={c.conversations.prompts!r}")
        if c.mode == "online":
            return OnlineFeatures(splits, target, layer_ids, target_lse=target_lse, **common)
        return HybridFeatures(splits, target, layer_ids, cache_dir=c.cache_dir, source=source, rank=rank,
                              world_size=world_size, order_seed=c.order_seed, **common)
