"""One rank's cache build, described by a `BuildJob`: render (plan.py), batch by length, capture (capture.py), write
shards and the partial index (shards.py), and merge once every rank is done (merge.py).

One rank of W takes the samples whose global position p satisfies p % W == rank (or the batches a job gives it) and
writes its own shards plus a partial index. A killed build resumes: the verified shards of its partial index are
kept and their samples skipped. Because batches are formed greedily over the length-sorted remaining samples and
shards end at batch boundaries, a resumed build writes the same shards as an uninterrupted one.

Memory: the token ids of this rank's samples (5 B/token, needed to sort by length), one batch of activations and one
shard buffer (~2x shard_size_mb while it is serialised); features stream to disk, so peak memory does not grow with
the number of samples' features.

Fault injection (tests only, `deepspec.utils.faults`): with `faults=FaultInjection(stop_after=N)` a rank raises
`InjectedFault` right after it has written N shards in this process, which simulates a kill between shards. A
SIGTERM stops a rank after its current batch (`Terminated`, exit 143): the shards written are kept, the samples of
the unfinished one dropped, and a rerun of the same command resumes after the kept shards.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspec.cache import format as fmt
from deepspec.cache.capture import capture_batch
from deepspec.cache.config import CacheSchema
from deepspec.cache.merge import merge_when_all_done
from deepspec.cache.plan import (
    PlannedSample,
    RenderResult,
    estimate_cache_size,
    format_estimate,
    length_notes,
    plan_batches,
    render_samples,
    target_context_length,
)
from deepspec.cache.settings import build_settings, conversations_hash
from deepspec.cache.shards import ShardWriter, kept_after_failure, load_resume_state, write_partial_index
from deepspec.cache.stage import StagedSample
from deepspec.data.rendering import AllSkipped, Rendering
from deepspec.targets.layers import validate_layer_ids
from deepspec.targets.load import LoadedTarget
from deepspec.targets.sharding import any_rank, is_partitioned, max_over_ranks
from deepspec.utils.faults import FaultInjection, InjectedFault
from deepspec.utils.io import reporting_disk_full
from deepspec.utils.locks import exclusive_lock
from deepspec.utils.termination import StopRequest, Terminated, stop_on_sigterm

log = logging.getLogger(__name__)


@dataclass
class Precomputed:
    """What a hybrid training run (deepspec.cache.hybrid) hands the build of its cache."""

    read: Callable[[PlannedSample], StagedSample | None]  # a sample computed earlier (checked), or None: compute it
    on_shard: Callable[[dict], None] | None = None  # runs once a shard and the partial index listing it are durable
    lock_held: bool = False  # the caller already holds this rank's lock


@dataclass(frozen=True)
class BuildJob:
    """One rank's build: everything `build_cache` reads besides the conversations and the target.

    The folder and the layers are the options' own `out_dir` and `layer_ids` (resolved: `cache.layer_ids`, else
    `target.layer_ids`, else the spread, as `deepspec.cache.pipeline.resolve_layer_ids` does), so a job names each
    once. `content` (FORMAT.md): hidden states (`layer_ids` features, none when empty, + the final hidden), or the
    target's `top_k` next-token ids and log-probs only (`layer_ids` then empty); the options checked that."""

    options: CacheSchema  # out_dir, layer_ids, max_length, batching, storage, shards, resume, progress
    rank: int = 0
    world_size: int = 1
    rendering: Rendering = field(default_factory=Rendering)  # format, chat template and options, system prompt
    source: dict = field(default_factory=dict)  # recorded in meta.json (the loader's report under "load_report")
    merge: bool = True
    faults: FaultInjection = field(default_factory=FaultInjection)
    # This rank's samples in the batches to compute them in, in order (None: length-sorted `plan_batches`).
    batches: list[list[PlannedSample]] | None = None
    precomputed: Precomputed | None = None
    # A serving engine computing the hidden states (`capture_batch`'s signature, less the
    # model; deepspec.cache.engine_source); None: the target's own forward.
    engine: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.options.layer_ids is None:
            raise ValueError(f"{self.options.where}.layer_ids=None: a build job takes the resolved layer ids "
                             "(cache.layer_ids, else target.layer_ids, else the spread of cache.num_feature_layers)")

    @property
    def out_dir(self) -> Path:
        return Path(self.options.out_dir)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.options.layer_ids)

    @property
    def top_k(self) -> int | None:
        return self.options.top_k if self.options.content == fmt.CONTENT_TOP_K else None


