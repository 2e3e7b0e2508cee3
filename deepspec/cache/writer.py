"""Build the target-feature cache: render, batch by length, capture, strip padding, write shards atomically.

One rank of W takes the samples whose global position p satisfies p % W == rank and writes its own shards
plus a partial index (`index-r{rank}.json`, rewritten atomically after every shard). `merge_cache` joins
the partial indices into `index.json` (global sample order) and writes `meta.json` last, so a folder with
a meta.json is a finished cache. A killed build resumes: shards listed in the partial index whose sha256
verifies are kept and their samples skipped; unlisted or corrupt shards and temp files are removed and
their samples redone. Because batches are formed greedily over the length-sorted remaining samples and
shards end at batch boundaries, a resumed build writes the same shards as an uninterrupted one.

Memory: the token ids of this rank's samples (5 B/token, needed to sort by length), one batch of
activations and one shard buffer (~2x shard_size_mb while it is serialised); features stream to disk,
so peak memory does not grow with the number of samples' features.

Fault injection (tests only, `deepspec.utils.faults`): with `faults=FaultInjection(stop_after=N)` a rank
raises `InjectedFault` right after it has written N shards in this process, which simulates a kill between
shards. A SIGTERM stops a rank after its current batch (`Terminated`, exit 143): the shards written are kept, the
samples of the unfinished one dropped, and a rerun of the same command resumes after the kept shards.

Shape legend: B = batch, T = tokens, H = hidden size, M = feature layers, F = M * H.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from deepspec.cache import format as fmt
from deepspec.cache.config import CacheSchema
from deepspec.cache.stage import StagedSample, remove_stage
from deepspec.data.rendering import AllSkipped, Rendering, RenderingOptions, Skipped, SkipReport
from deepspec.targets.features import capture_features, lm_head_weight, target_log_normalizer, top_k_logprobs
from deepspec.targets.layers import validate_layer_ids
from deepspec.targets.load import LoadedTarget
from deepspec.targets.sharding import any_rank, gathered, is_partitioned, max_over_ranks
from deepspec.utils.faults import FaultInjection, InjectedFault
from deepspec.utils.io import (
    atomic_path,
    atomic_write_json,
    read_json,
    reporting_disk_full,
    sha256_file,
    sha256_json,
)
from deepspec.utils.locks import exclusive_lock
from deepspec.utils.termination import StopRequest, Terminated, stop_on_sigterm

log = logging.getLogger(__name__)

MAX_PROBLEMS_KEPT = 50
CACHE_OPTIONS = RenderingOptions("data.format=text", "target.chat_template=<template text or file>", "cache.max_length")


@dataclass
class PlannedSample:
    position: int  # global position over train, validation, test (in that order)
    sample_id: str
    split: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class RenderResult:
    samples: list[PlannedSample]
    skips: SkipReport = field(default_factory=SkipReport)  # skipped conversations, the first of each reason named
    num_truncated: int = 0
    longest_before_truncation: int = 0  # tokens of the longest sample cut to max_length
    num_over_context: int = 0  # samples (as stored) longer than the target's context window
    context_length: int | None = None
    num_assigned: int = 0  # conversations this rank was responsible for

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def skipped(self) -> Counter:  # reason -> count
        return self.skips.counts

    @property
    def problems(self) -> list[str]:  # "record: reason: cause", the first MAX_PROBLEMS_KEPT
        return self.skips.problems

    def require_samples(self, what: str, options: RenderingOptions = CACHE_OPTIONS) -> None:
        """Warn about skipped conversations (each reason's first named); refuse when every one was skipped."""
        self.skips.warn(log, "conversations", f"{what}: ")
        self.skips.require_kept(len(self.samples), what, options)


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


def iter_positions(conversations_by_split: Mapping[str, Sequence]):
    """(position, split, conversation) in the global order: train, validation, test, then input order."""
    unknown = sorted(set(conversations_by_split) - set(fmt.SPLITS))
    if unknown:
        raise ValueError(f"conversations_by_split has unknown splits {unknown}; expected {list(fmt.SPLITS)}")
    position = 0
    for split in fmt.SPLITS:
        for conv in conversations_by_split.get(split, []):
            yield position, split, conv
            position += 1


def render_samples(conversations_by_split: Mapping[str, Sequence], tokenizer, *, max_length: int | None,
                   rendering: Rendering | None = None, rank: int = 0, world_size: int = 1,
                   context_length: int | None = None) -> RenderResult:
    """Render this rank's conversations with the shared rule (`rendering`: chat with the tokenizer's template by
    default; deepspec.data.rendering); count (never drop silently) the ones skipped, samples cut to `max_length`
    and samples longer than the target's `context_length`."""
    rendering = rendering or Rendering()
    result = RenderResult(samples=[], context_length=context_length)
    for position, split, conv in iter_positions(conversations_by_split):
        if position % world_size != rank:
            continue
        result.num_assigned += 1
        try:
            rendered = rendering.sample(tokenizer, conv)
        except Skipped as err:
            result.skips.skip(err.reason, conv.where, str(err))
            continue
        ids, mask = rendered.input_ids, rendered.loss_mask
        if max_length is not None and len(ids) > max_length:
            # Same truncation as render_conversation(max_length=...): keep the first max_length tokens.
            result.longest_before_truncation = max(result.longest_before_truncation, len(ids))
            ids, mask = ids[:max_length], mask[:max_length]
            result.num_truncated += 1
        if context_length is not None and len(ids) > context_length:
            result.num_over_context += 1
        if not ids:
            result.skips.skip("empty", conv.where, "rendered to zero tokens")
            continue
        if not any(mask):
            if rendering.is_text:
                result.skips.skip("no_loss_tokens", conv.where, "nothing to learn from (a prompt without completion, "
                                  "or a single token)")
            else:
                result.skips.skip("no_assistant_tokens", conv.where, "all-zero loss mask (no assistant turn, or "
                                  "truncated before the first answer)")
            continue
        result.samples.append(PlannedSample(position, conv.id, split, torch.tensor(ids, dtype=torch.int32),
                                            torch.tensor(mask, dtype=torch.uint8)))
    return result


def target_context_length(target: LoadedTarget) -> int | None:
    return getattr(target.config, "max_position_embeddings", None)


def length_notes(rendered: RenderResult, max_length: int | None, where: str = "") -> list[str]:
    """What happened to long samples, said out loud (meta.json records the same counts)."""
    notes = []
    if rendered.num_truncated:
        notes.append(f"{where}note: {rendered.num_truncated} of {rendered.num_assigned} samples were longer than "
                     f"cache.max_length={max_length} (longest {rendered.longest_before_truncation} tokens) and keep "
                     f"only their first {max_length} tokens")
    if rendered.num_over_context:
        notes.append(f"{where}warning: {rendered.num_over_context} samples are longer than the target's context of "
                     f"{rendered.context_length} tokens (max_position_embeddings): its features past that point are "
                     f"unreliable; set cache.max_length <= {rendered.context_length}")
    return notes


def plan_batches(samples: Sequence[PlannedSample], batch_size: int, batch_tokens: int | None = None,
                 ) -> list[list[PlannedSample]]:
    """Longest first (stable on position) to cut padding; greedy, so dropping leading batches keeps the rest."""
    if batch_size <= 0:
        raise ValueError(f"cache.batch_size={batch_size} must be positive")
    if batch_tokens is not None and batch_tokens <= 0:
        raise ValueError(f"cache.batch_tokens={batch_tokens} must be positive")
    ordered = sorted(samples, key=lambda s: (-s.length, s.position))
    batches: list[list[PlannedSample]] = []
    current: list[PlannedSample] = []
    for sample in ordered:
        # The first sample of a batch is its longest, so the padded size is len(batch) * first length.
        too_many_tokens = batch_tokens is not None and current and (len(current) + 1) * current[0].length > batch_tokens
        if current and (len(current) >= batch_size or too_many_tokens):
            batches.append(current)
            current = []
        current.append(sample)
    if current:
        batches.append(current)
    return batches


def estimate_cache_size(num_tokens: int, num_samples: int, hidden_size: int, num_feature_layers: int,
                        storage_dtype: str, content: str = fmt.CONTENT_HIDDEN,
                        top_k: int | None = None) -> dict[str, Any]:
    per_token = fmt.bytes_per_token(hidden_size, num_feature_layers, storage_dtype, content, top_k)
    if content == fmt.CONTENT_TOP_K:
        formula = (f"top_k={top_k} x (4 (id) + {fmt.top_k_logprobs_torch_dtype(storage_dtype).itemsize} (log-prob)) "
                   "+ 4 (ids) + 1 (mask)")
    else:
        formula = (f"{fmt.feature_torch_dtype(storage_dtype).itemsize} x H={hidden_size} x "
                   f"layers={num_feature_layers} (+ fp32 scales for fp8) + final hidden + 4 (ids) + 1 (mask) "
                   f"+ 4 (target log-normaliser)")
    return {"num_samples": num_samples, "num_tokens": num_tokens, "storage_dtype": storage_dtype, "content": content,
            "bytes_per_token": per_token, "total_bytes": per_token * num_tokens, "formula": formula}


def format_estimate(estimate: dict[str, Any], where: str = "") -> str:
    gib = estimate["total_bytes"] / 2**30
    content = estimate.get("content", fmt.CONTENT_HIDDEN)
    return (f"{where}cache size estimate: {estimate['num_samples']} samples, {estimate['num_tokens']:,} tokens x "
            f"{estimate['bytes_per_token']:,} B/token ({estimate['storage_dtype']}"
            f"{'' if content == fmt.CONTENT_HIDDEN else ', ' + content}) = "
            f"{estimate['total_bytes']:,} B ({gib:.3f} GiB)")


def stored_sample_tensors(sample: PlannedSample, features_TF: torch.Tensor | None, final_hidden_TH: torch.Tensor | None,
                          target_lse_T: torch.Tensor | None, top_k: tuple[torch.Tensor, torch.Tensor] | None, *,
                          content: str, storage_dtype: str, num_feature_layers: int) -> dict[str, torch.Tensor]:
    """One sample's tensors exactly as a shard stores them (names and dtypes of FORMAT.md), in shard order.
    The one conversion from captured features to stored bytes: the writer and online training both use it."""
    stored = {fmt.TENSOR_INPUT_IDS: sample.input_ids, fmt.TENSOR_LOSS_MASK: sample.loss_mask}
    if content == fmt.CONTENT_TOP_K:
        ids_TK, logprobs_TK = top_k
        stored[fmt.TENSOR_TOP_K_IDS] = ids_TK.to(torch.int32)
        stored[fmt.TENSOR_TOP_K_LOGPROBS] = logprobs_TK.to(fmt.top_k_logprobs_torch_dtype(storage_dtype))
    else:
        stored[fmt.TENSOR_FINAL_HIDDEN] = final_hidden_TH.to(fmt.final_hidden_torch_dtype(storage_dtype))
        if target_lse_T is not None:  # None only in online training that does not read it (never in a cache)
            stored[fmt.TENSOR_TARGET_LSE] = target_lse_T.float()
    if content == fmt.CONTENT_HIDDEN and num_feature_layers:  # none in top-k / final-hidden-only caches
        if storage_dtype != "fp8":
            stored[fmt.TENSOR_FEATURES] = features_TF.to(fmt.feature_torch_dtype(storage_dtype))
        else:
            stored[fmt.TENSOR_FEATURES], stored[fmt.TENSOR_FEATURES_SCALE] = fmt.quantize_fp8(features_TF,
                                                                                              num_feature_layers)
    return stored


def fp8_error_sums(features_TF: torch.Tensor | None, stored: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(squared error, squared reference) of fp8-stored features against the captured ones; (0, 0) otherwise."""
    if fmt.TENSOR_FEATURES_SCALE not in stored:
        return 0.0, 0.0
    reference_TF = features_TF.double()
    error_TF = fmt.dequantize_fp8(stored[fmt.TENSOR_FEATURES], stored[fmt.TENSOR_FEATURES_SCALE],
                                  torch.float64) - reference_TF
    return float(error_TF.square().sum()), float(reference_TF.square().sum())


@dataclass
class CapturedSample:
    """What the target produced for one sample of a batch, padding stripped (the inputs of `ShardWriter.add`)."""

    features_TF: torch.Tensor
    final_hidden_TH: torch.Tensor
    target_lse_T: torch.Tensor | None = None
    top_k: tuple[torch.Tensor, torch.Tensor] | None = None


def capture_batch(model, batch: Sequence[PlannedSample], layer_ids: Sequence[int], *, storage_dtype: str,
                  content: str, top_k: int | None, pad_token_id: int, partitioned: bool = False,
                  target_lse: bool = True) -> list[CapturedSample]:
    """One forward of the target over the batch, right-padded, longest first (`pad_batch`) -> per-sample captures
    on the CPU, in the order of `batch`. The build's computation; online training calls it with its micro-batches
    (or with one sample: the computation of `cache.batch_size=1`). `partitioned`: a ZeRO-3 target
    (deepspec.targets.sharding), whose LM head is gathered for the log-normaliser; every rank must call this
    together then. `target_lse=False` leaves the log-normaliser out (online training whose drafter does not
    read it: a quarter of a small target's arithmetic)."""
    order = sorted(range(len(batch)), key=lambda b: (-batch[b].length, batch[b].position))
    padded = [batch[b] for b in order]
    device = next(model.parameters()).device
    input_ids_BT, attention_mask_BT = pad_batch(padded, pad_token_id, device)
    captured = capture_features(model, input_ids_BT, attention_mask_BT, list(layer_ids))
    features_BTF = captured.features_BTF.cpu()
    # The log-normaliser of the logits the losses will recompute: from the final hidden as stored (rounded).
    stored_hidden_BTH = captured.final_hidden_BTH.to(fmt.final_hidden_torch_dtype(storage_dtype))
    final_hidden_BTH = stored_hidden_BTH.cpu()
    out: list[CapturedSample | None] = [None] * len(batch)
    with gathered([lm_head_weight(model)], partitioned and (target_lse or content == fmt.CONTENT_TOP_K)):
        for row, b in enumerate(order):  # strip the padding: only real tokens are stored
            length = batch[b].length
            item = CapturedSample(features_BTF[row, :length], final_hidden_BTH[row, :length])
            if content == fmt.CONTENT_TOP_K:  # the target's next-token law, from the exact (un-rounded) final hidden
                ids_TK, logprobs_TK = top_k_logprobs(model, captured.final_hidden_BTH[row, :length], top_k)
                item.top_k = (ids_TK.cpu(), logprobs_TK.cpu())
            elif target_lse:
                item.target_lse_T = target_log_normalizer(model, stored_hidden_BTH[row, :length]).cpu()
            out[b] = item
    return out


class ShardWriter:
    """Buffers stripped samples and writes one safetensors shard (temp + rename) per ~shard_size bytes."""

    def __init__(self, out_dir: Path, rank: int, storage_dtype: str, num_feature_layers: int,
                 shard_size_bytes: int, next_shard_idx: int, content: str = fmt.CONTENT_HIDDEN):
        self.out_dir, self.rank, self.storage_dtype = out_dir, rank, storage_dtype
        self.content = content
        self.num_feature_layers = num_feature_layers
        self.shard_size_bytes = shard_size_bytes
        self.next_shard_idx = next_shard_idx
        self._clear()

    def _clear(self) -> None:
        self.tensors: dict[str, list[torch.Tensor]] = {}
        self.entries: list[dict] = []
        self.num_tokens = 0
        self.num_bytes = 0
        self.fp8_sq_error = 0.0
        self.fp8_sq_reference = 0.0

    def add(self, sample: PlannedSample, features_TF: torch.Tensor, final_hidden_TH: torch.Tensor,
            target_lse_T: torch.Tensor | None = None, top_k: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Buffer one sample: its features, final hidden and target log-normaliser (hidden-state content), or
        `top_k` = (ids [T, K], log-probs [T, K]) of the target's next-token distribution (top-k content)."""
        stored = stored_sample_tensors(sample, features_TF, final_hidden_TH, target_lse_T, top_k,
                                       content=self.content, storage_dtype=self.storage_dtype,
                                       num_feature_layers=self.num_feature_layers)
        self.add_stored(sample, stored, *fp8_error_sums(features_TF, stored))

    def add_stored(self, sample: PlannedSample, stored: Mapping[str, torch.Tensor], fp8_sq_error: float = 0.0,
                   fp8_sq_reference: float = 0.0) -> None:
        """Buffer one sample already converted to its stored tensors (`stored_sample_tensors`): what `add` does
        after the conversion, and what a hybrid training run hands over from its staged samples."""
        self.fp8_sq_error += fp8_sq_error
        self.fp8_sq_reference += fp8_sq_reference
        for name, tensor in stored.items():
            self.tensors.setdefault(name, []).append(tensor.contiguous())
            self.num_bytes += tensor.numel() * tensor.element_size()
        self.entries.append({"position": sample.position, "id": sample.sample_id, "split": sample.split,
                             "offset": self.num_tokens, "length": sample.length,
                             "num_loss_tokens": int(sample.loss_mask.sum())})
        self.num_tokens += sample.length

    @property
    def full(self) -> bool:
        return self.num_bytes >= self.shard_size_bytes

    def flush(self) -> dict | None:
        """Write the buffered samples as one shard; return its partial-index entry (None if empty)."""
        if not self.entries:
            return None
        name = fmt.shard_name(self.rank, self.next_shard_idx)
        tensors = {}
        for key in list(self.tensors):  # free each list of pieces once concatenated: ~2x shard size peak, not 3x
            tensors[key] = torch.cat(self.tensors.pop(key), dim=0)
        # One metadata key: safetensors serialises the metadata map in arbitrary order, and resumed shards
        # must be byte-identical to those of an uninterrupted run.
        header = {"format_version": fmt.FORMAT_VERSION, "rank": self.rank, "storage_dtype": self.storage_dtype}
        # absent = hidden states (shards of earlier versions stay byte-identical)
        if self.content != fmt.CONTENT_HIDDEN:
            header["content"] = self.content
        metadata = {"deepspec_cache": json.dumps(header, sort_keys=True)}
        payload = safetensors_save(tensors, metadata=metadata)
        del tensors
        with atomic_path(self.out_dir / name, len(payload)) as tmp, open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        entry = {"file": name, "sha256": hashlib.sha256(payload).hexdigest(), "num_bytes": len(payload),
                 "num_tokens": self.num_tokens, "fp8_sq_error": self.fp8_sq_error,
                 "fp8_sq_reference": self.fp8_sq_reference, "samples": self.entries}
        self.next_shard_idx += 1
        self._clear()
        return entry


def build_settings(target: LoadedTarget, layer_ids: list[int], *, storage_dtype: str, max_length: int | None,
                   world_size: int, source: dict, data_hash: str, rendering: Rendering | None = None,
                   content: str = fmt.CONTENT_HIDDEN, top_k: int | None = None) -> dict:
    """Everything that determines the cache bytes; a resume refuses a folder built with other settings."""
    rendering = rendering or Rendering()
    recorded = rendering.record()
    fingerprint = target.fingerprint()
    settings = {
        "target": fingerprint["target"], "revision": fingerprint["revision"],
        "config_hash": fingerprint["config_hash"], "tokenizer_hash": fingerprint["tokenizer_hash"],
        "layer_ids": list(layer_ids), "hidden_size": int(target.config.hidden_size),
        "num_target_layers": int(target.num_layers), "storage_dtype": storage_dtype, "max_length": max_length,
        "world_size": world_size, "system_prompt": rendering.system_prompt, "source": source, "data_hash": data_hash,
        "chat_template_kwargs": recorded["chat_template_kwargs"],
        "format_version": fmt.FORMAT_VERSION,  # a resume never mixes shards of two versions
    }
    if recorded["data_format"] != "chat" or recorded["chat_template"] is not None:  # only then, as content below
        settings.update(data_format=recorded["data_format"], chat_template=recorded["chat_template"])
    if content != fmt.CONTENT_HIDDEN:  # only then: partial indices of hidden-state builds resume as before
        settings.update(content=content, top_k=int(top_k))
    return settings


def finished_settings(meta: fmt.CacheMeta) -> dict:
    """The `build_settings` record a finished cache was built with, as its meta.json says (`merge_cache` writes
    meta.json from it)."""
    source = dict(meta.source)
    data_hash = source.pop("data_hash", None)
    settings = {"target": meta.target, "revision": meta.revision, "config_hash": meta.config_hash,
                "tokenizer_hash": meta.tokenizer_hash, "layer_ids": list(meta.layer_ids),
                "hidden_size": meta.hidden_size, "num_target_layers": meta.num_target_layers,
                "storage_dtype": meta.storage_dtype,
                "max_length": meta.max_length, "world_size": meta.world_size, "system_prompt": meta.system_prompt,
                "source": source, "data_hash": data_hash, "chat_template_kwargs": dict(meta.chat_template_kwargs),
                "format_version": meta.format_version}
    if meta.data_format != "chat" or meta.chat_template is not None:
        settings.update(data_format=meta.data_format, chat_template=meta.chat_template)
    if meta.content != fmt.CONTENT_HIDDEN:
        settings.update(content=meta.content, top_k=meta.top_k)
    return settings


def conversations_hash(conversations_by_split: Mapping[str, Sequence]) -> str:
    # A text record's text is hashed too (its messages are only its chat reading); conversations hash as before.
    return sha256_json([[split, conv.id, conv.messages] + ([[conv.text.prompt, conv.text.completion]] if conv.text
                                                           else [])
                        for _, split, conv in iter_positions(conversations_by_split)])


def _remove_leftovers(out_dir: Path, rank: int) -> None:
    """Temp files of this rank from a killed run (atomic_path names them '.<final name>.<random>.tmp')."""
    for pattern in (f".shard-r{rank:02d}-*.tmp", f".{fmt.partial_index_name(rank)}.*.tmp"):
        for path in out_dir.glob(pattern):
            path.unlink()


def _kept_after_failure(out_dir: Path, rank: int) -> str:
    """What a build of this rank that stops now leaves for a rerun: the shards its partial index lists."""
    path = out_dir / fmt.partial_index_name(rank)
    try:
        shards = read_json(path)["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        shards = []
    if not shards:
        return f"no shard of rank {rank} was complete yet (rerunning the same command starts over)"
    num_samples = sum(len(entry["samples"]) for entry in shards)
    return (f"the {len(shards)} complete shard(s) listed in {path.name} ({num_samples} samples) are kept (rerunning "
            "the same command resumes after them)")


# The fields a partial index has ever had: one without a seal but with another field had its seal's name damaged.
PARTIAL_INDEX_FIELDS = frozenset({"format_version", "rank", "world_size", "settings", "vocab_size", "complete",
                                  "stats", "shards"})


def read_partial_index(path: Path, rank: int) -> dict:
    """The partial index of `rank`, refused (naming it, before anything is deleted) when its seal fails: the shards
    it lists and where each sample lies in them are what resume keeps and the merge writes into index.json."""
    partial = read_json(path)
    required = isinstance(partial, dict) and bool(set(partial) - PARTIAL_INDEX_FIELDS)
    problem = fmt.seal_problem(partial, required)
    if problem:
        raise ValueError(f"{path}: damaged ({problem}): the shards it lists cannot be trusted; delete it and build "
                         f"again (rank {rank}'s samples are then computed again)")
    return partial


def load_resume_state(out_dir: Path, rank: int, settings: dict, resume: bool) -> list[dict]:
    """Verified shard entries of an earlier run of this rank; deletes everything else this rank wrote."""
    partial_path = out_dir / fmt.partial_index_name(rank)
    partial = read_partial_index(partial_path, rank) if resume and partial_path.is_file() else None
    _remove_leftovers(out_dir, rank)
    kept: list[dict] = []
    if partial is not None:
        if partial.get("settings") != settings:
            differing = settings_differences(partial.get("settings") or {}, settings)
            raise ValueError(f"{out_dir}: an earlier build of rank {rank} used different settings "
                             f"({'; '.join(differing)}); use another cache.out_dir or resume=False to rebuild")
        for k, entry in enumerate(partial["shards"]):
            shard_path = out_dir / fmt.check_shard_name(entry["file"], f"{partial_path}: shards[{k}].file")
            if shard_path.is_file() and sha256_file(shard_path) == entry["sha256"]:
                kept.append(entry)
            else:
                log.warning("rank %d: shard %s is missing or fails its checksum; its samples are redone",
                            rank, entry["file"])
    elif partial_path.is_file():
        partial_path.unlink()
    kept_files = {e["file"] for e in kept}
    for path in out_dir.glob(f"shard-r{rank:02d}-*.safetensors"):
        if path.name not in kept_files:
            path.unlink()
    if rank == 0:  # the merged view is rewritten by the merge at the end of this build
        for name in (fmt.META_NAME, fmt.INDEX_NAME):
            if (out_dir / name).is_file():
                (out_dir / name).unlink()
    return kept


def _write_partial_index(out_dir: Path, rank: int, settings: dict, shards: list[dict],
                         stats: dict | None, vocab_size: int) -> None:
    # vocab_size beside the settings, not in them: the config hash already pins it, and a partial build of an
    # earlier version (without it) still resumes.
    atomic_write_json(out_dir / fmt.partial_index_name(rank),
                      fmt.sealed({"format_version": fmt.FORMAT_VERSION, "rank": rank,
                                  "world_size": settings["world_size"], "settings": settings, "vocab_size": vocab_size,
                                  "complete": stats is not None, "stats": stats, "shards": shards}), indent=1)


def pad_batch(batch: Sequence[PlannedSample], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right padding to the longest sample: with causal attention the real tokens never see the pad tokens."""
    max_len = max(sample.length for sample in batch)
    input_ids_BT = torch.full((len(batch), max_len), pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(batch), max_len), dtype=torch.long)
    for b, sample in enumerate(batch):
        input_ids_BT[b, :sample.length] = sample.input_ids
        attention_mask_BT[b, :sample.length] = 1
    return input_ids_BT.to(device), attention_mask_BT.to(device)


@dataclass
class Precomputed:
    """What a hybrid training run (deepspec.training.features) hands the build of its cache."""

    read: Callable[[PlannedSample], StagedSample | None]  # a sample computed earlier (checked), or None: compute it
    on_shard: Callable[[dict], None] | None = None  # runs once a shard and the partial index listing it are durable
    lock_held: bool = False  # the caller already holds this rank's lock


@dataclass(frozen=True)
class BuildJob:
    """One rank's build: everything `_build_rank` reads besides the data, the target and the folder."""

    layer_ids: list[int]
    options: CacheSchema  # max_length, batching, storage, shards, resume, progress (validated by CacheSchema)
    rank: int = 0
    world_size: int = 1
    rendering: Rendering = field(default_factory=Rendering)  # format, chat template and options, system prompt
    source: dict = field(default_factory=dict)  # recorded in meta.json
    merge: bool = True
    faults: FaultInjection = field(default_factory=FaultInjection)
    # This rank's samples in the batches to compute them in, in order (None: length-sorted `plan_batches`).
    batches: list[list[PlannedSample]] | None = None
    precomputed: Precomputed | None = None
    started: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} must be in [0, world_size={self.world_size})")


def build_cache(conversations_by_split: Mapping[str, Sequence], target: LoadedTarget, out_dir: str | Path,
                layer_ids: Sequence[int], *, options: CacheSchema | None = None, rank: int = 0, world_size: int = 1,
                rendering: Rendering | None = None, source: dict | None = None, merge: bool = True,
                faults: FaultInjection | None = None, batches: list[list[PlannedSample]] | None = None,
                precomputed: Precomputed | None = None, **option_fields) -> CacheStats:
    """Cache this rank's share of the conversations; merge the index when the whole build is done.

    `options`: the cache options (`CacheSchema`: max_length, batch_size, batch_tokens, storage_dtype, shard_size_mb,
    content, top_k, resume, progress; its defaults when None), each also settable as a keyword (`max_length=64`),
    which replaces that field; the options validate themselves there, once.

    `content` (FORMAT.md): hidden states (`layer_ids` features, none when empty, + the final hidden), or the
    target's `top_k` next-token ids and log-probs only (`layer_ids` must be empty).

    `source` is recorded in meta.json (data spec, split fractions and seed, the loader's `LoadReport` as a
    dict under "load_report": its skip counts are surfaced in the cache counts). With torch.distributed
    initialised all ranks meet at a barrier and rank 0 merges; a single process merges itself; separate
    processes without a process group run `merge_cache(out_dir)` once all have finished.
    `rendering` (deepspec.data.rendering: format, chat template and its options, system prompt; by default the
    chat format with the tokenizer's template) renders every sample and is recorded. When every conversation of
    this rank is skipped, the build is refused (`AllSkipped`) before anything is written, and a folder this call
    created is removed again.

    `batches`: this rank's samples in the batches to compute them in (the ranks' lists together hold every rendered
    sample once, whichever rank renders it), instead of `plan_batches` over `position % world_size == rank`.
    Hybrid training finishes its cache through here (`precomputed`, with the `batches` it computed epoch 0 in):
    samples computed earlier are taken over instead of recomputed (a batch with a sample missing or damaged is
    computed again whole: the same composition, so the same bytes).

    A ZeRO-3 target (deepspec.targets.sharding) needs every rank in each forward: the ranks then walk their
    batches in lockstep (as many steps as the longest plan; a step where any rank computes is a forward on all).
    """
    job = BuildJob(layer_ids=validate_layer_ids(list(layer_ids), target.num_layers, field="cache.layer_ids"),
                   options=dataclasses.replace(options or CacheSchema(), **option_fields),
                   rank=rank, world_size=world_size, rendering=rendering or Rendering(), source=dict(source or {}),
                   merge=merge, faults=faults or FaultInjection(), batches=batches, precomputed=precomputed)
    fmt.check_content(job.options.content, job.layer_ids, job.options.top_k)
    out_dir = Path(out_dir)
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        # One writer per rank and folder: a second run would delete this one's temp files and unlisted shards.
        with ExitStack() as stack:
            if not (precomputed is not None and precomputed.lock_held):
                stack.enter_context(exclusive_lock(out_dir / fmt.lock_name(rank),
                                                   f"rank {rank} of the feature cache {out_dir}"))
            stack.enter_context(reporting_disk_full(survives=lambda: _kept_after_failure(out_dir, rank)))
            stop = stack.enter_context(stop_on_sigterm("dropping the unfinished shard after the current batch, "
                                                       "then exiting"))
            return _build_rank(conversations_by_split, target, out_dir, job, stop)
    except AllSkipped:
        if created and {p.name for p in out_dir.iterdir()} <= {fmt.lock_name(rank)}:
            (out_dir / fmt.lock_name(rank)).unlink(missing_ok=True)
            out_dir.rmdir()
        raise


def _build_rank(conversations_by_split: Mapping[str, Sequence], target: LoadedTarget, out_dir: Path,
                job: BuildJob, stop: StopRequest) -> CacheStats:
    """build_cache's work on a validated job, while holding the rank's lock; `stop` (a SIGTERM) ends it between
    batches, the shards written kept, the samples of the unfinished one dropped (a rerun computes them)."""
    o, rank, world_size, pre, source = job.options, job.rank, job.world_size, job.precomputed, job.source
    top_k = o.top_k if o.content == fmt.CONTENT_TOP_K else None
    settings = build_settings(target, job.layer_ids, storage_dtype=o.storage_dtype, max_length=o.max_length,
                              world_size=world_size, source=source,
                              data_hash=conversations_hash(conversations_by_split), rendering=job.rendering,
                              content=o.content, top_k=top_k)

    rendered = render_samples(conversations_by_split, target.tokenizer, max_length=o.max_length,
                              rendering=job.rendering, rank=rank, world_size=world_size,
                              context_length=target_context_length(target))
    what = f"data.prompts={source['prompts']!r}" if source.get("prompts") else "the conversations"
    rendered.require_samples(what + (f" (rank {rank} of {world_size})" if world_size > 1 else ""))
    planned = job.batches
    samples = [s for batch in planned for s in batch] if planned is not None else rendered.samples
    vocab_size = int(target.config.vocab_size)
    print(format_estimate(estimate_cache_size(sum(s.length for s in samples), len(samples), settings["hidden_size"],
                                              len(job.layer_ids), o.storage_dtype, o.content, top_k),
                          where=f"[rank {rank}/{world_size}] "), flush=True)
    for note in length_notes(rendered, o.max_length, where=f"[rank {rank}/{world_size}] "):
        print(note, flush=True)

    shards = load_resume_state(out_dir, rank, settings, o.resume)
    done_positions = {s["position"] for shard in shards for s in shard["samples"]}
    if planned is not None:  # shards end at batch boundaries: what is done is whole batches
        batches = [kept for batch in planned if (kept := [s for s in batch if s.position not in done_positions])]
    else:  # greedy over the length-sorted rest: dropping the batches already written keeps the others
        batches = plan_batches([s for s in samples if s.position not in done_positions], o.batch_size,
                               o.batch_tokens)
    next_idx = 1 + max((int(e["file"].split("-")[-1].split(".")[0]) for e in shards), default=-1)
    writer = ShardWriter(out_dir, rank, o.storage_dtype, len(job.layer_ids), int(o.shard_size_mb * 2**20), next_idx,
                         o.content)
    num_written = 0
    num_new_tokens = 0

    model = target.model
    pad_token_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    bar = _progress_bar(sum(s.length for batch in batches for s in batch), rank, enabled=o.progress)

    def write_shard() -> None:
        nonlocal num_written
        entry = writer.flush()
        if entry is None:
            return
        shards.append(entry)
        _write_partial_index(out_dir, rank, settings, shards, stats=None, vocab_size=vocab_size)
        if pre is not None and pre.on_shard is not None:
            pre.on_shard(entry)
        num_written += 1
        if job.faults.should_stop(num_written):
            raise InjectedFault(f"faults.stop_after={job.faults.stop_after}: injected failure on rank {rank} "
                                f"after writing {num_written} shard(s)")

    partitioned = is_partitioned(target)
    device = next(model.parameters()).device
    for step in range(max_over_ranks(len(batches), partitioned, device)):
        batch = batches[step] if step < len(batches) else []
        given = [pre.read(sample) if pre is not None else None for sample in batch]
        missing = any(g is None for g in given)
        if any_rank(missing, partitioned, device):  # with a ZeRO-3 target every rank joins each forward
            captures = capture_batch(model, batch or [_lockstep_dummy(pad_token_id)], job.layer_ids,
                                     storage_dtype=o.storage_dtype, content=o.content, top_k=top_k,
                                     pad_token_id=pad_token_id, partitioned=partitioned)
        for b, sample in enumerate(batch):
            if not missing:  # computed earlier (a hybrid training run's epoch 0), checked when read
                writer.add_stored(sample, *given[b])
            else:
                item = captures[b]
                writer.add(sample, item.features_TF, item.final_hidden_TH, target_lse_T=item.target_lse_T,
                           top_k=item.top_k)
        num_batch_tokens = sum(s.length for s in batch)
        num_new_tokens += num_batch_tokens
        if bar is not None:
            bar.update(num_batch_tokens)
        if writer.full:
            write_shard()
        if any_rank(stop.requested, partitioned, device):  # a ZeRO-3 target: every rank stops at the same batch
            raise Terminated(f"stopped by SIGTERM: rank {rank} dropped the samples of its unfinished shard (a rerun "
                             f"computes them); {_kept_after_failure(out_dir, rank)}")
    write_shard()
    if bar is not None:
        bar.close()

    rank_stats = {"num_assigned": rendered.num_assigned, "skipped": dict(rendered.skipped),
                  "problems": rendered.problems, "num_truncated": rendered.num_truncated,
                  "num_over_context": rendered.num_over_context, "num_samples": len(rendered.samples)}
    _write_partial_index(out_dir, rank, settings, shards, stats=rank_stats, vocab_size=vocab_size)
    stats = CacheStats(
        rank=rank, num_samples=sum(len(e["samples"]) for e in shards),
        num_tokens=sum(e["num_tokens"] for e in shards), num_shards=len(shards),
        num_bytes=sum(e["num_bytes"] for e in shards),
        num_resumed_samples=len(done_positions), skipped=dict(rendered.skipped),
        num_truncated=rendered.num_truncated,
        fp8_rel_error=(fmt.relative_l2(sum(e["fp8_sq_error"] for e in shards),
                                       sum(e["fp8_sq_reference"] for e in shards))
                       if o.storage_dtype == "fp8" else None),
        seconds=time.perf_counter() - job.started)
    log.info("rank %d: %d samples (%d resumed), %d new tokens in %.1f s", rank, stats.num_samples,
             stats.num_resumed_samples, num_new_tokens, stats.seconds)
    stats.meta = _merge_when_all_done(out_dir, rank, world_size) if job.merge else None
    return stats


def _lockstep_dummy(pad_token_id: int) -> PlannedSample:
    """A one-token sample for a rank that has no batch left while another computes one (ZeRO-3 lockstep)."""
    return PlannedSample(-1, "", fmt.SPLITS[0], torch.tensor([pad_token_id], dtype=torch.int32),
                         torch.zeros(1, dtype=torch.uint8))


def _merge_when_all_done(out_dir: Path, rank: int, world_size: int) -> fmt.CacheMeta | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        dist.barrier()  # every rank's partial index is complete
        meta = merge_cache(out_dir) if rank == 0 else None
        dist.barrier()  # nobody reads index.json before it exists
        return meta
    if world_size == 1:
        return merge_cache(out_dir)
    log.info("rank %d finished; run merge_cache(%s) once all %d ranks are done", rank, out_dir, world_size)
    return None


def _progress_bar(total_tokens: int, rank: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"cache rank {rank}", position=rank,
                dynamic_ncols=True)


def merge_cache(out_dir: str | Path) -> fmt.CacheMeta:
    """Join every rank's complete partial index into index.json (global order), then write meta.json."""
    out_dir = Path(out_dir)
    first_path = out_dir / fmt.partial_index_name(0)
    if not first_path.is_file():
        raise FileNotFoundError(f"{first_path}: no partial index of rank 0; has the build run?")
    world_size = read_partial_index(first_path, 0)["world_size"]
    partials = []
    for rank in range(world_size):
        path = out_dir / fmt.partial_index_name(rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: rank {rank} of {world_size} has not written its partial index")
        partial = read_partial_index(path, rank)
        if not partial.get("complete"):
            raise ValueError(f"{path}: rank {rank} has not finished (resume the build before merging)")
        if partials and partial["settings"] != partials[0]["settings"]:
            raise ValueError(f"{path}: rank {rank} was built with other settings than rank 0")
        partials.append(partial)
    settings = partials[0]["settings"]

    shards: dict[str, dict] = {}
    samples: list[dict] = []
    skipped: Counter = Counter()
    problems: list[str] = []
    sq_error = sq_reference = 0.0
    num_truncated = num_over_context = 0
    for rank, partial in enumerate(partials):
        for k, entry in enumerate(partial["shards"]):
            fmt.check_shard_name(entry["file"], f"{out_dir / fmt.partial_index_name(rank)}: shards[{k}].file")
            shards[entry["file"]] = {"sha256": entry["sha256"], "num_bytes": entry["num_bytes"],
                                     "num_tokens": entry["num_tokens"], "num_samples": len(entry["samples"]),
                                     "rank": partial["rank"]}
            samples += [{**s, "shard": entry["file"]} for s in entry["samples"]]
            sq_error += entry["fp8_sq_error"]
            sq_reference += entry["fp8_sq_reference"]
        skipped.update(partial["stats"]["skipped"])
        problems += partial["stats"]["problems"]
        num_truncated += partial["stats"]["num_truncated"]
        num_over_context += partial["stats"].get("num_over_context", 0)
    samples.sort(key=lambda s: s["position"])
    _check_each_sample_once(out_dir, samples, partials)
    samples = [{"id": s["id"], "split": s["split"], "shard": s["shard"], "offset": s["offset"],
                "length": s["length"], "position": s["position"], "num_loss_tokens": s["num_loss_tokens"]}
               for s in samples]

    load_report = settings["source"].get("load_report") or {}
    for key in ("num_malformed", "num_empty", "num_unknown_role", "num_truncated"):
        if load_report.get(key):
            skipped[f"input_{key.removeprefix('num_')}"] += load_report[key]
    per_split = {name: {"samples": sum(1 for s in samples if s["split"] == name),
                        "tokens": sum(s["length"] for s in samples if s["split"] == name)} for name in fmt.SPLITS}
    num_tokens = sum(s["length"] for s in samples)
    counts = {"samples": len(samples), "tokens": num_tokens, "loss_tokens": sum(s["num_loss_tokens"] for s in samples),
              "per_split": per_split, "skipped": dict(sorted(skipped.items())),
              "num_skipped": sum(skipped.values()), "truncated_to_max_length": num_truncated,
              "longer_than_target_context": num_over_context,
              "shards": len(shards), "bytes_on_disk": sum(s["num_bytes"] for s in shards.values()),
              "problems": problems[:MAX_PROBLEMS_KEPT]}
    index = {"format_version": fmt.FORMAT_VERSION, "world_size": world_size, "num_samples": len(samples),
             "num_tokens": num_tokens, "shards": shards, "samples": samples}
    meta = fmt.CacheMeta(
        target=settings["target"], revision=settings["revision"], config_hash=settings["config_hash"],
        tokenizer_hash=settings["tokenizer_hash"], layer_ids=settings["layer_ids"],
        hidden_size=settings["hidden_size"], num_target_layers=settings["num_target_layers"],
        storage_dtype=settings["storage_dtype"], max_length=settings["max_length"], world_size=world_size,
        system_prompt=settings["system_prompt"], source={**settings["source"], "data_hash": settings["data_hash"]},
        chat_template_kwargs=settings.get("chat_template_kwargs", {}),
        data_format=settings.get("data_format", "chat"), chat_template=settings.get("chat_template"),
        counts=counts,
        fp8_rel_error=fmt.relative_l2(sq_error, sq_reference) if settings["storage_dtype"] == "fp8" else None,
        content=settings.get("content", fmt.CONTENT_HIDDEN), top_k=settings.get("top_k"),
        vocab_size=partials[0].get("vocab_size"),
        bytes_per_token=fmt.bytes_per_token(settings["hidden_size"], len(settings["layer_ids"]),
                                            settings["storage_dtype"], settings.get("content", fmt.CONTENT_HIDDEN),
                                            settings.get("top_k")))
    meta = fmt.write_index_and_meta(out_dir, index, meta)
    removed = remove_stage(out_dir, "the samples a hybrid training run staged for this cache, which is now finished")
    if removed:
        print(f"cache {out_dir}: {removed}", flush=True)
        log.info("%s", removed)
    return meta


def _check_each_sample_once(out_dir: Path, samples: list[dict], partials: list[dict]) -> None:
    """Every rendered sample is in exactly one shard: no position twice, and as many as the ranks rendered (ranks
    that take their batches from a plan hold other positions than `position % world_size`)."""
    positions = [s["position"] for s in samples]
    twice = sorted({p for p, q in zip(positions, positions[1:]) if p == q})
    if twice:
        raise ValueError(f"{out_dir}: samples at positions {twice[:5]} are in more than one shard; rebuild the cache")
    rendered = [p["stats"].get("num_samples") for p in partials]
    if None not in rendered and sum(rendered) != len(samples):
        raise ValueError(f"{out_dir}: the shards hold {len(samples)} samples, the ranks rendered {sum(rendered)}; "
                         "rebuild the cache")


def settings_differences(old: Mapping, new: Mapping, prefix: str = "") -> list[str]:
    """`field: old vs now new` for every field in which two settings records differ (the fields of two sub-records
    with fields in common by dotted name, e.g. `source.val_fraction`)."""
    differences = []
    for key in sorted(set(old) | set(new)):
        before, now = old.get(key), new.get(key)
        if isinstance(before, Mapping) and isinstance(now, Mapping) and set(before) & set(now):
            differences += settings_differences(before, now, f"{prefix}{key}.")
        elif before != now:
            differences.append(f"{prefix}{key}: {before!r} vs now {now!r}")
    return differences
