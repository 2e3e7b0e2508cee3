"""Online features (training's `data.features=online`): the frozen target computes each micro-batch's features inside
training, converted to the stored tensors and back, so a sample is what a cache of the same batches would hold.

The conversations (training's `data.source`, the cache job's `data:` section) are rendered by the cache build's own
`render_samples` (same chat template, loss mask, truncation; the seeded id-hash split of `load_and_split`), so index
i is the i-th sample of the cache a `deepspec cache` build of the same data would write. `batch(ids)` runs the
frozen target (torch.no_grad; the training device and `target.dtype`: fp32 on CPU, bf16 on GPU) on a micro-batch and
converts the result to the stored tensors (`stored_sample_tensors`: `data.cache.storage_dtype`, bf16 by default) and
back (`sample_from_stored`), with the very functions the cache build and reader use.

`data.online_batch=micro_batch` (default): one forward per micro-batch, right-padded longest first as the build pads
its batches (`capture_batch`), so a sample's features are bit for bit those of a cache built with the same batch
composition. Against another composition (a `deepspec cache` build batching by length, or the same sample in another
micro-batch in a later epoch) the fp32 forward differs by float rounding (other kernel shapes: a few fp32 eps of a
row's largest value), which the storage dtype's rounding mostly absorbs: a stored value differs by at most one step
of the storage dtype (bf16: 2^-8 of itself) plus that fp32 difference near zero - tests/training/
test_online_features.py holds both. `data.online_batch=sample`: one forward per sample, the computation of
`cache.batch_size=1`, so online and offline training on such a cache are bit for bit the same.

The target's log-normaliser is computed only where the drafter reads it (a reduced draft vocabulary). Validation
samples are computed once per run and kept (their stored tensors, in this rank's memory: the rank's share of
`trainer.val_max_samples` samples x bytes per token). Each rank computes its own micro-batches only.

A target too large for one device: `data.target_sharding=zero3` partitions its weights across the ranks with
DeepSpeed ZeRO-3 (deepspec.targets.sharding: why ZeRO-3 and not tensor parallelism). Each rank still computes its
own micro-batches, on gathered weights: the same features. The gathers are collective, so the ranks compute in
lockstep: a micro-batch is a forward on every rank when any rank has to compute one.

A sample longer than the target's context fails before anything is computed, named by id.
"""

from __future__ import annotations

import torch

from deepspec.cache import format as fmt
from deepspec.cache.capture import capture_batch, fp8_error_sums, stored_sample_tensors
from deepspec.cache.config import ONLINE_BATCH_MODES, ONLINE_OPTIONS, CacheSchema
from deepspec.cache.plan import PlannedSample, render_samples, target_context_length
from deepspec.cache.reader import SampleIndex, sample_from_stored
from deepspec.cache.stage import StagedSample
from deepspec.data.rendering import Rendering
from deepspec.targets.sharding import any_rank, is_partitioned, max_over_ranks
from deepspec.utils.phases import phase


class OnlineFeatures(SampleIndex):
    """`CacheReader` interface over the frozen target: `self[i]` is the sample the cache would hold at index i,
    `self.batch(ids)` a micro-batch of them from one target forward."""

    def __init__(self, conversations_by_split: dict, target, layer_ids: list[int], *, options: CacheSchema,
                 rendering: Rendering, batching: str = "micro_batch", target_lse: bool = True,
                 dtype: torch.dtype | None = torch.float32, where: str = "data.source"):
        if batching not in ONLINE_BATCH_MODES:
            raise ValueError(f"data.online_batch={batching!r} must be one of {list(ONLINE_BATCH_MODES)}")
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
        if self.rendered.num_over_context:  # refused here; the cache build cuts them (plan.py)
            context, over = self.rendered.context_length, self.rendered.num_over_context
            first = self.rendered.over_context_records[0]
            raise ValueError(f"{where}: {over} sample(s) are longer than the target's context of "
                             f"{context} tokens (max_position_embeddings), first {first}: set "
                             f"data.cache.max_length <= {context}")
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