@dataclass
class CacheStats:
    """What one `build_cache` call did (this rank); the merged totals are in `CacheMeta.counts`."""

    rank: int
    num_samples: int
    num_tokens: int
    num_shards: int
    num_bytes: int
    num_resumed_samples: int  # taken over from shards of an earlier, interrupted run
    skipped: dict[str, int]
    num_truncated: int
    fp8_rel_error: float | None
    seconds: float
    meta: fmt.CacheMeta | None = None  # set where this call also merged the cache

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def build_cache(conversations_by_split: Mapping[str, Sequence], target: LoadedTarget, job: BuildJob) -> CacheStats:
    """Cache this rank's share of the conversations into `job.out_dir`; merge the index when the whole build is done.

    With torch.distributed initialised all ranks meet at a barrier and rank 0 merges; a single process merges
    itself; separate processes without a process group run `merge_cache(out_dir)` once all have finished.
    `job.rendering` (deepspec.data.rendering) renders every sample and is recorded. When every conversation of this
    rank is skipped, the build is refused (`AllSkipped`) before anything is written, and a folder this call created
    is removed again.

    `job.batches`: this rank's samples in the batches to compute them in (the ranks' lists together hold every
    rendered sample once, whichever rank renders it), instead of `plan_batches` over `position % world_size == rank`.
    Hybrid training finishes its cache through here (`job.precomputed`, with the batches it computed epoch 0 in):
    samples computed earlier are taken over instead of recomputed (a batch with a sample missing or damaged is
    computed again whole: the same composition, so the same bytes).

    A ZeRO-3 target (deepspec.targets.sharding) needs every rank in each forward: the ranks then walk their
    batches in lockstep (as many steps as the longest plan; a step where any rank computes is a forward on all).
    """
    started = time.perf_counter()
    layer_ids = validate_layer_ids(job.layer_ids, target.num_layers, field="cache.layer_ids")
    out_dir, rank = job.out_dir, job.rank
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        # One writer per rank and folder: a second run would delete this one's temp files and unlisted shards.
        with ExitStack() as stack:
            if not (job.precomputed is not None and job.precomputed.lock_held):
                stack.enter_context(exclusive_lock(out_dir / fmt.lock_name(rank),
                                                   f"rank {rank} of the feature cache {out_dir}"))
            stack.enter_context(reporting_disk_full(survives=lambda: kept_after_failure(out_dir, rank)))
            stop = stack.enter_context(stop_on_sigterm("dropping the unfinished shard after the current batch, "
                                                       "then exiting"))
            return _build_rank(conversations_by_split, target, job, layer_ids, stop, started)
    except AllSkipped:
        if created and {p.name for p in out_dir.iterdir()} <= {fmt.lock_name(rank)}:
            (out_dir / fmt.lock_name(rank)).unlink(missing_ok=True)
            out_dir.rmdir()
        raise


def _build_rank(conversations_by_split: Mapping[str, Sequence], target: LoadedTarget, job: BuildJob,
                layer_ids: list[int], stop: StopRequest, started: float) -> CacheStats:
    """build_cache's work on a validated job, while holding the rank's lock; `stop` (a SIGTERM) ends it between
    batches, the shards written kept, the samples of the unfinished one dropped (a rerun computes them)."""
    o = job.options
    settings = build_settings(target, layer_ids, storage_dtype=o.storage_dtype, max_length=o.max_length,
                              world_size=job.world_size, source=job.source,
                              data_hash=conversations_hash(conversations_by_split), rendering=job.rendering,
                              content=o.content, top_k=job.top_k)
    rendered = _render_rank(conversations_by_split, target, job)
    samples = ([s for batch in job.batches for s in batch] if job.batches is not None else rendered.samples)
    _print_plan(rendered, samples, job, settings["hidden_size"])

    shards = _RankShards(job, settings, load_resume_state(job.out_dir, job.rank, settings, o.resume),
                         vocab_size=int(target.config.vocab_size))
    done_positions = {s["position"] for entry in shards.entries for s in entry["samples"]}
    batches = _batches_to_compute(job, samples, done_positions)
    num_new_tokens = _compute_batches(target, job, layer_ids, batches, shards, stop)

    shards.complete({"num_assigned": rendered.num_assigned, "skipped": dict(rendered.skipped),
                     "problems": rendered.problems, "num_truncated": rendered.num_truncated,
                     "num_over_context": rendered.num_over_context, "num_samples": len(rendered.samples)})
    stats = _rank_stats(job, shards.entries, rendered, len(done_positions), time.perf_counter() - started)
    log.info("rank %d: %d samples (%d resumed), %d new tokens in %.1f s", job.rank, stats.num_samples,
             stats.num_resumed_samples, num_new_tokens, stats.seconds)
    stats.meta = merge_when_all_done(job.out_dir, job.rank, job.world_size) if job.merge else None
    return stats


