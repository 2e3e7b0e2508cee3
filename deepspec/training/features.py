"""Target features without a finished cache: `data.features = online | hybrid` (offline reads data.cache_dir).

Both sources have the `CacheReader` interface `TrainingData` uses (`split`, `lengths`, `reader[i]`, `batch(ids)`,
`tokens`, `vocab_size`, `expect_batches`, `start_epoch`), so batching, anchor sampling, packing and data order are
the same code in all three modes.

- `OnlineFeatures`: the conversations (`data.source`, the cache job's `data:` section) are loaded, split and
  rendered by the cache job's own functions (`load_and_split`, `render_samples`: same chat template, loss mask,
  truncation and seeded id-hash split), so index i is the i-th sample of the cache a `deepspec cache` build of
  the same data would write. `batch(ids)` runs the frozen target (torch.no_grad; the training device and
  `target.dtype`: fp32 on CPU, bf16 on GPU) on a micro-batch and converts the result to the stored tensors
  (`stored_sample_tensors`: `data.cache.storage_dtype`, bf16 by default) and back (`sample_from_stored`), with the
  very functions the cache writer and reader use.
  `data.online_batch=micro_batch` (default): one forward per micro-batch, right-padded longest first as the cache
  writer pads its batches (`capture_batch`), so a sample's features are bit for bit those of a cache built with
  the same batch composition. Against another composition (a `deepspec cache` build batching by length, or the
  same sample in another micro-batch in a later epoch) the fp32 forward differs by float rounding (other kernel
  shapes: a few fp32 eps of a row's largest value), which the storage dtype's rounding mostly absorbs: a stored
  value differs by at most one step of the storage dtype (bf16: 2^-8 of itself) plus that fp32 difference near
  zero - tests/training/test_online_features.py holds both.
  `data.online_batch=sample`: one forward per sample, the computation of `cache.batch_size=1`, so online and
  offline training on such a cache are bit for bit the same.
  The target's log-normaliser is computed only where the drafter reads it (a reduced draft vocabulary).
  Validation samples are computed once per run and kept (their stored tensors, in this rank's memory: the rank's
  share of `trainer.val_max_samples` samples x bytes per token). Each rank computes its own micro-batches only.
- `HybridFeatures`: online in epoch 0, and every computed sample is staged (deepspec.cache.stage: one file per
  sample with its sha256, atomically) under `<data.cache_dir>/.online-stage/`. When epoch 1 starts (or training
  ends), each rank finishes its share of the cache through `build_cache` (same writer, partial index, checksums,
  merge and lock) taking the staged samples instead of recomputing them, in the batches they were computed in:
  epoch 0's micro-batches, then validation's, then the samples training never reads (test split, the dropped last
  partial batch) in length-sorted batches of `trainer.micro_batch_size`; batch k of each list is rank k % world's.
  A staged sample found damaged (truncated, any byte changed) is named in a warning and its batch computed again,
  so the cache holds what the target computes, never what a damaged file says. The result is byte-identical to
  `build_cache` given the same batches (`data.online_batch=sample`: to `deepspec cache cache.batch_size=1`), and
  the finished build removes the stage folder. After that the source reads the finished cache (`CacheReader`). A
  killed run keeps its staged samples and written shards: the resumed run reuses them, with no duplicates and no
  holes (positions are unique; resume is the writer's).

A target too large for one device: `data.target_sharding=zero3` partitions its weights across the ranks with
DeepSpeed ZeRO-3 (deepspec.targets.sharding: why ZeRO-3 and not tensor parallelism). Each rank still computes its
own micro-batches, on gathered weights: the same features. The gathers are collective, so the ranks compute in
lockstep: a micro-batch is a forward on every rank when any rank has to compute one.

Bad input fails before anything is written: a malformed or truncated record of the conversations file (named by
file and line), a sample longer than the target's context (named by id), a finished cache, partial build or stage
built with other settings or another target (every differing field named, the storage dtype and the batching
included).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import ExitStack
from pathlib import Path

import torch

from deepspec.cache import format as fmt
from deepspec.cache.build import BuildJob, Precomputed, build_cache
from deepspec.cache.capture import capture_batch, fp8_error_sums, stored_sample_tensors
from deepspec.cache.config import CacheSchema
from deepspec.cache.plan import PlannedSample, plan_batches, render_samples, target_context_length
from deepspec.cache.reader import CacheReader, SampleIndex, sample_from_stored
from deepspec.cache.settings import build_settings, conversations_hash, finished_settings, settings_differences
from deepspec.cache.shards import read_partial_index
from deepspec.cache.stage import SampleStage, StagedSample, remove_stage
from deepspec.data.rendering import Rendering
from deepspec.targets.sharding import any_rank, is_partitioned, max_over_ranks
from deepspec.training.config import (
    FEATURE_MODES,  # noqa: F401 - the modes, one definition
    ONLINE_OPTIONS,
    configured_rendering,
)
from deepspec.utils.io import sha256_json
from deepspec.utils.locks import exclusive_lock
from deepspec.utils.phases import phase

log = logging.getLogger(__name__)

STAGE_DIR = fmt.STAGE_DIR  # inside data.cache_dir: hybrid's computed samples not yet in a shard


def load_conversations(source_cfg) -> tuple[dict, dict]:
    """(conversations by split, the `source` record of meta.json) as the cache job loads them; a malformed or
    truncated record fails here, naming file and line (the cache job counts and skips them; a training run that
    computes its own features refuses to start on a broken file instead)."""
    from deepspec.cache.pipeline import load_and_split

    splits, source = load_and_split(dataclasses.asdict(source_cfg))
    report = source["load_report"]
    broken = report.get("num_malformed", 0) + report.get("num_truncated", 0)
    if broken:
        problems = "\n  ".join(report.get("problems", []))
        raise ValueError(f"data.source.prompts={source_cfg.prompts!r}: {broken} malformed or truncated record(s) "
                         f"(online/hybrid features refuse a broken file; fix or remove them):\n  {problems}")
    return splits, source


class OnlineFeatures(SampleIndex):
    """`CacheReader` interface over the frozen target: `self[i]` is the sample the cache would hold at index i,
    `self.batch(ids)` a micro-batch of them from one target forward."""

    def __init__(self, conversations_by_split: dict, target, layer_ids: list[int], *, options: CacheSchema,
                 rendering: Rendering, batching: str = "micro_batch", target_lse: bool = True,
                 dtype: torch.dtype | None = torch.float32, where: str = "data.source"):
        if batching not in ("micro_batch", "sample"):
            raise ValueError(f"data.online_batch={batching!r} must be micro_batch or sample")
        fmt.check_content(options.content, layer_ids, options.top_k)
        self.conversations_by_split = conversations_by_split
        self.target, self.layer_ids, self.options = target, list(layer_ids), options
        self.max_length, self.storage_dtype, self.content = options.max_length, options.storage_dtype, options.content
        self.top_k = options.top_k if options.content == fmt.CONTENT_TOP_K else None
        self.rendering = rendering
        self.batching, self.dtype = batching, dtype
        self.target_lse = target_lse or options.content != fmt.CONTENT_HIDDEN
        self.vocab_size = int(target.config.vocab_size)
        self.partitioned = is_partitioned(target)
        self.device = next(target.model.parameters()).device
        rendering.check_tokenizer(target.tokenizer, ONLINE_OPTIONS)
        self.rendered = render_samples(conversations_by_split, target.tokenizer, max_length=self.max_length,
                                       rendering=rendering, context_length=target_context_length(target))
        self.rendered.require_samples(where, ONLINE_OPTIONS)  # skips named; every one skipped: refused
        context = self.rendered.context_length
        if context is not None:
            over = [s for s in self.rendered.samples if s.length > context]
            if over:
                raise ValueError(f"{where}: {len(over)} sample(s) are longer than the target's context of {context} "
                                 f"tokens (max_position_embeddings), first {over[0].sample_id!r} ({over[0].length} "
                                 f"tokens): set data.cache.max_length <= {context}")
        self.planned: list[PlannedSample] = self.rendered.samples  # global position order = the cache's index
        self.samples = [{"id": s.sample_id, "split": s.split, "length": s.length, "position": s.position,
                         "num_loss_tokens": int(s.loss_mask.sum())} for s in self.planned]
        pad = target.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self.num_forwards = 0  # target forwards run by this process
        self.num_computed = 0  # samples computed by this process
        self._keep: set[int] = set()  # validation samples: computed once, kept
        self._kept: dict[int, StagedSample] = {}

    @property
    def meta(self):
        """The `CacheMeta` fields a consumer of a reader reads (calibration: hidden_size), as the cache would say."""
        from types import SimpleNamespace

        fingerprint = self.target.fingerprint()
        return SimpleNamespace(**fingerprint, layer_ids=list(self.layer_ids),
                               hidden_size=int(self.target.config.hidden_size),
                               num_target_layers=int(self.target.num_layers), storage_dtype=self.storage_dtype,
                               content=self.content, max_length=self.max_length, format_version=fmt.FORMAT_VERSION,
                               **self.rendering.record())

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = self.planned[i]
        return sample.input_ids.long(), sample.loss_mask.bool()

    def expect_batches(self, train_batches: list[list[int]], val_batches: list[list[int]]) -> None:
        self._keep = {i for batch in val_batches for i in batch}

    # --- computing -------------------------------------------------------------------------------------------
    def forward_groups(self, ids: list[int]) -> list[list[int]]:
        """The target forwards that compute the samples `ids`: the micro-batch, or one per sample."""
        return [list(ids)] if self.batching == "micro_batch" else [[i] for i in ids]

    def compute(self, ids: list[int]) -> list[StagedSample]:
        """(stored tensors, fp8 squared error, fp8 squared reference) of samples `ids`: one target forward."""
        batch = [self.planned[i] for i in ids]
        with phase("target"):  # a training step's profile (trainer.phase_times) names the target's forward
            captures = capture_batch(self.target.model, batch, self.layer_ids, storage_dtype=self.storage_dtype,
                                     content=self.content, top_k=self.top_k, pad_token_id=self.pad_token_id,
                                     partitioned=self.partitioned, target_lse=self.target_lse)
        self.num_forwards += 1
        self.num_computed += len(ids)
        out = []
        for sample, item in zip(batch, captures):
            stored = stored_sample_tensors(sample, item.features_TF, item.final_hidden_TH, item.target_lse_T,
                                           item.top_k, content=self.content, storage_dtype=self.storage_dtype,
                                           num_feature_layers=len(self.layer_ids))
            out.append((stored, *fp8_error_sums(item.features_TF, stored)))
        return out

    def _known(self, i: int) -> StagedSample | None:
        """Sample i as computed earlier in this run, if it was kept."""
        return self._kept.get(i)

    def _computed(self, i: int, staged: StagedSample) -> None:
        if i in self._keep:
            self._kept[i] = staged

    def stored_batch(self, ids: list[int]) -> list[StagedSample]:
        """The stored tensors of samples `ids`: kept ones as they are, a forward group with any sample missing
        computed whole (its composition decides its bytes). With a ZeRO-3 target every rank joins each forward
        (a rank with nothing of its own to compute at that step computes its last group again and discards it)."""
        ids = list(ids)
        out: dict[int, StagedSample] = {}
        groups = self.forward_groups(ids)
        for step in range(max_over_ranks(len(groups), self.partitioned, self.device)):
            group = groups[step] if step < len(groups) else groups[-1] if groups else []
            known = {i: self._known(i) for i in group if i not in out}
            missing = any(staged is None for staged in known.values())
            if not any_rank(missing, self.partitioned, self.device):
                out.update(known)
                continue
            computed = self.compute(group if group else [0])
            if not group:
                continue
            for i, staged in zip(group, computed):
                if known.get(i) is None and i not in out:
                    self._computed(i, staged)
                out.setdefault(i, known.get(i) or staged)
        return [out[i] for i in ids]

    def batch(self, ids: list[int]):
        return [self._sample(i, stored) for i, (stored, _, _) in zip(ids, self.stored_batch(ids))]

    def _sample(self, i: int, stored: dict[str, torch.Tensor]):
        return sample_from_stored(self.planned[i].sample_id, self.planned[i].length, stored.__getitem__, set(stored),
                                  self.dtype, lambda ids_T: ids_T.long())

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        return self.batch([i % len(self)])[0]

    def finish(self) -> None:
        return None

    def close(self) -> None:
        return None


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

    def acquire_lock(self) -> ExitStack:
        """This rank's cache lock (the writer's `.lock-r{rank}`), held until `close()`: no second writer meanwhile."""
        if self.reader is None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            self._lock.enter_context(exclusive_lock(self.cache_dir / fmt.lock_name(self.rank),
                                                    f"rank {self.rank} of the feature cache {self.cache_dir}"))
        return self._lock

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


def make_feature_source(cfg, target, conversations: tuple[dict, dict], layer_ids: list[int], rank: int,
                        world_size: int, target_lse: bool = True):
    """The online or hybrid source of a training config (`data.features`), over a loaded target; `target_lse`:
    whether the drafter reads the target's log-normaliser (online computes it only then)."""
    splits, source = conversations
    common = dict(options=cfg.data.cache, rendering=configured_rendering(cfg), batching=cfg.data.online_batch,
                  where=f"data.source.prompts={cfg.data.source.prompts!r}")
    if cfg.data.features == "online":
        return OnlineFeatures(splits, target, layer_ids, target_lse=target_lse, **common)
    if cfg.data.features == "hybrid":
        return HybridFeatures(splits, target, layer_ids, cache_dir=cfg.data.cache_dir, source=source, rank=rank,
                              world_size=world_size, order_seed=cfg.trainer.seed, **common)
    raise ValueError(f"data.features={cfg.data.features!r} has no feature source (offline reads data.cache_dir)")
