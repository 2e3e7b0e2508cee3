"""Hybrid features (training's `data.features=hybrid`): online in epoch 0 while staging every computed sample, then
the cache those samples make, read like any finished cache.

Every sample computed in epoch 0 is staged (deepspec.cache.stage: one file per sample with its sha256, atomically)
under `<data.cache_dir>/.online-stage/`. When epoch 1 starts (or training ends), each rank finishes its share of the
cache through `build_cache` (same writer, partial index, checksums, merge and lock) taking the staged samples instead
of recomputing them, in the batches they were computed in: epoch 0's micro-batches, then validation's, then the
samples training never reads (test split, the dropped last partial batch) in length-sorted batches of
`trainer.micro_batch_size`; batch k of each list is rank k % world's. A staged sample found damaged (truncated, any
byte changed) is named in a warning and its batch computed again, so the cache holds what the target computes, never
what a damaged file says. The result is byte-identical to `build_cache` given the same batches
(`data.online_batch=sample`: to `deepspec cache cache.batch_size=1`), and the finished build removes the stage folder.
After that the source reads the finished cache (`CacheReader`). A killed run keeps its staged samples and written
shards: the resumed run reuses them, with no duplicates and no holes (positions are unique; resume is the build's).

Bad input fails before anything is written: a finished cache, partial build or stage built with other settings or
another target (every differing field named, the storage dtype and the batching included).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from deepspec.cache import format as fmt
from deepspec.cache.build import BuildJob, Precomputed, build_cache
from deepspec.cache.online import OnlineFeatures
from deepspec.cache.plan import PlannedSample, plan_batches
from deepspec.cache.reader import CacheReader
from deepspec.cache.settings import build_settings, conversations_hash, finished_settings, settings_differences
from deepspec.cache.shards import read_partial_index
from deepspec.cache.stage import SampleStage, StagedSample, remove_stage
from deepspec.utils.io import sha256_json
from deepspec.utils.locks import exclusive_lock

log = logging.getLogger(__name__)


class HybridFeatures(OnlineFeatures):
    """Online in epoch 0 while staging every computed sample; finishes and then reads the cache in `cache_dir`."""

    def __init__(self, conversations_by_split: dict, target, layer_ids: list[int], *, cache_dir: str | Path,
                 source: dict, rank: int, world_size: int, order_seed: int = 0, **kwargs):
        super().__init__(conversations_by_split, target, layer_ids, target_lse=True, **kwargs)
        self.cache_dir = Path(cache_dir)
        self.source, self.rank, self.world_size = dict(source), rank, world_size
        self.settings = build_settings(target, self.layer_ids, storage_dtype=self.storage_dtype,
                                       max_length=self.max_length, world_size=world_size, source=self.source,
                                       data_hash=conversations_hash(conversations_by_split),
                                       rendering=self.rendering, content=self.content, top_k=self.top_k)
        self.order_seed = order_seed
        self.stage = SampleStage(self.cache_dir)
        self.stage_dir = self.stage.dir
        self.reader: CacheReader | None = None
        self.plan: list[list[int]] | None = None  # every batch of the cache, world-independent; rank k % W has k
        self._lock = ExitStack()
        self.num_staged_reads = 0
        self.stage_settings: dict | None = None  # set by _check_stage, before anything is staged
        self._check_existing()
        if self.reader is None and self.batching == "sample":  # no plan to wait for
            self._check_stage(1)

    # --- set-up checks: everything refused here leaves the folder as it was -------------------------------
    def _check_existing(self) -> None:
        if (self.cache_dir / fmt.META_NAME).is_file():
            self._open_finished()
            return
        for rank in range(self.world_size):  # a partial build (another hybrid run or `deepspec cache`)
            path = self.cache_dir / fmt.partial_index_name(rank)
            if path.is_file():
                self._compare(read_partial_index(path, rank).get("settings") or {}, self.settings,
                              f"{path} (an earlier build of rank {rank})")

    def _compare(self, old: dict, settings: dict, where: str) -> None:
        differing = settings_differences(old, settings)
        if differing:
            raise ValueError(f"data.cache_dir={str(self.cache_dir)!r}: {where} used other settings ("
                             + "; ".join(differing) + "): use another data.cache_dir, or delete that folder to rebuild")

    def _open_finished(self) -> None:
        meta = fmt.read_meta(self.cache_dir)
        # Any number of ranks reads a finished cache; every other setting is what this run would have written.
        self._compare({k: v for k, v in finished_settings(meta).items() if k != "world_size"},
                      {k: v for k, v in self.settings.items() if k != "world_size"},
                      f"the finished cache there ({fmt.META_NAME})")
        self.reader = CacheReader(self.cache_dir, expected_fingerprint=self.target.fingerprint(), dtype=self.dtype,
                                  vocab_size=self.vocab_size)
        index = [(s["id"], s["split"], s["length"], s["position"]) for s in self.reader.samples]
        if index != [(s["id"], s["split"], s["length"], s["position"]) for s in self.samples]:
            raise ValueError(f"data.cache_dir={str(self.cache_dir)!r}: its index.json does not list the samples "
                             "data.source renders to (other max_length, template or split): "
                             "use another data.cache_dir")
        if self.rank == 0:
            removed = remove_stage(self.cache_dir, "left by an earlier hybrid run; the cache there is finished")
            if removed:
                log.warning("hybrid features: %s", removed)

    def acquire_lock(self) -> None:
        """This rank's cache lock (the writer's `.lock-r{rank}`), held until `close()`: no second writer meanwhile."""
        if self.reader is None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            self._lock.enter_context(exclusive_lock(self.cache_dir / fmt.lock_name(self.rank),
                                                    f"rank {self.rank} of the feature cache {self.cache_dir}"))

    def close(self) -> None:
        self._lock.close()

    # --- the batches: epoch 0's, validation's, then the rest ---------------------------------------------
    def expect_batches(self, train_batches: list[list[int]], val_batches: list[list[int]]) -> None:
        """Plan every batch of the cache and check the stage against it (before anything is staged)."""
        if self.reader is not None or self.batching == "sample":
            return
        if self.batching == "micro_batch":
            seen = {i for batch in [*train_batches, *val_batches] for i in batch}
            size = max((len(b) for b in [*train_batches, *val_batches]), default=1)
            rest = plan_batches([self.planned[i] for i in range(len(self)) if i not in seen], size)
            by_position = {s.position: i for i, s in enumerate(self.planned)}
            self.plan = [*map(list, train_batches), *map(list, val_batches),
                         *[[by_position[s.position] for s in batch] for batch in rest]]
        self._check_stage(len(train_batches[0]) if train_batches else 1)

    def _stage_settings(self, micro_batch_size: int) -> dict:
        """The settings of the stage: the cache's but the world size (any number of ranks stages alike), and the
        batching (each sample's bytes depend on the batch it was computed in)."""
        batching = {"online_batch": self.batching}
        if self.plan is not None:
            batching.update(micro_batch_size=micro_batch_size, order_seed=self.order_seed,
                            batches_sha256=sha256_json([[self.planned[i].position for i in b] for b in self.plan]))
        return {**{k: v for k, v in self.settings.items() if k != "world_size"}, "batching": batching}

    def _check_stage(self, micro_batch_size: int) -> None:
        self.stage_settings = self._stage_settings(micro_batch_size)
        staged = self.stage.read_settings()  # a damaged record: named, never read, discarded at the first write
        if staged is not None:
            self._compare(staged, self.stage_settings, f"{self.stage.settings_path} (samples staged by an earlier "
                          "hybrid run)")

    # --- epoch 0: online, staged ---------------------------------------------------------------------------
    def _known(self, i: int) -> StagedSample | None:
        sample = self.planned[i]
        staged = self.stage.read(sample.position, sample.input_ids, sample.sample_id)
        self.num_staged_reads += staged is not None
        return staged

    def _computed(self, i: int, staged: StagedSample) -> None:
        if self.stage_settings is None:
            raise RuntimeError("hybrid features: a sample computed before expect_batches() planned the batches")
        self.stage.prepare(self.stage_settings)  # first write: this rank holds the cache lock (acquire_lock)
        self.stage.write(self.planned[i].position, staged)

    def batch(self, ids: list[int]):
        if self.reader is not None:
            return self.reader.batch(ids)
        return super().batch(ids)

    def __getitem__(self, i: int):
        if self.reader is not None:
            return self.reader[i]
        return super().__getitem__(i)

    @property
    def meta(self):
        return self.reader.meta if self.reader is not None else super().meta

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.reader.tokens(i) if self.reader is not None else super().tokens(i)

    # --- the end of epoch 0: the cache --------------------------------------------------------------------
    def start_epoch(self, epoch: int) -> None:
        if epoch >= 1 and self.reader is None:
            self.finish()

    def finish(self) -> None:
        """Write this rank's share of the cache (every rank calls it; they meet at the writer's barriers)."""
        if self.reader is not None:
            return
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not distributed and self.world_size > 1:
            raise RuntimeError("hybrid features with several ranks need torch.distributed initialised to merge")
        if self.batching == "micro_batch" and self.plan is None:
            raise RuntimeError("hybrid features: finish() before expect_batches() planned the cache's batches")
        if distributed:
            dist.barrier()  # every rank's epoch-0 samples are staged
        by_position = {s.position: i for i, s in enumerate(self.planned)}
        batches = (None if self.plan is None else
                   [[self.planned[i] for i in batch] for k, batch in enumerate(self.plan)
                    if k % self.world_size == self.rank])

        def read(sample: PlannedSample) -> StagedSample | None:
            return self._known(by_position[sample.position])

        def on_shard(entry: dict) -> None:  # the shard and the partial index listing it are durable
            self.stage.discard(s["position"] for s in entry["samples"])

        # The build's own batching is not read: it computes (or takes over) exactly `batches`.
        options = dataclasses.replace(self.options, out_dir=str(self.cache_dir), layer_ids=list(self.layer_ids),
                                      batch_size=1, batch_tokens=None, resume=True, progress=False)
        job = BuildJob(options, rank=self.rank, world_size=self.world_size, rendering=self.rendering,
                       source=self.source, batches=batches,
                       precomputed=Precomputed(read=read, on_shard=on_shard, lock_held=True))
        stats = build_cache(self.conversations_by_split, self.target, job)
        if distributed:
            dist.barrier()  # the merge (which removes the stage) is done before anyone reads the cache
        log.info("hybrid features: cache %s finished (rank %d: %d samples computed in %d target forwards in "
                 "epoch 0; the build wrote %d samples, %d read from the stage, %d damaged staged samples computed "
                 "again)", self.cache_dir, self.rank, self.num_computed, self.num_forwards, stats.num_samples,
                 self.num_staged_reads, self.stage.num_damaged)
        self._open_finished()
