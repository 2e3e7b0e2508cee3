"""Batched speculative decoding: R concurrent requests, ONE target forward per round, ragged lengths.

Each round every active request r drafts a block, the `VerificationPolicy` picks how many of its
draft tokens the target verifies (l_r: fixed / static threshold / Algorithm 1 with the profiled
SPS table over the token batch size B = sum_r (1 + l_r)), and the target scores all rows in one
forward. Acceptance is `accept_draft` with ragged `num_draft_B = l_R` - the same rejection rule as
the batch-1 loop, so every request's output law is the target's (greedy: token for token).

Target KV cache (`BatchedTargetCache`): one transformers `DynamicCache` with one row per active
request. Every round appends `L = 1 + max_r l_r` slots to all rows (shorter rows padded); an
explicit 2-D attention mask over all slots marks real tokens 1 and padding / rejected drafts 0,
and explicit per-row `position_ids` continue each request's own positions. Rejected drafts are
not cropped (other rows may keep theirs); they are masked from then on and compacted away (gather
the valid slots per row) every `compact_every` rounds or when holes exceed a fraction of the
slots. Finished requests free their row; a new request is prefilled alone and merged into the
batch by right-padding the caches to a common slot count (padding masked). Full-attention targets
only: sliding-window layers would evict real slots counted in cache-slot space, not token space.

Proposals: `BlockDrafterBatchProposer` drafts all rows in one DSpark/DFlash `propose` call (the
drafter's context cache is batched with per-entry validity); `PerRequestBatchProposer` wraps one
batch-1 `Proposer` per request (any drafter with the loop's protocol, e.g. `make_proposer`) and
calls them one after another - correct but without batching gains on the draft side.

Shape legend: R = active requests (rows), S = target cache slots, L = 1 + max verified drafts of
the round, K = drafted positions, C = drafter context entries, V = vocabulary, F = feature width,
H = hidden, D = head dim, N = kept tokens per row this round (ragged, padded).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from deepspec.decoding.acceptance import AcceptanceNoise, accept_draft
from deepspec.decoding.loop import synchronize, truncate_at_stop
from deepspec.decoding.sampling import (
    SamplingParams,
    probs_from_logits,
    sample_from_logits,
)
from deepspec.decoding.scheduler import (
    SPSTable,
    VerificationPolicy,
    environment_fingerprint,
    load_or_profile,
)
from deepspec.decoding.verifier import target_logits
from deepspec.targets.family import cache_kwargs, text_config
from deepspec.targets.features import LayerOutputHooks, decoder_stack

# ---------------------------------------------------------------------------------------------
# Requests and records
# ---------------------------------------------------------------------------------------------


@dataclass
class BatchRequest:
    prompt_ids: Sequence[int]
    max_new_tokens: int
    request_id: Any = None


@dataclass
class RequestResult:
    request_id: Any
    token_ids: list[int]  # generated tokens (prompt excluded), truncated at EOS / max_new_tokens
    proposed: list[int] = field(default_factory=list)  # verified draft tokens per round
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per round
    admitted_s: float = 0.0  # wall-clock offsets from the start of the run
    finished_s: float = 0.0

    @property
    def mean_tau(self) -> float:
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / max(self.finished_s - self.admitted_s, 1e-9)


@dataclass
class BatchRoundRecord:
    request_ids: list[Any]
    lengths: list[int]  # l_r: verified draft tokens per request
    accepted: list[int]  # accepted draft tokens per request
    tokens_verified: int  # B = sum_r (1 + l_r), the scheduler's batch size
    tokens_computed: int  # R * L, including padding
    draft_s: float
    schedule_s: float
    verify_s: float


@dataclass
class BatchedGeneration:
    requests: list[RequestResult]  # in the order the requests were given
    rounds: list[BatchRoundRecord]
    wall_s: float  # whole run including prefills

    @property
    def total_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / max(self.wall_s, 1e-9)


@dataclass
class BatchDraft:
    token_ids_RK: torch.Tensor  # int64 (entries past num_drafted_R[r] are padding)
    probs_RKV: torch.Tensor | None  # distribution each token was drawn from; None = deterministic
    confidence_RK: torch.Tensor | None  # calibrated conditional confidences c_{r,k}
    num_drafted_R: list[int]
    confidence_logits_RK: torch.Tensor | None = None  # raw confidence logits, when recorded


# ---------------------------------------------------------------------------------------------
# Proposers
# ---------------------------------------------------------------------------------------------


class BatchProposer(Protocol):
    """A drafter seen from the batched loop; rows follow the loop's active requests.

    `add_request` appends a row (prompt features from its prefill); `keep_rows` keeps the listed
    rows in that order; `propose` drafts every row (anchor = last emitted token, not yet in the
    target cache, at position `anchor_pos_R`); `on_accept` hands over the target features of the
    tokens whose K/V were kept this round (row r: the first `num_kept_R[r]` of N).
    """

    def add_request(self, prompt_ids_T: torch.Tensor, features_TF: torch.Tensor, final_hidden_TH: torch.Tensor) -> None: ...

    def keep_rows(self, rows: list[int]) -> None: ...

    def propose(self, anchor_ids_R: torch.Tensor, anchor_pos_R: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> BatchDraft: ...

    def on_accept(self, token_ids_RN: torch.Tensor, features_RNF: torch.Tensor, final_hidden_RNH: torch.Tensor,
                  num_kept_R: list[int]) -> None: ...


def make_sampler(sampling: SamplingParams, generator: torch.Generator | None):
    """Draft-side sampler for `BlockDrafter.propose`: greedy -> (argmax, None); else (sample, probs)
    with the probabilities after the same temperature/top-k/top-p filter the target side uses."""

    def sampler(logits_BV: torch.Tensor, slot: int):
        if sampling.is_greedy:
            return logits_BV.argmax(dim=-1), None
        probs_BV = probs_from_logits(logits_BV, sampling)
        noise_BV = torch.empty_like(probs_BV).exponential_(generator=generator)
        token_B = (probs_BV / noise_BV.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
        return token_B, probs_BV

    return sampler


def _pad_entries(tensor: torch.Tensor, length: int, dim: int, value=0) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing <= 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_full(shape, value)], dim=dim)


class BlockDrafterBatchProposer:
    """All rows drafted in one `BlockDrafter.propose` call (DSpark/DFlash).

    The drafter's `ContextKVCache` holds one row per request; rows advance by different numbers of
    accepted tokens, so appended entries are marked valid per row and padding is compacted away
    when it exceeds half of the entries. `record_confidence_logits=True` keeps the raw confidence
    logits (before calibration temperatures) of each proposal, for calibration.
    """

    def __init__(self, drafter, record_confidence_logits: bool = False):
        self.drafter = drafter
        self.cache = drafter.new_context_cache()
        self.next_pos_R: list[int] = []
        self.record_confidence_logits = record_confidence_logits
        if record_confidence_logits and getattr(drafter, "confidence", None) is None:
            raise ValueError("record_confidence_logits=True but the drafter has no confidence head")

    @property
    def max_tokens(self) -> int:
        return int(self.drafter.config.block_size)

    def add_request(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        length = int(prompt_ids_T.shape[0])
        row = self.drafter.extend_context(self.drafter.new_context_cache(), features_TF[None],
                                          torch.arange(length, device=features_TF.device)[None])
        self.next_pos_R.append(length)
        if not self.cache.length:
            self.cache = row
            return
        # Right-pad both to a common entry count; padded entries are invalid, hence never attended.
        width = max(self.cache.length, row.length)
        old = self.cache
        old.keys = [torch.cat([_pad_entries(a, width, 2), _pad_entries(b, width, 2)]) for a, b in zip(old.keys, row.keys)]
        old.values = [torch.cat([_pad_entries(a, width, 2), _pad_entries(b, width, 2)])
                      for a, b in zip(old.values, row.values)]
        old.positions_BC = torch.cat([_pad_entries(old.positions_BC, width, 1), _pad_entries(row.positions_BC, width, 1)])
        old.valid_BC = torch.cat([_pad_entries(old.valid_BC, width, 1, False), _pad_entries(row.valid_BC, width, 1, False)])

    def keep_rows(self, rows: list[int]) -> None:
        self.next_pos_R = [self.next_pos_R[r] for r in rows]
        if not rows:
            self.cache = self.drafter.new_context_cache()
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.cache.positions_BC.device)
        self.cache.keys = [k[index] for k in self.cache.keys]
        self.cache.values = [v[index] for v in self.cache.values]
        self.cache.positions_BC = self.cache.positions_BC[index]
        self.cache.valid_BC = self.cache.valid_BC[index]

    def propose(self, anchor_ids_R, anchor_pos_R, sampling, generator) -> BatchDraft:
        recorded: list[torch.Tensor] = []
        handle = None
        if self.record_confidence_logits:
            handle = self.drafter.confidence.register_forward_hook(lambda _m, _i, out: recorded.append(out.detach()))
        try:
            block = self.drafter.propose(self.cache, anchor_ids_R, anchor_pos_R, make_sampler(sampling, generator))
        finally:
            if handle is not None:
                handle.remove()
        num_rows, num_tokens = block.token_ids_BG.shape
        logits_RK = torch.stack(recorded, dim=1).float() if recorded else None
        return BatchDraft(block.token_ids_BG, block.probs_BGV, block.confidence_BG, [num_tokens] * num_rows, logits_RK)

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R) -> None:
        device = features_RNF.device
        width = features_RNF.shape[1]
        start_R = torch.tensor(self.next_pos_R, dtype=torch.long, device=device)
        positions_RN = start_R[:, None] + torch.arange(width, device=device)[None, :]
        valid_RN = torch.arange(width, device=device)[None, :] < torch.tensor(num_kept_R, device=device)[:, None]
        self.drafter.extend_context(self.cache, features_RNF, positions_RN, valid_RN)
        self.next_pos_R = [p + n for p, n in zip(self.next_pos_R, num_kept_R)]
        valid_BC = self.cache.valid_BC
        if valid_BC.numel() and (~valid_BC).sum() > valid_BC.numel() // 2:
            self._compact()

    def _compact(self) -> None:
        cache = self.cache
        counts_R = cache.valid_BC.sum(dim=1)
        width = int(counts_R.max())
        # Stable sort puts each row's valid entries first, in their original order.
        order_RC = torch.sort((~cache.valid_BC).to(torch.int8), dim=1, stable=True).indices[:, :width]
        gather = order_RC[:, None, :, None]
        cache.keys = [k.gather(2, gather.expand(-1, k.shape[1], -1, k.shape[3])) for k in cache.keys]
        cache.values = [v.gather(2, gather.expand(-1, v.shape[1], -1, v.shape[3])) for v in cache.values]
        cache.positions_BC = cache.positions_BC.gather(1, order_RC)
        cache.valid_BC = torch.arange(width, device=counts_R.device)[None, :] < counts_R[:, None]


class PerRequestBatchProposer:
    """One batch-1 `Proposer` per request (built by `factory()`), called one after another.

    Works with any proposer of the batch-1 loop's protocol; drafts of different lengths are padded
    (the loop caps each request's verification at its own `num_drafted_R[r]`). A deterministic row
    (probs None) next to sampled rows gets a one-hot distribution, which is what p_d is for it.
    """

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.proposers: list[Any] = []

    def add_request(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        proposer = self.factory()
        proposer.reset(prompt_ids_T, features_TF, final_hidden_TH)
        self.proposers.append(proposer)

    def keep_rows(self, rows: list[int]) -> None:
        self.proposers = [self.proposers[r] for r in rows]

    def propose(self, anchor_ids_R, anchor_pos_R, sampling, generator) -> BatchDraft:
        drafts = [p.propose(int(a), int(pos), sampling, generator)
                  for p, a, pos in zip(self.proposers, anchor_ids_R.tolist(), anchor_pos_R.tolist())]
        num_drafted_R = [d.num_tokens for d in drafts]
        width = max(num_drafted_R, default=0)
        device = anchor_ids_R.device
        token_ids_RK = torch.stack([_pad_entries(d.token_ids_BK[0], width, 0) for d in drafts]) if drafts \
            else torch.zeros(0, 0, dtype=torch.long, device=device)
        probs_RKV = None
        if any(d.probs_BKV is not None for d in drafts):
            vocab = next(d.probs_BKV.shape[-1] for d in drafts if d.probs_BKV is not None)
            rows = []
            for d in drafts:
                probs_KV = d.probs_BKV[0] if d.probs_BKV is not None else \
                    torch.nn.functional.one_hot(d.token_ids_BK[0], vocab).float()
                rows.append(_pad_entries(probs_KV.float(), width, 0))
            probs_RKV = torch.stack(rows)
        confidence_RK = None
        if drafts and all(d.confidence_BK is not None for d in drafts):
            confidence_RK = torch.stack([_pad_entries(d.confidence_BK[0].float(), width, 0) for d in drafts])
        return BatchDraft(token_ids_RK, probs_RKV, confidence_RK, num_drafted_R)

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R) -> None:
        for r, (proposer, n) in enumerate(zip(self.proposers, num_kept_R)):
            proposer.on_accept(token_ids_RN[r, :n], features_RNF[r, :n], final_hidden_RNH[r, :n])


class NoDraftBatchProposer:
    """Drafts nothing: the batched loop then is plain batched autoregressive decoding (the baseline)."""

    def add_request(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def propose(self, anchor_ids_R, anchor_pos_R, sampling, generator) -> BatchDraft:
        num_rows = anchor_ids_R.shape[0]
        return BatchDraft(anchor_ids_R.new_zeros(num_rows, 0), None, None, [0] * num_rows)

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R) -> None:
        pass


def make_batch_proposer(drafter, target_model=None, **opts) -> BatchProposer:
    """Batched proposals for block drafters (DSpark/DFlash: one `propose` over all rows); any other
    drafter kind gets one batch-1 proposer per request (`deepspec.decoding.proposers.make_proposer`)."""
    if hasattr(drafter, "new_context_cache") and hasattr(drafter, "extend_context"):
        return BlockDrafterBatchProposer(drafter, **opts)
    from deepspec.decoding.proposers import make_proposer

    return PerRequestBatchProposer(lambda: make_proposer(drafter, target_model, **opts))


# ---------------------------------------------------------------------------------------------
# Target cache with holes
# ---------------------------------------------------------------------------------------------


def check_full_attention(model: PreTrainedModel) -> None:
    layer_types = getattr(text_config(model.config), "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"batched decoding supports full-attention targets only; this target has layer_types "
                         f"{sorted(set(layer_types))} (use the batch-1 loop, deepspec.decoding.loop)")


class BatchedTargetCache:
    """A `DynamicCache` with one row per request plus `valid_RS` (real slots) and per-row positions."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache: DynamicCache | None = None
        self.valid_RS: torch.Tensor | None = None
        self.next_pos_R: list[int] = []

    @property
    def num_rows(self) -> int:
        return len(self.next_pos_R)

    @property
    def num_slots(self) -> int:
        return 0 if self.valid_RS is None else int(self.valid_RS.shape[1])

    def _layers(self) -> list:
        return list(self.cache.layers)

    def _set_kv(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.cache = DynamicCache(ddp_cache_data=list(zip(keys, values)))

    def add_rows(self, prefill: Prefill, rows: list[int]) -> None:
        """Merge the listed rows of a prefill as new last rows (caches right-padded to a common width)."""
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long, device=prefill.valid_nT.device)
        new_keys = [layer.keys[index] for layer in prefill.cache.layers]
        new_values = [layer.values[index] for layer in prefill.cache.layers]
        new_valid = prefill.valid_nT[index]
        if self.num_rows == 0:
            self._set_kv(new_keys, new_values)
            self.valid_RS = new_valid
        else:
            width = max(self.num_slots, new_valid.shape[1])
            keys = [torch.cat([_pad_entries(l.keys, width, 2), _pad_entries(k, width, 2)]) for l, k in zip(self._layers(), new_keys)]
            values = [torch.cat([_pad_entries(l.values, width, 2), _pad_entries(v, width, 2)]) for l, v in zip(self._layers(), new_values)]
            self._set_kv(keys, values)
            self.valid_RS = torch.cat([_pad_entries(self.valid_RS, width, 1, False), _pad_entries(new_valid, width, 1, False)])
        self.next_pos_R.extend(prefill.lengths[r] for r in rows)

    def keep_rows(self, rows: list[int]) -> None:
        self.next_pos_R = [self.next_pos_R[r] for r in rows]
        if not rows:
            self.cache, self.valid_RS = None, None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.valid_RS.device)
        self._set_kv([l.keys[index] for l in self._layers()], [l.values[index] for l in self._layers()])
        self.valid_RS = self.valid_RS[index]

    def hole_fraction(self) -> float:
        return 0.0 if self.valid_RS is None or self.valid_RS.numel() == 0 else float((~self.valid_RS).float().mean())

    def compact(self) -> None:
        """Gather each row's valid slots to the front; drop slots no row uses."""
        counts_R = self.valid_RS.sum(dim=1)
        width = int(counts_R.max())
        order_RS = torch.sort((~self.valid_RS).to(torch.int8), dim=1, stable=True).indices[:, :width]
        gather = order_RS[:, None, :, None]
        keys = [l.keys.gather(2, gather.expand(-1, l.keys.shape[1], -1, l.keys.shape[3])) for l in self._layers()]
        values = [l.values.gather(2, gather.expand(-1, l.values.shape[1], -1, l.values.shape[3])) for l in self._layers()]
        self._set_kv(keys, values)
        self.valid_RS = torch.arange(width, device=counts_R.device)[None, :] < counts_R[:, None]

    def forward(self, input_ids_RL: torch.Tensor, real_RL: torch.Tensor, layer_ids: Sequence[int]):
        """Append L slots per row and return (hidden_RLH, features_RLF); padding slots are masked."""
        length = input_ids_RL.shape[1]
        device = input_ids_RL.device
        positions_RL = torch.tensor(self.next_pos_R, device=device)[:, None] + torch.arange(length, device=device)[None]
        attention_mask = torch.cat([self.valid_RS, real_RL], dim=1).long()
        stack = decoder_stack(self.model)
        with LayerOutputHooks(self.model, list(layer_ids)) as hooks:
            out = stack(input_ids=input_ids_RL, attention_mask=attention_mask, position_ids=positions_RL,
                        **cache_kwargs(stack, self.cache), use_cache=True)
            hidden_RLH = out.last_hidden_state
            features_RLF = hooks.features(hidden_RLH)
        # Until acceptance decides, only the real tokens count; `commit` narrows to the kept ones.
        self.valid_RS = torch.cat([self.valid_RS, real_RL], dim=1)
        return hidden_RLH, features_RLF

    def commit(self, length: int, num_kept_R: list[int]) -> None:
        """After a forward of `length` slots, keep the first num_kept_R[r] of them in row r."""
        device = self.valid_RS.device
        keep_RL = torch.arange(length, device=device)[None] < torch.tensor(num_kept_R, device=device)[:, None]
        self.valid_RS[:, -length:] = keep_RL
        self.next_pos_R = [p + n for p, n in zip(self.next_pos_R, num_kept_R)]


