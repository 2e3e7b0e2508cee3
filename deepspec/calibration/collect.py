"""Collect (confidence logit, prefix survival) pairs per draft position for STS (paper §3.2.1).

Two label kinds, both on the cache's *validation* split:

* empirical (the default; STS label_kind "hard"): real rollouts of the batched decoding loop at T = 1 with a
  fixed seed on the validation prompts (the tokens before each sample's first assistant token), fixed-length
  verification; per round and request the raw confidence logits of the proposed tokens and 1/0 "positions
  1..k were all accepted". Positions beyond the verified length (end of the request's budget) are invalid.
  These are the labels the scheduler needs: observed acceptance of the drafts actually proposed.
* analytic (no target forward needed): each validation block is run exactly as in
  training (ground-truth previous tokens feed the sequential bias and the confidence head), the
  per-position acceptance probability of speculative sampling is ``1 - TV(p_d,k, p_t,k) / 2``
  with ``p_t`` from the frozen LM head on the cached final hidden state (temperature 1), and the
  prefix survival label is the cumulative product over positions 1..k. Positions whose label
  token is missing (end of sequence, non-assistant token) end the block (`valid` is a prefix).
  These are exactly the soft labels the confidence head was trained on, so STS fitted on them finds
  T ~ 1 whatever the drafter's real acceptance: keep them for a quick check, fit on empirical labels.

Every row carries its group (`group_N`: the validation sequence of a block, the rollout of a round), so
`CollectedConfidence.split` holds out whole rollouts: the report half shares no prompt with the fit half.
Confidence logits are the raw head outputs, before any calibration temperatures. Positions are the drafts of
a block (K = `config.num_drafts`: the block size for anchor-predicts, one less for mask-predicts), so STS fits
one temperature per draft the proposer emits.

Shape legend: N = blocks (rows of the result), K = draft positions, V = vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.block.objective import block_terms
from deepspec.drafters.spec import capabilities_of
from deepspec.losses.distribution import IGNORE_INDEX, TermsOptions

log = logging.getLogger(__name__)

LABEL_SOURCES = {"analytic": "analytic", "empirical": "hard"}  # user-facing name -> STS label_kind


@dataclass
class CollectedConfidence:
    confidence_logits_NK: torch.Tensor  # float32 raw confidence-head logits
    survival_NK: torch.Tensor  # float32 prefix survival labels in [0, 1]
    valid_NK: torch.Tensor  # bool, a prefix per row
    labels: str  # "analytic" | "empirical"
    info: dict[str, Any] = field(default_factory=dict)  # counts and settings, for the report
    group_N: torch.Tensor | None = None  # int64: validation sequence (analytic) or rollout (empirical) of each row

    def rows(self, index_M: torch.Tensor) -> "CollectedConfidence":
        group = None if self.group_N is None else self.group_N[index_M]
        return CollectedConfidence(self.confidence_logits_NK[index_M], self.survival_NK[index_M],
                                   self.valid_NK[index_M], self.labels, dict(self.info), group)

    def split(self, holdout: float, seed: int = 0) -> tuple["CollectedConfidence", "CollectedConfidence | None"]:
        """(fit, report): a `holdout` share of the groups (whole rollouts / sequences, shuffled with `seed`) is
        held out for reporting; holdout 0 gives (everything, None)."""
        if not 0.0 <= holdout < 1.0:
            raise ValueError(f"holdout={holdout} must lie in [0, 1)")
        if holdout == 0.0:
            return self, None
        group_N = self.group_N if self.group_N is not None else torch.arange(self.valid_NK.shape[0])
        groups = group_N.unique()
        if groups.numel() < 2:
            raise ValueError(f"holdout={holdout}: {groups.numel()} rollout/sequence, at least 2 are needed to hold "
                             "some out (more validation prompts, or holdout 0)")
        order = groups[torch.randperm(groups.numel(), generator=torch.Generator().manual_seed(seed))]
        num_held = min(max(round(holdout * groups.numel()), 1), groups.numel() - 1)
        held_N = torch.isin(group_N, order[:num_held])
        return self.rows(torch.nonzero(~held_N).flatten()), self.rows(torch.nonzero(held_N).flatten())

    @property
    def label_kind(self) -> str:
        """The STS label kind of these labels ("analytic" soft labels or "hard" 0/1)."""
        return LABEL_SOURCES[self.labels]

    @property
    def num_samples_K(self) -> list[int]:
        return [int(c) for c in self.valid_NK.sum(dim=0)]


def require_confidence_head(drafter) -> None:
    """Raise before any compute when the drafter cannot be calibrated."""
    if not capabilities_of(drafter).confidence_head:
        raise ValueError(f"drafter kind {drafter.config.drafter_kind!r} has no confidence head: only drafters with "
                         "a confidence head (DSpark with confidence_head=true) can be calibrated")


def check_labels(labels: str, drafter=None) -> str:
    """`labels` if it is a label source and (with `drafter`) one its kind's confidences support."""
    if labels not in LABEL_SOURCES:
        raise ValueError(f"labels={labels!r} must be one of {sorted(LABEL_SOURCES)}")
    if drafter is not None and labels not in capabilities_of(drafter).confidence_labels:
        supported = list(capabilities_of(drafter).confidence_labels)
        raise ValueError(f"labels={labels!r}: the confidences of drafter kind {drafter.config.drafter_kind!r} are "
                         f"labelled {supported} only" + (f" (--labels {supported[0]})" if supported else ""))
    return labels