def _where(job: BuildJob) -> str:
    return f"[rank {job.rank}/{job.world_size}] "


def _render_rank(conversations_by_split: Mapping[str, Sequence], target: LoadedTarget, job: BuildJob) -> RenderResult:
    """This rank's samples, rendered; refused (`AllSkipped`) when every one of its conversations is skipped."""
    rendered = render_samples(conversations_by_split, target.tokenizer, max_length=job.options.max_length,
                              rendering=job.rendering, rank=job.rank, world_size=job.world_size,
                              context_length=target_context_length(target))
    what = f"data.prompts={job.source['prompts']!r}" if job.source.get("prompts") else "the conversations"
    rendered.require_samples(what + (f" (rank {job.rank} of {job.world_size})" if job.world_size > 1 else ""))
    return rendered


def _print_plan(rendered: RenderResult, samples: list[PlannedSample], job: BuildJob, hidden_size: int) -> None:
    """The size estimate and what happened to long samples, before anything is computed."""
    o = job.options
    estimate = estimate_cache_size(sum(s.length for s in samples), len(samples), hidden_size, len(job.layer_ids),
                                   o.storage_dtype, o.content, job.top_k)
    print(format_estimate(estimate, where=_where(job)), flush=True)
    for note in length_notes(rendered, o.max_length, where=_where(job)):
        print(note, flush=True)


def _batches_to_compute(job: BuildJob, samples: list[PlannedSample], done_positions: set[int],
                        ) -> list[list[PlannedSample]]:
    """The batches of the samples no kept shard holds."""
    if job.batches is not None:  # shards end at batch boundaries: what is done is whole batches
        return [kept for batch in job.batches if (kept := [s for s in batch if s.position not in done_positions])]
    # greedy over the length-sorted rest: dropping the batches already written keeps the others
    return plan_batches([s for s in samples if s.position not in done_positions], job.options.batch_size,
                        job.options.batch_tokens)


class _RankShards:
    """This rank's shards: the writer, the entries written (the kept ones first) and the partial index listing them."""

    def __init__(self, job: BuildJob, settings: dict, kept: list[dict], vocab_size: int):
        o = job.options
        next_idx = 1 + max((int(e["file"].split("-")[-1].split(".")[0]) for e in kept), default=-1)
        self.writer = ShardWriter(job.out_dir, job.rank, o.storage_dtype, len(job.layer_ids),
                                  int(o.shard_size_mb * 2**20), next_idx, o.content)
        self.job, self.settings, self.entries, self.vocab_size = job, settings, kept, vocab_size
        self.num_written = 0  # shards written by this process

    def write_shard(self) -> None:
        """Flush the buffered samples as one shard and list it in the partial index (nothing when none is buffered)."""
        job = self.job
        entry = self.writer.flush()
        if entry is None:
            return
        self.entries.append(entry)
        write_partial_index(job.out_dir, job.rank, self.settings, self.entries, stats=None, vocab_size=self.vocab_size)
        if job.precomputed is not None and job.precomputed.on_shard is not None:
            job.precomputed.on_shard(entry)
        self.num_written += 1
        if job.faults.should_stop(self.num_written):
            raise InjectedFault(f"faults.stop_after={job.faults.stop_after}: injected failure on rank {job.rank} "
                                f"after writing {self.num_written} shard(s)")

    def complete(self, rank_stats: dict) -> None:
        """The partial index marked complete, with what the rank rendered (what the merge checks and counts)."""
        write_partial_index(self.job.out_dir, self.job.rank, self.settings, self.entries, stats=rank_stats,
                            vocab_size=self.vocab_size)