@dataclass
class Prefill:
    cache: DynamicCache  # n rows, right-padded to the longest prompt
    valid_nT: torch.Tensor  # bool, real prompt tokens
    lengths: list[int]
    last_logits_nV: torch.Tensor  # next-token logits after each prompt's last token
    features_nTF: torch.Tensor
    final_hidden_nTH: torch.Tensor


@torch.no_grad()
def prefill_requests(model: PreTrainedModel, prompts: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> Prefill:
    """Prefill several prompts in one right-padded forward (padding masked, positions from 0 per row)."""
    device = prompts[0].device
    lengths = [int(p.shape[0]) for p in prompts]
    width = max(lengths)
    ids_nT = torch.stack([_pad_entries(p.long(), width, 0) for p in prompts])
    slot_T = torch.arange(width, device=device)
    valid_nT = slot_T[None] < torch.tensor(lengths, device=device)[:, None]
    cache = DynamicCache(config=model.config)
    stack = decoder_stack(model)
    with LayerOutputHooks(model, list(layer_ids)) as hooks:
        out = stack(input_ids=ids_nT, attention_mask=valid_nT.long(),
                    position_ids=slot_T[None].expand(len(prompts), -1), **cache_kwargs(stack, cache), use_cache=True)
        hidden_nTH = out.last_hidden_state
        features_nTF = hooks.features(hidden_nTH)
    last_nH = hidden_nTH[torch.arange(len(prompts), device=device), torch.tensor(lengths, device=device) - 1]
    return Prefill(cache, valid_nT, lengths, target_logits(model, last_nH), features_nTF, hidden_nTH)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


@dataclass
class RoundTrace:
    """What one round saw, for callers that collect statistics (e.g. empirical calibration)."""

    request_ids: list[Any]
    draft: BatchDraft
    lengths: list[int]
    num_accepted: list[int]


@dataclass
class _Active:
    index: int  # position in the caller's request list
    request: BatchRequest
    anchor: int
    tokens: list[int]


def _check_requests(requests: Sequence[BatchRequest]) -> None:
    for i, req in enumerate(requests):
        if len(req.prompt_ids) == 0:
            raise ValueError(f"requests[{i}].prompt_ids is empty")
        if int(req.max_new_tokens) < 1:
            raise ValueError(f"requests[{i}].max_new_tokens={req.max_new_tokens} must be >= 1")


@torch.no_grad()
def batched_speculative_generate(
    model: PreTrainedModel,
    proposer: BatchProposer,
    requests: Sequence[BatchRequest],
    sampling: SamplingParams,
    *,
    policy: VerificationPolicy | None = None,
    sps: SPSTable | Callable[[int], float] | None = None,
    max_concurrency: int = 4,
    layer_ids: Sequence[int] = (),
    eos_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    compact_every: int = 8,
    compact_hole_fraction: float = 0.5,
    acceptance_backend: str = "auto",
    on_round: Callable[[RoundTrace], None] | None = None,
) -> BatchedGeneration:
    """Serve `requests` with up to `max_concurrency` in flight (FIFO admission), one target forward per round.

    `layer_ids` are the target feature layers the proposer reads (the drafter's `target_layer_ids`).
    `policy` defaults to fixed-length verification; threshold/scheduler modes need confidences
    from the proposer, and scheduler mode an SPS table (`sps=` or the policy's `sps_table_path`).
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    if compact_every < 1 or not 0.0 < compact_hole_fraction <= 1.0:
        raise ValueError("compact_every must be >= 1 and compact_hole_fraction in (0, 1]")
    check_full_attention(model)
    _check_requests(requests)
    policy = policy or VerificationPolicy("fixed")
    device = next(model.parameters()).device
    eos = {int(e) for e in eos_token_ids}
    target = BatchedTargetCache(model)
    results = [RequestResult(req.request_id if req.request_id is not None else i, []) for i, req in enumerate(requests)]
    rounds: list[BatchRoundRecord] = []
    active: list[_Active] = []
    pending = list(range(len(requests)))
    start = time.perf_counter()
    rounds_since_compact = 0

    def admit() -> None:
        while pending and len(active) < max_concurrency:
            joining = [pending.pop(0) for _ in range(min(max_concurrency - len(active), len(pending)))]
            admitted_s = time.perf_counter() - start
            prompts = [torch.as_tensor(list(requests[i].prompt_ids), dtype=torch.long, device=device) for i in joining]
            prefill = prefill_requests(model, prompts, layer_ids)
            anchors = sample_from_logits(prefill.last_logits_nV, sampling, generator).tolist()
            rows = []
            for row, (index, anchor) in enumerate(zip(joining, anchors)):
                results[index].admitted_s = admitted_s
                tokens, done = truncate_at_stop([int(anchor)], int(requests[index].max_new_tokens), eos)
                if done:  # finished by its first token: never joins the batch
                    results[index].token_ids = tokens
                    results[index].finished_s = time.perf_counter() - start
                    continue
                rows.append(row)
                active.append(_Active(index, requests[index], int(anchor), tokens))
            target.add_rows(prefill, rows)
            for row in rows:
                length = prefill.lengths[row]
                proposer.add_request(prompts[row], prefill.features_nTF[row, :length], prefill.final_hidden_nTH[row, :length])

    admit()
    while active:
        num_rows = len(active)
        anchors_R = torch.tensor([a.anchor for a in active], dtype=torch.long, device=device)
        anchor_pos_R = torch.tensor(target.next_pos_R, dtype=torch.long, device=device)
        t_draft = time.perf_counter()
        draft = proposer.propose(anchors_R, anchor_pos_R, sampling, generator)
        synchronize(device)
        t_schedule = time.perf_counter()
        # Never verify past what a request may still emit (the bonus token counts as one).
        max_len_R = [max(min(n, int(a.request.max_new_tokens) - len(a.tokens) - 1), 0)
                     for n, a in zip(draft.num_drafted_R, active)]
        if policy.mode == "fixed" or draft.token_ids_RK.shape[1] == 0:
            lengths_R = list(max_len_R)
        else:
            if draft.confidence_RK is None:
                raise ValueError(f"VerificationPolicy(mode={policy.mode!r}) needs confidences, but the proposer "
                                 "returned none (drafter without a confidence head)")
            lengths_R = policy.lengths(draft.confidence_RK.clamp(0.0, 1.0), max_len_R, sps)
        width = max(lengths_R, default=0)
        t_verify = time.perf_counter()
        slot_L = torch.arange(width + 1, device=device)
        lengths_t = torch.tensor(lengths_R, dtype=torch.long, device=device)
        drafts_RK = draft.token_ids_RK[:, :width].to(device)
        input_ids_RL = torch.cat([anchors_R[:, None], drafts_RK], dim=1)
        real_RL = slot_L[None] <= lengths_t[:, None]
        input_ids_RL = torch.where(real_RL, input_ids_RL, anchors_R[:, None])  # padding: any valid id
        hidden_RLH, features_RLF = target.forward(input_ids_RL, real_RL, layer_ids)
        logits_RLV = target_logits(model, hidden_RLH)
        probs_RKV = None if draft.probs_RKV is None else draft.probs_RKV[:, :width]
        noise = None if sampling.is_greedy else AcceptanceNoise.draw(
            num_rows, width, logits_RLV.shape[-1], generator=generator, device=device)
        accepted = accept_draft(drafts_RK, probs_RKV, logits_RLV, lengths_t, sampling, noise,
                                backend=acceptance_backend)
        num_accepted_R = accepted.num_accepted_B.tolist()
        num_kept_R = [n + 1 for n in num_accepted_R]  # the anchor plus the accepted drafts
        target.commit(width + 1, num_kept_R)
        proposer.on_accept(input_ids_RL, features_RLF, hidden_RLH, num_kept_R)
        synchronize(device)
        now = time.perf_counter()
        rounds.append(BatchRoundRecord([results[a.index].request_id for a in active], list(lengths_R), num_accepted_R,
                                       int(sum(lengths_R)) + num_rows, num_rows * (width + 1),
                                       t_schedule - t_draft, t_verify - t_schedule, now - t_verify))
        if on_round is not None:
            on_round(RoundTrace(rounds[-1].request_ids, draft, list(lengths_R), num_accepted_R))

        output_RK1 = accepted.output_ids_BK1.tolist()
        keep_rows = []
        for row, (state, n) in enumerate(zip(active, num_accepted_R)):
            emitted = output_RK1[row][: n + 1]
            result = results[state.index]
            result.proposed.append(lengths_R[row])
            result.accepted.append(n)
            state.anchor = emitted[-1]
            state.tokens, done = truncate_at_stop(state.tokens + emitted, int(state.request.max_new_tokens), eos)
            if done:
                result.token_ids = state.tokens
                result.finished_s = now - start
            else:
                keep_rows.append(row)
        if len(keep_rows) < num_rows:
            target.keep_rows(keep_rows)
            proposer.keep_rows(keep_rows)
            active = [active[r] for r in keep_rows]
        rounds_since_compact += 1
        if active and (rounds_since_compact >= compact_every or target.hole_fraction() > compact_hole_fraction):
            target.compact()
            rounds_since_compact = 0
        admit()
    return BatchedGeneration(results, rounds, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Profiling the target for the scheduler
# ---------------------------------------------------------------------------------------------


def split_tokens_over_rows(num_tokens: int, num_rows: int) -> list[int]:
    """How the batched loop spreads B verified tokens over R rows: every row >= 1, as even as possible."""
    if num_tokens < num_rows:
        raise ValueError(f"cannot spread {num_tokens} tokens over {num_rows} rows (each row verifies >= 1)")
    base, extra = divmod(num_tokens, num_rows)
    return [base + (1 if r < extra else 0) for r in range(num_rows)]


def make_verification_forward_fn(model: PreTrainedModel, num_rows: int, context_len: int, seed: int = 0):
    """`forward_fn(B)` for `profile_sps`: one verification forward of B tokens over `num_rows` rows
    (padded to the longest row, as the loop does) on top of a KV cache of `context_len` tokens per row."""
    check_full_attention(model)
    device = next(model.parameters()).device
    vocab = text_config(model.config).vocab_size
    generator = torch.Generator(device="cpu").manual_seed(seed)
    context_RS = torch.randint(0, vocab, (num_rows, context_len), generator=generator).to(device)
    target = BatchedTargetCache(model)
    target.add_rows(prefill_requests(model, list(context_RS), []), list(range(num_rows)))

    @torch.no_grad()
    def forward_fn(num_tokens: int) -> None:
        per_row = split_tokens_over_rows(num_tokens, num_rows)
        length = max(per_row)
        ids_RL = torch.randint(0, vocab, (num_rows, length), generator=generator).to(device)
        real_RL = torch.arange(length, device=device)[None] < torch.tensor(per_row, device=device)[:, None]
        hidden_RLH, _ = target.forward(ids_RL, real_RL, [])
        target_logits(model, hidden_RLH)  # the LM head is part of every verification step
        synchronize(device)
        # Drop the appended slots again so every call sees the same context length.
        target.cache.crop(-length)
        target.valid_RS = target.valid_RS[:, :-length]

    return forward_fn


def profile_target_sps(model: PreTrainedModel, target_id: str, out_dir: str | Path, num_rows: int, max_block: int,
                       context_len: int = 256, batch_sizes: Sequence[int] | None = None, repeats: int = 5,
                       warmup: int = 2) -> SPSTable:
    """Profile (or reuse) the target's SPS(B) table for `num_rows` concurrent requests.

    Stored as `sps_R{num_rows}_ctx{context_len}.json` under `out_dir` with the environment
    fingerprint (+ rows, context length); `load_or_profile` re-profiles when anything differs.
    Default batch sizes: R .. R * (1 + max_block), about 8 points.
    """
    if num_rows < 1 or max_block < 0:
        raise ValueError(f"profile_target_sps: need num_rows >= 1 and max_block >= 0, got {num_rows}, {max_block}")
    device = next(model.parameters()).device
    largest = num_rows * (1 + max_block)
    if batch_sizes is None:
        step = max(1, math.ceil((largest - num_rows) / 7))
        batch_sizes = sorted(set(range(num_rows, largest + 1, step)) | {largest})
    fingerprint = environment_fingerprint(target_id, str(next(model.parameters()).dtype), str(device))
    fingerprint.update({"num_rows": num_rows, "context_len": context_len})
    path = Path(out_dir) / f"sps_R{num_rows}_ctx{context_len}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    forward_fn = _LazyForward(lambda: make_verification_forward_fn(model, num_rows, context_len))
    return load_or_profile(path, fingerprint, forward_fn, batch_sizes, warmup=warmup, repeats=repeats)


class _LazyForward:
    """Builds the profiling context only if `load_or_profile` actually has to profile."""

    def __init__(self, build: Callable[[], Callable[[int], None]]):
        self._build, self._fn = build, None

    def __call__(self, num_tokens: int) -> None:
        if self._fn is None:
            self._fn = self._build()
        self._fn(num_tokens)