def validation_indices(cache, max_samples: int | None = None) -> list[int]:
    indices = cache.split("validation")
    if not indices:
        raise ValueError(f"cache {getattr(cache, 'path', '')}: the validation split is empty; rebuild the cache "
                         "with a validation fraction > 0")
    return indices if max_samples is None else indices[: int(max_samples)]


def feature_selector(cache, drafter):
    """Map a cached sample to one holding only the drafter's feature layers (the cache may store more)."""
    cache_layers = list(getattr(getattr(cache, "meta", None), "layer_ids", None) or [])
    wanted = list(drafter.config.target_layer_ids)
    if not cache_layers or cache_layers == wanted:
        return lambda sample: sample
    missing = [layer for layer in wanted if layer not in cache_layers]
    if missing:
        raise ValueError(f"cache {getattr(cache, 'path', '')} stores target layers {cache_layers}, but the drafter "
                         f"reads {wanted}: layers {missing} are missing")
    hidden = int(cache.meta.hidden_size)
    columns = torch.cat([torch.arange(cache_layers.index(layer) * hidden, (cache_layers.index(layer) + 1) * hidden)
                         for layer in wanted])
    return lambda sample: replace(sample, features=sample.features[:, columns])


def _prefix(valid_NK: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(valid_NK.long(), dim=1).bool()


@torch.no_grad()
def collect_analytic(drafter, cache, *, max_anchors_per_seq: int = 64, token_budget: int = 4096,
                     max_samples: int | None = None, seed: int = 0, chunk_rows: int = 512) -> CollectedConfidence:
    """Analytic labels from the cached validation split (see module docstring)."""
    require_confidence_head(drafter)
    check_labels("analytic", drafter)
    if drafter.target_parts.final_logit_softcapping:
        raise ValueError("analytic labels: targets with final_logit_softcapping are not supported by the chunked "
                         "TV; use labels='empirical'")
    indices = validation_indices(cache, max_samples)
    select = feature_selector(cache, drafter)
    num_drafts = int(drafter.config.num_drafts)
    builder = BlockBatchBuilder.for_drafter(drafter.config, max_anchors_per_seq, seed)
    device = next(drafter.parameters()).device
    logits, survival, valid, groups = [], [], [], []
    num_sequences_before = 0  # sequences of earlier batches: block_seq_id is per batch
    was_training = drafter.training
    drafter.eval()
    try:
        for batch in builder.batches((select(cache[i]) for i in indices), epoch=0, token_budget=token_budget):
            groups.append(num_sequences_before + batch.block_seq_id_B)
            num_sequences_before += int(batch.context_seq_id_T.max()) + 1
            batch = batch.to(device)
            # with_metrics=False: no argmax
            out, terms = block_terms(drafter, batch, TermsOptions(need=("tv",), chunk_rows=chunk_rows),
                                     with_metrics=False)
            accept_NK = (1.0 - 0.5 * terms.tv_N.float()).clamp(0.0, 1.0).view(-1, num_drafts)
            logits.append(out.confidence_logits_N.float().view(-1, num_drafts).cpu())
            survival.append(torch.cumprod(accept_NK, dim=1).cpu())
            valid.append(_prefix((batch.labels_N != IGNORE_INDEX).view(-1, num_drafts)).cpu())
    finally:
        drafter.train(was_training)
    if not logits:
        raise ValueError(f"analytic labels: no validation sample of cache {getattr(cache, 'path', '')} has an "
                         "assistant token followed by another one (no anchors)")
    result = CollectedConfidence(torch.cat(logits), torch.cat(survival), torch.cat(valid), "analytic",
                                 group_N=torch.cat(groups))
    result.info = {"num_sequences": len(indices), "num_blocks": int(result.valid_NK.shape[0]),
                   "max_anchors_per_seq": max_anchors_per_seq, "seed": seed}
    return result


def validation_prompts(cache, max_prompts: int | None = None, max_prompt_tokens: int | None = None) -> list[list[int]]:
    """Prompts of the validation samples: the tokens before the first assistant (loss-masked) token."""
    prompts = []
    for i in validation_indices(cache):
        sample = cache[i]
        assistant = torch.nonzero(sample.loss_mask).flatten()
        if assistant.numel() == 0 or int(assistant[0]) == 0:
            continue
        prompt = sample.input_ids[: int(assistant[0])].tolist()
        if max_prompt_tokens is not None:
            prompt = prompt[-int(max_prompt_tokens):]
        prompts.append(prompt)
        if max_prompts is not None and len(prompts) >= max_prompts:
            break
    if not prompts:
        raise ValueError(f"cache {getattr(cache, 'path', '')}: no validation sample has a prompt before its first "
                         "assistant token")
    return prompts


@torch.no_grad()
def collect_empirical(drafter, target_model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128,
                      max_concurrency: int = 8, seed: int = 0, eos_token_ids: Sequence[int] = (),
                      temperature: float = 1.0) -> CollectedConfidence:
    """Hard labels from rollouts of the batched loop (fixed-length verification, T = `temperature`)."""
    from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
    from deepspec.decoding.sampling import SamplingParams
    from deepspec.drafters.proposers import make_batch_proposer

    require_confidence_head(drafter)
    if not prompts:
        raise ValueError("empirical labels: no prompts given")
    logits, survival, valid, groups = [], [], [], []

    def record(trace) -> None:
        logits_RK = trace.draft.confidence_logits_BK
        num_positions = logits_RK.shape[1]
        slot_K = torch.arange(num_positions)
        for row, (length, accepted) in enumerate(zip(trace.lengths, trace.num_accepted)):
            if length == 0:
                continue
            logits.append(logits_RK[row].float().cpu())
            survival.append((slot_K < accepted).float())
            valid.append(slot_K < length)
            groups.append(int(trace.request_ids[row]))

    was_training = drafter.training
    drafter.eval()
    try:
        requests = [BatchRequest(list(p), max_new_tokens, request_id=i) for i, p in enumerate(prompts)]
        generator = torch.Generator(device=next(target_model.parameters()).device).manual_seed(seed)
        serving = ServingSettings(max_concurrency=max_concurrency, layer_ids=drafter.config.target_layer_ids,
                                  eos_token_ids=eos_token_ids)
        out = batched_speculative_generate(target_model, make_batch_proposer(drafter), requests,
                                           SamplingParams(temperature=temperature), generator=generator,
                                           on_round=record, settings=serving)
    finally:
        drafter.train(was_training)
    if not logits:
        raise ValueError("empirical labels: the rollouts verified no draft token (max_new_tokens too small?)")
    result = CollectedConfidence(torch.stack(logits), torch.stack(survival), torch.stack(valid), "empirical",
                                 group_N=torch.tensor(groups, dtype=torch.long))
    result.info = {"num_prompts": len(prompts), "num_rounds": len(out.rounds), "max_new_tokens": max_new_tokens,
                   "temperature": temperature, "seed": seed, "generated_tokens": out.total_tokens,
                   "mean_tau": sum(r.mean_tau * len(r.accepted) for r in out.requests)
                   / max(sum(len(r.accepted) for r in out.requests), 1)}
    return result


def collect_empirical_from_cache(drafter, target, cache, *, max_prompts: int | None = 64,
                                 max_new_tokens: int = 128, max_concurrency: int = 8, seed: int = 0
                                 ) -> CollectedConfidence:
    """Empirical labels from rollouts on the cache's validation prompts (`target`: a LoadedTarget), stopping where
    the cache's own rendering says a generation ends (the chat template's end-of-turn tokens with its options; the
    text format: the end-of-sequence token)."""
    from deepspec.data.rendering import Rendering

    eos = Rendering.from_record(getattr(cache, "meta", None)).stop_token_ids(target.tokenizer)
    return collect_empirical(drafter, target.model, validation_prompts(cache, max_prompts),
                             max_new_tokens=max_new_tokens, max_concurrency=max_concurrency, seed=seed,
                             eos_token_ids=eos)
