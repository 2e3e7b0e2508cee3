"""Target features without a finished cache: `data.features = online | hybrid` (offline reads data.cache_dir).

Both sources have the `CacheReader` interface `TrainingData` uses (`split`, `lengths`, `reader[i]`, `tokens`,
`vocab_size`), so batching, anchor sampling, packing and data order are the same code in all three modes.

- `OnlineFeatures`: the conversations (`data.source`, the cache job's `data:` section) are loaded, split and
  rendered by the cache job's own functions (`load_and_split`, `render_samples`: same chat template, loss mask,
  truncation and seeded id-hash split), so index i is the i-th sample of the cache a `deepspec cache` build of
  the same data would write. `reader[i]` runs the frozen target (torch.no_grad; the training device and
  `target.dtype`: fp32 on CPU, bf16 on GPU) on that one sample, converts the result to the stored tensors
  (`stored_sample_tensors`: `data.cache.storage_dtype`, bf16 by default) and back (`sample_from_stored`), with the
  very functions the cache writer and reader use. One sample per forward, never a padded micro-batch: that is the
  computation of a cache built with `cache.batch_size=1`, so online and offline training on such a cache are bit
  for bit the same; a cache built from padded batches differs by float rounding only (batched vs one row:
  other kernel shapes), which is why online does not batch the target forward across a micro-batch.
  Each rank computes the samples of its own micro-batches only.
- `HybridFeatures`: online in epoch 0, and every computed sample is staged (its stored tensors, atomically)
  under `<data.cache_dir>/.online-stage/`. When epoch 1 starts (or training ends), each rank finishes its share
  of the cache through `build_cache` (same writer, partial index, checksums, merge and lock; `cache.batch_size=1`
  plan) taking the staged samples instead of recomputing them, deleting them shard by shard; the result is
  byte-identical to `deepspec cache cache.batch_size=1` on the same data and world size. After that the source
  reads the finished cache (`CacheReader`). A killed run keeps its staged samples and written shards: the resumed
  run reuses them, with no duplicates and no holes (positions are unique; resume is the writer's).

Bad input fails before anything is written: a malformed or truncated record of the conversations file (named by
file and line), a sample longer than the target's context (named by id), a cache folder, partial build or stage
built with other settings or another target (every differing field named).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from deepspec.cache import format as fmt
from deepspec.cache.reader import CacheReader, SampleIndex, sample_from_stored
from deepspec.cache.writer import (
    PlannedSample,
    build_cache,
    build_settings,
    capture_batch,
    conversations_hash,
    fp8_error_sums,
    render_samples,
    stored_sample_tensors,
    target_context_length,
)
from deepspec.data.rendering import Rendering
from deepspec.training.config import FEATURE_MODES  # noqa: F401 - the modes, one definition
from deepspec.training.config import ONLINE_OPTIONS, configured_rendering
from deepspec.utils.io import atomic_path, atomic_write_json, read_json
from deepspec.utils.locks import exclusive_lock

log = logging.getLogger(__name__)

STAGE_DIR = ".online-stage"  # inside data.cache_dir: hybrid's computed samples not yet in a shard
STAGE_SETTINGS = "settings.json"


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
    """`CacheReader` interface over the frozen target: `self[i]` is the sample the cache would hold at index i."""

    def __init__(self, conversations_by_split: dict, target, layer_ids: list[int], *, max_length: int | None,
                 storage_dtype: str, content: str, top_k: int | None, rendering: Rendering,
                 dtype: torch.dtype | None = torch.float32, where: str = "data.source"):
        fmt.check_storage_dtype(storage_dtype)
        fmt.check_content(content, layer_ids, top_k)
        self.conversations_by_split = conversations_by_split
        self.target, self.layer_ids = target, list(layer_ids)
        self.max_length, self.storage_dtype, self.content, self.top_k = max_length, storage_dtype, content, top_k
        self.rendering = rendering
        self.dtype = dtype
        self.vocab_size = int(target.config.vocab_size)
        rendering.check_tokenizer(target.tokenizer, ONLINE_OPTIONS)
        self.rendered = render_samples(conversations_by_split, target.tokenizer, max_length=max_length,
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
        self.num_forwards = 0  # target forwards run by this process (one per sample computed)

    @property
    def meta(self):
        """The `CacheMeta` fields a consumer of a reader reads (calibration: hidden_size), as the cache would say."""
        from types import SimpleNamespace

        fingerprint = self.target.fingerprint()
        return SimpleNamespace(**fingerprint, layer_ids=list(self.layer_ids), hidden_size=int(self.target.config.hidden_size),
                               num_target_layers=int(self.target.num_layers), storage_dtype=self.storage_dtype,
                               content=self.content, max_length=self.max_length, format_version=fmt.FORMAT_VERSION,
                               has_target_lse=self.content == fmt.CONTENT_HIDDEN, **self.rendering.record())


    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = self.planned[i]
        return sample.input_ids.long(), sample.loss_mask.bool()

    def compute(self, i: int) -> tuple[dict[str, torch.Tensor], float, float]:
        """(stored tensors, fp8 squared error, fp8 squared reference) of sample i: one target forward."""
        sample = self.planned[i]
        (item,) = capture_batch(self.target.model, [sample], self.layer_ids, storage_dtype=self.storage_dtype,
                              content=self.content, top_k=self.top_k, pad_token_id=self.pad_token_id)
        self.num_forwards += 1
        stored = stored_sample_tensors(sample, item.features_TF, item.final_hidden_TH, item.target_lse_T, item.top_k,
                                       content=self.content, storage_dtype=self.storage_dtype,
                                       num_feature_layers=len(self.layer_ids))
        return (stored, *fp8_error_sums(item.features_TF, stored))

    def stored(self, i: int) -> dict[str, torch.Tensor]:
        return self.compute(i)[0]

    def __getitem__(self, i: int):
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for {len(self)} samples")
        stored = self.stored(i)
        return sample_from_stored(self.planned[i].sample_id, self.planned[i].length, stored.__getitem__, set(stored),
                                  self.dtype, lambda ids_T: ids_T.long())

    def start_epoch(self, epoch: int) -> None:  # TrainingData.epoch_order calls it; nothing to do online
        return None

    def finish(self) -> None:
        return None

    def close(self) -> None:
        return None


class HybridFeatures(OnlineFeatures):
    """Online in epoch 0 while staging every computed sample; finishes and then reads the cache in `cache_dir`."""

    def __init__(self, conversations_by_split: dict, target, layer_ids: list[int], *, cache_dir: str | Path,
                 source: dict, rank: int, world_size: int, shard_size_mb: float, fingerprint: dict | None = None,
                 **kwargs):
        super().__init__(conversations_by_split, target, layer_ids, **kwargs)
        self.cache_dir = Path(cache_dir)
        self.source, self.rank, self.world_size, self.shard_size_mb = dict(source), rank, world_size, shard_size_mb
        self.settings = build_settings(target, self.layer_ids, storage_dtype=self.storage_dtype,
                                       max_length=self.max_length, world_size=world_size, source=self.source,
                                       data_hash=conversations_hash(conversations_by_split),
                                       rendering=self.rendering, content=self.content, top_k=self.top_k)
        self.stage_dir = self.cache_dir / STAGE_DIR
        self.reader: CacheReader | None = None
        self._lock = ExitStack()
        self.num_staged_reads = 0
        self._check_existing()

    # --- set-up checks: everything refused here leaves the folder as it was -------------------------------
    def _check_existing(self) -> None:
        if (self.cache_dir / fmt.META_NAME).is_file():
            self._open_finished()
            return
        for rank in range(self.world_size):  # a partial build (another hybrid run or `deepspec cache`)
            path = self.cache_dir / fmt.partial_index_name(rank)
            if path.is_file():
                self._compare(read_json(path).get("settings") or {}, f"{path} (an earlier build of rank {rank})")
        settings_path = self.stage_dir / STAGE_SETTINGS
        if settings_path.is_file():  # staged samples do not depend on the number of ranks that computed them
            self._compare(read_json(settings_path), f"{settings_path} (samples staged by an earlier hybrid run)",
                          self._stage_settings())

    def _stage_settings(self) -> dict:
        return {k: v for k, v in self.settings.items() if k != "world_size"}

    def _compare(self, old: dict, where: str, settings: dict | None = None) -> None:
        settings = self.settings if settings is None else settings
        differing = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if differing:
            raise ValueError(f"data.cache_dir={str(self.cache_dir)!r}: {where} used other settings ("
                             + "; ".join(f"{k}: {old.get(k)!r} vs now {settings.get(k)!r}" for k in differing)
                             + "): use another data.cache_dir, or delete that folder to rebuild")

    def _open_finished(self) -> None:
        meta = fmt.read_meta(self.cache_dir)
        if meta.source.get("data_hash") != self.settings["data_hash"]:
            raise ValueError(f"data.cache_dir={str(self.cache_dir)!r} is a finished cache of other conversations "
                             f"(data_hash {meta.source.get('data_hash')!r}, data.source gives "
                             f"{self.settings['data_hash']!r}): use another data.cache_dir")
        self.reader = CacheReader(self.cache_dir, expected_fingerprint=self.target.fingerprint(), dtype=self.dtype,
                                  vocab_size=self.vocab_size)
        index = [(s["id"], s["split"], s["length"], s["position"]) for s in self.reader.samples]
        if index != [(s["id"], s["split"], s["length"], s["position"]) for s in self.samples]:
            raise ValueError(f"data.cache_dir={str(self.cache_dir)!r}: its index.json does not list the samples "
                             f"data.source renders to (other max_length, template or split): use another data.cache_dir")

    def acquire_lock(self) -> ExitStack:
        """This rank's cache lock (the writer's `.lock-r{rank}`), held until `close()`: no second writer meanwhile."""
        if self.reader is None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            self._lock.enter_context(exclusive_lock(self.cache_dir / fmt.lock_name(self.rank),
                                                    f"rank {self.rank} of the feature cache {self.cache_dir}"))
        return self._lock

    def close(self) -> None:
        self._lock.close()

    # --- epoch 0: online, staged ---------------------------------------------------------------------------
    def _stage_path(self, position: int) -> Path:
        return self.stage_dir / f"p{position:09d}.safetensors"

    def _read_staged(self, i: int) -> tuple[dict[str, torch.Tensor], float, float] | None:
        path = self._stage_path(self.planned[i].position)
        if not path.is_file():
            return None
        with safe_open(str(path), framework="pt") as handle:
            stored = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
            errors = handle.metadata() or {}
        if not torch.equal(stored[fmt.TENSOR_INPUT_IDS], self.planned[i].input_ids):
            raise ValueError(f"{path}: staged tokens differ from sample {self.planned[i].sample_id!r} as rendered now: "
                             f"delete {self.stage_dir} and rerun")
        self.num_staged_reads += 1
        return stored, float(errors.get("fp8_sq_error", 0.0)), float(errors.get("fp8_sq_reference", 0.0))

    def _write_staged(self, i: int, staged: tuple[dict[str, torch.Tensor], float, float]) -> None:
        if not (self.stage_dir / STAGE_SETTINGS).is_file():
            atomic_write_json(self.stage_dir / STAGE_SETTINGS, self._stage_settings())
        stored, sq_error, sq_reference = staged
        # float repr round-trips exactly, so the fp8 error sums of the merged meta.json are the build's.
        payload = safetensors_save(dict(stored), metadata={"fp8_sq_error": repr(sq_error),
                                                           "fp8_sq_reference": repr(sq_reference)})
        with atomic_path(self._stage_path(self.planned[i].position)) as tmp, open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())  # as the shards: a staged sample is taken over without recomputing it

    def stored(self, i: int) -> dict[str, torch.Tensor]:
        staged = self._read_staged(i)
        if staged is None:
            staged = self.compute(i)
            self._write_staged(i, staged)
        return staged[0]

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
        if distributed:
            dist.barrier()  # every rank's epoch-0 samples are staged
        by_position = {s.position: i for i, s in enumerate(self.planned)}

        def staged(sample: PlannedSample):
            return self._read_staged(by_position[sample.position])

        def on_shard(entry: dict) -> None:  # the shard and the partial index listing it are durable
            for s in entry["samples"]:
                self._stage_path(s["position"]).unlink(missing_ok=True)

        stats = build_cache(self.conversations_by_split, self.target, self.cache_dir, self.layer_ids,
                            max_length=self.max_length, batch_size=1, storage_dtype=self.storage_dtype,
                            shard_size_mb=self.shard_size_mb, rank=self.rank, world_size=self.world_size,
                            rendering=self.rendering, source=self.source, resume=True, progress=False,
                            content=self.content, top_k=self.top_k,
                            staged=staged, on_shard=on_shard, lock_held=True)
        if self.rank == 0:
            shutil.rmtree(self.stage_dir, ignore_errors=True)
        if distributed:
            dist.barrier()  # the stage is gone before anyone trains on
        log.info("hybrid features: cache %s finished (rank %d: %d samples, %d taken from the stage)", self.cache_dir,
                 self.rank, stats.num_samples, self.num_staged_reads)
        self._open_finished()


def make_feature_source(cfg, target, conversations: tuple[dict, dict], layer_ids: list[int], rank: int,
                        world_size: int):
    """The online or hybrid source of a training config (`data.features`), over a loaded target."""
    splits, source = conversations
    c = cfg.data.cache
    common = dict(max_length=c.max_length, storage_dtype=c.storage_dtype, content=c.content,
                  top_k=c.top_k, rendering=configured_rendering(cfg))
    common["where"] = f"data.source.prompts={cfg.data.source.prompts!r}"
    if cfg.data.features == "online":
        return OnlineFeatures(splits, target, layer_ids, **common)
    if cfg.data.features == "hybrid":
        return HybridFeatures(splits, target, layer_ids, cache_dir=cfg.data.cache_dir, source=source, rank=rank,
                              world_size=world_size, shard_size_mb=c.shard_size_mb, **common)
    raise ValueError(f"data.features={cfg.data.features!r} has no feature source (offline reads data.cache_dir)")