def _compute_batches(target: LoadedTarget, job: BuildJob, layer_ids: list[int], batches: list[list[PlannedSample]],
                     shards: _RankShards, stop: StopRequest) -> int:
    """Every batch captured (or taken over) and buffered, a shard written whenever the buffer is full; the number
    of tokens this call added."""
    model = target.model
    pad_token_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    partitioned = is_partitioned(target)
    device = next(model.parameters()).device
    bar = _progress_bar(sum(s.length for batch in batches for s in batch), job.rank, enabled=job.options.progress)
    num_new_tokens = 0
    for step in range(max_over_ranks(len(batches), partitioned, device)):
        batch = batches[step] if step < len(batches) else []
        _add_batch(model, batch, job, layer_ids, shards.writer, pad_token_id, partitioned, device)
        num_batch_tokens = sum(s.length for s in batch)
        num_new_tokens += num_batch_tokens
        if bar is not None:
            bar.update(num_batch_tokens)
        if shards.writer.full:
            shards.write_shard()
        if any_rank(stop.requested, partitioned, device):  # a ZeRO-3 target: every rank stops at the same batch
            raise Terminated(f"stopped by SIGTERM: rank {job.rank} dropped the samples of its unfinished shard (a "
                             f"rerun computes them); {kept_after_failure(job.out_dir, job.rank)}")
    shards.write_shard()
    if bar is not None:
        bar.close()
    return num_new_tokens


def _add_batch(model, batch: list[PlannedSample], job: BuildJob, layer_ids: list[int], writer: ShardWriter,
               pad_token_id: int, partitioned: bool, device: torch.device) -> None:
    """Buffer one batch: taken over whole where every sample was computed earlier, else captured whole."""
    pre, o = job.precomputed, job.options
    given = [pre.read(sample) if pre is not None else None for sample in batch]
    missing = any(g is None for g in given)
    capture = (job.engine.capture_batch if job.engine is not None
               else functools.partial(capture_batch, model))
    if any_rank(missing, partitioned, device):  # with a ZeRO-3 target every rank joins each forward
        captures = capture(batch or [_lockstep_dummy(pad_token_id)], layer_ids,
                           storage_dtype=o.storage_dtype, content=o.content, top_k=job.top_k,
                           pad_token_id=pad_token_id, partitioned=partitioned)
    for b, sample in enumerate(batch):
        if not missing:  # computed earlier (a hybrid training run's epoch 0), checked when read
            writer.add_stored(sample, *given[b])
        else:
            item = captures[b]
            writer.add(sample, item.features_TF, item.final_hidden_TH, target_lse_T=item.target_lse_T, top_k=item.top_k)


def _rank_stats(job: BuildJob, entries: list[dict], rendered: RenderResult, num_resumed: int,
                seconds: float) -> CacheStats:
    return CacheStats(
        rank=job.rank, num_samples=sum(len(e["samples"]) for e in entries),
        num_tokens=sum(e["num_tokens"] for e in entries), num_shards=len(entries),
        num_bytes=sum(e["num_bytes"] for e in entries),
        num_resumed_samples=num_resumed, skipped=dict(rendered.skipped),
        num_truncated=rendered.num_truncated,
        fp8_rel_error=(fmt.relative_l2(sum(e["fp8_sq_error"] for e in entries),
                                       sum(e["fp8_sq_reference"] for e in entries))
                       if job.options.storage_dtype == "fp8" else None),
        seconds=seconds)


def _lockstep_dummy(pad_token_id: int) -> PlannedSample:
    """A one-token sample for a rank that has no batch left while another computes one (ZeRO-3 lockstep)."""
    return PlannedSample(-1, "", fmt.SPLITS[0], torch.tensor([pad_token_id], dtype=torch.int32),
                         torch.zeros(1, dtype=torch.uint8))


def _progress_bar(total_tokens: int, rank: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"cache rank {rank}", position=rank,
                dynamic_ncols=True)
