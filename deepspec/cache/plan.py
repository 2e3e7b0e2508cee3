"""Planning a cache build: conversations -> rendered samples (counted skips and truncations), the batches they are
computed in, and the bytes they will take. Nothing here runs the target or touches the disk.

Shape legend: T = tokens of one sample.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deepspec.cache import format as fmt
from deepspec.data.rendering import Rendering, RenderingOptions, Skipped, SkipReport
from deepspec.targets.load import LoadedTarget

log = logging.getLogger(__name__)

MAX_PROBLEMS_KEPT = 50  # skipped records named in meta.json (the rest counted)
MAX_OVER_CONTEXT_NAMED = 5  # samples cut to the target's context named (the rest counted)
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
    num_over_context: int = 0  # samples longer than the target's context window: cut to it
    over_context_records: list[str] = field(default_factory=list)  # first few: "where (N tokens)"
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
    and samples longer than the target's `context_length` (cut to it, the first few named)."""
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
        num_rendered = len(ids)
        cut_to_max_length = max_length is not None and len(ids) > max_length
        if cut_to_max_length:
            # Same truncation as render_conversation(max_length=...): keep the first max_length tokens.
            ids, mask = ids[:max_length], mask[:max_length]
        if context_length is not None and len(ids) > context_length:
            # Past its context the target's features are unreliable, and one forward over a sample of any length
            # grows without bound (attention is T x T): keep its first context_length tokens. Counted even where
            # the sample is then skipped: online features refuse any such sample, naming it.
            result.num_over_context += 1
            if len(result.over_context_records) < MAX_OVER_CONTEXT_NAMED:
                result.over_context_records.append(f"{conv.where} ({len(ids)} tokens)")
            ids, mask = ids[:context_length], mask[:context_length]
        if not ids:
            result.skips.skip("empty", conv.where, "rendered to zero tokens")
            continue
        if not any(mask) and any(rendered.loss_mask):
            reason = "no_loss_tokens" if rendering.is_text else "no_assistant_tokens"
            result.skips.skip(reason, conv.where, "every token to learn from lies past the first "
                              f"{len(ids)} kept (cache.max_length, or the target's context)")
            continue
        if not any(mask):
            if rendering.is_text:
                result.skips.skip("no_loss_tokens", conv.where, "nothing to learn from (a prompt without completion, "
                                  "or a single token)")
            else:
                result.skips.skip("no_assistant_tokens", conv.where, "all-zero loss mask (no assistant turn, or "
                                  "truncated before the first answer)")
            continue
        # Counted for the samples cached only: a skipped record keeps nothing, cut or not.
        if cut_to_max_length:
            result.longest_before_truncation = max(result.longest_before_truncation, num_rendered)
            result.num_truncated += 1
        result.samples.append(PlannedSample(position, conv.id, split, torch.tensor(ids, dtype=torch.int32),
                                            torch.tensor(mask, dtype=torch.uint8)))
    return result


def target_context_length(target: LoadedTarget) -> int | None:
    return getattr(target.config, "max_position_embeddings", None)


def length_notes(rendered: RenderResult, max_length: int | None, where: str = "") -> list[str]:
    """What happened to long samples, said out loud (meta.json records the same counts)."""
    notes = []
    if rendered.num_truncated:
        notes.append(f"{where}note: {rendered.num_truncated} of {len(rendered.samples)} samples "
                     f"were longer than cache.max_length={max_length} (longest "
                     f"{rendered.longest_before_truncation} tokens) and keep only their first "
                     f"{max_length} tokens")
    if rendered.num_over_context:
        more = rendered.num_over_context - len(rendered.over_context_records)
        named = ", ".join(rendered.over_context_records) + (f" and {more} more" if more else "")
        context = rendered.context_length
        notes.append(f"{where}warning: {rendered.num_over_context} samples were longer than the "
                     f"target's context of {context} tokens (max_position_embeddings): {named}; "
                     f"they keep only their first {context} tokens (past it the target's features "
                     f"are unreliable); set cache.max_length <= {context} to cut them yourself")
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
