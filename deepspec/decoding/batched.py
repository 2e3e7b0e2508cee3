"""Batched speculative decoding: R concurrent requests, ONE target forward per round, ragged lengths.

Each round (`_BatchedRun.round`, one method per step) reads propose -> schedule -> verify -> accept -> retire/admit:
  * propose: the `BatchProposer` drafts after every row's anchor (`deepspec.decoding.proposers`);
  * schedule: the `VerificationPolicy` picks how many of each row's drafts the target verifies (l_r: fixed /
    static threshold / Algorithm 1 with the profiled SPS table over B = sum_r (1 + l_r)); the round is then
    described by one `RoundMetadata` (`deepspec.decoding.proposal`);
  * verify: the target scores every row's [anchor, drafts] in one forward (`batch_cache.BatchedTargetCache`);
  * accept: `accept_draft` with the ragged lengths - the same rejection rule as the batch-1 loop, so every
    request's output law is the target's (greedy: token for token); both caches keep the accepted prefix;
  * retire/admit: finished requests free their row, waiting ones are prefilled and join.

Shape legend: R = active requests (rows), L = 1 + max verified drafts of the round, V = vocabulary,
F = feature width, H = hidden.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from deepspec.decoding.acceptance import Acceptance, AcceptanceNoise, AcceptResult
from deepspec.decoding.batch_cache import BatchedTargetCache, prefill_requests
from deepspec.decoding.loop import synchronize, truncate_at_stop
from deepspec.decoding.proposal import DraftProposal, RoundMetadata
from deepspec.decoding.proposers import BatchProposer
from deepspec.decoding.sampling import SamplingParams, sample_from_logits
from deepspec.decoding.scheduler import SPSTable, VerificationPolicy
from deepspec.decoding.verifier import target_logits


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
class RoundTrace:
    """What one round saw, for callers that collect statistics (e.g. empirical calibration)."""

    request_ids: list[Any]
    draft: DraftProposal
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


def schedule_lengths(draft: DraftProposal, active: Sequence[_Active], policy: VerificationPolicy,
                     sps: SPSTable | Callable[[int], float] | None) -> list[int]:
    """l_r per row: the policy's choice, never past what a request may still emit (the bonus token counts)."""
    max_len_R = [max(min(n, int(a.request.max_new_tokens) - len(a.tokens) - 1), 0)
                 for n, a in zip(draft.drafted_per_row, active)]
    if policy.mode == "fixed" or draft.token_ids_BK.shape[1] == 0:
        return list(max_len_R)
    if draft.confidence_BK is None:
        raise ValueError(f"VerificationPolicy(mode={policy.mode!r}) needs confidences, but the proposer "
                         "returned none (drafter without a confidence head)")
    return policy.lengths(draft.confidence_BK.clamp(0.0, 1.0), max_len_R, sps)


@dataclass
class _BatchedRun:
    """One `batched_speculative_generate` call: the rows in flight, the requests waiting, what was emitted.

    Each method is one step of the round (module docstring); `round` runs them in order. The order of the
    generator's draws (prefill anchors, drafts, acceptance noise) is the order of the steps.
    """

    model: PreTrainedModel
    proposer: BatchProposer
    requests: Sequence[BatchRequest]
    sampling: SamplingParams
    policy: VerificationPolicy
    sps: SPSTable | Callable[[int], float] | None
    acceptance: Acceptance
    max_concurrency: int
    layer_ids: Sequence[int]
    eos: set[int]
    generator: torch.Generator | None
    compact_every: int
    compact_hole_fraction: float
    active: list[_Active] = field(default_factory=list)
    rounds: list[BatchRoundRecord] = field(default_factory=list)
    rounds_since_compact: int = 0

    def __post_init__(self) -> None:
        self.device = next(self.model.parameters()).device
        self.target = BatchedTargetCache(self.model)
        self.results = [RequestResult(req.request_id if req.request_id is not None else i, [])
                        for i, req in enumerate(self.requests)]
        self.pending = list(range(len(self.requests)))
        self.start = time.perf_counter()  # the run's clock: every result's admitted_s / finished_s is an offset

    def admit(self) -> None:
        """Prefill waiting requests (FIFO) into the free rows."""
        while self.pending and len(self.active) < self.max_concurrency:
            joining = [self.pending.pop(0) for _ in range(min(self.max_concurrency - len(self.active),
                                                              len(self.pending)))]
            admitted_s = time.perf_counter() - self.start
            prompts = [torch.as_tensor(list(self.requests[i].prompt_ids), dtype=torch.long, device=self.device)
                       for i in joining]
            prefill = prefill_requests(self.model, prompts, self.layer_ids)
            anchors = sample_from_logits(prefill.last_logits_nV, self.sampling, self.generator).tolist()
            rows = []
            for row, (index, anchor) in enumerate(zip(joining, anchors)):
                self.results[index].admitted_s = admitted_s
                tokens, done = truncate_at_stop([int(anchor)], int(self.requests[index].max_new_tokens), self.eos)
                if done:  # finished by its first token: never joins the batch
                    self.results[index].token_ids = tokens
                    self.results[index].finished_s = time.perf_counter() - self.start
                    continue
                rows.append(row)
                self.active.append(_Active(index, self.requests[index], int(anchor), tokens))
            self.target.add_rows(prefill, rows)
            for row in rows:
                length = prefill.lengths[row]
                self.proposer.add_request(prompts[row], prefill.features_nTF[row, :length],
                                          prefill.final_hidden_nTH[row, :length])

    def anchors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's anchor (its last emitted token, not yet in the target's cache) and the anchor's position."""
        anchors_R = torch.tensor([a.anchor for a in self.active], dtype=torch.long, device=self.device)
        return anchors_R, torch.tensor(self.target.next_pos_R, dtype=torch.long, device=self.device)

    def propose(self, anchors_R: torch.Tensor, anchor_pos_R: torch.Tensor) -> DraftProposal:
        draft = self.proposer.propose(anchors_R, anchor_pos_R, self.sampling, self.generator)
        synchronize(self.device)
        return draft

    def verify(self, meta: RoundMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden_RLH, features_RLF, logits_RLV): one target forward over every row's [anchor, drafts]."""
        hidden_RLH, features_RLF = self.target.forward(meta.input_ids_RL, meta.real_RL, self.layer_ids)
        return hidden_RLH, features_RLF, target_logits(self.model, hidden_RLH)

    def accept(self, meta: RoundMetadata, hidden_RLH: torch.Tensor, features_RLF: torch.Tensor,
               logits_RLV: torch.Tensor) -> tuple[AcceptResult, list[int]]:
        """The rejection rule per row; the target cache and the proposer keep the anchor and the accepted drafts."""
        noise = None if self.sampling.is_greedy else AcceptanceNoise.draw(
            meta.num_rows, meta.width, logits_RLV.shape[-1], generator=self.generator, device=self.device)
        accepted = self.acceptance(meta.draft_ids_RK, meta.draft_probs_RKV, logits_RLV, meta.num_draft_R,
                                   self.sampling, noise)
        num_accepted_R = accepted.num_accepted_B.tolist()
        num_kept_R = [n + 1 for n in num_accepted_R]  # the anchor plus the accepted drafts
        self.target.commit(meta.width + 1, num_kept_R)
        self.proposer.on_accept(meta.input_ids_RL, features_RLF, hidden_RLH, num_kept_R)
        synchronize(self.device)
        return accepted, num_accepted_R

    def retire(self, accepted: AcceptResult, lengths_R: list[int], num_accepted_R: list[int], now: float) -> None:
        """Each row's emitted tokens join its request; rows whose request finished are freed."""
        output_RK1 = accepted.output_ids_BK1.tolist()
        keep_rows = []
        for row, (state, n) in enumerate(zip(self.active, num_accepted_R)):
            emitted = output_RK1[row][: n + 1]
            result = self.results[state.index]
            result.proposed.append(lengths_R[row])
            result.accepted.append(n)
            state.anchor = emitted[-1]
            state.tokens, done = truncate_at_stop(state.tokens + emitted, int(state.request.max_new_tokens), self.eos)
            if done:
                result.token_ids = state.tokens
                result.finished_s = now - self.start
            else:
                keep_rows.append(row)
        if len(keep_rows) < len(self.active):
            self.target.keep_rows(keep_rows)
            self.proposer.keep_rows(keep_rows)
            self.active = [self.active[r] for r in keep_rows]

    def compact_if_due(self) -> None:
        """Squeeze out the masked slots every `compact_every` rounds, or sooner when holes pass the fraction."""
        self.rounds_since_compact += 1
        if self.active and (self.rounds_since_compact >= self.compact_every
                            or self.target.hole_fraction() > self.compact_hole_fraction):
            self.target.compact()
            self.rounds_since_compact = 0

    def round(self, on_round: Callable[[RoundTrace], None] | None) -> None:
        """propose -> schedule -> verify -> accept -> retire/admit, one target forward for every row."""
        anchors_R, anchor_pos_R = self.anchors()
        t_draft = time.perf_counter()
        draft = self.propose(anchors_R, anchor_pos_R)
        t_schedule = time.perf_counter()
        lengths_R = schedule_lengths(draft, self.active, self.policy, self.sps)
        t_verify = time.perf_counter()
        meta = RoundMetadata.build(anchors_R, draft, lengths_R)
        hidden_RLH, features_RLF, logits_RLV = self.verify(meta)
        accepted, num_accepted_R = self.accept(meta, hidden_RLH, features_RLF, logits_RLV)
        now = time.perf_counter()
        record = BatchRoundRecord([self.results[a.index].request_id for a in self.active], list(lengths_R),
                                  num_accepted_R, meta.tokens_verified, meta.tokens_computed,
                                  t_schedule - t_draft, t_verify - t_schedule, now - t_verify)
        self.rounds.append(record)
        if on_round is not None:
            on_round(RoundTrace(record.request_ids, draft, list(lengths_R), num_accepted_R))
        self.retire(accepted, lengths_R, num_accepted_R, now)
        self.compact_if_due()
        self.admit()


@dataclass(frozen=True)
class ServingSettings:
    """How `batched_speculative_generate` serves: requests in flight (FIFO admission), the target feature
    layers the proposer reads (the drafter's `target_layer_ids`), the stop tokens, the scheduler's SPS table
    (else the policy's `sps_table_path`), when the batch's holes are compacted and the acceptance backend."""

    max_concurrency: int = 4
    layer_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()
    sps: SPSTable | Callable[[int], float] | None = None
    compact_every: int = 8
    compact_hole_fraction: float = 0.5
    acceptance_backend: str | Acceptance = "auto"

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency} must be >= 1")
        if self.compact_every < 1 or not 0.0 < self.compact_hole_fraction <= 1.0:
            raise ValueError("compact_every must be >= 1 and compact_hole_fraction in (0, 1]")


@torch.no_grad()
def batched_speculative_generate(
    model: PreTrainedModel,
    proposer: BatchProposer,
    requests: Sequence[BatchRequest],
    sampling: SamplingParams,
    *,
    policy: VerificationPolicy | None = None,
    generator: torch.Generator | None = None,
    on_round: Callable[[RoundTrace], None] | None = None,
    settings: ServingSettings = ServingSettings(),
) -> BatchedGeneration:
    """Serve `requests` as `settings` say, one target forward per round.

    `policy` defaults to fixed-length verification; threshold/scheduler modes need confidences
    from the proposer, and scheduler mode an SPS table (`settings.sps` or the policy's `sps_table_path`).
    """
    _check_requests(requests)
    backend = settings.acceptance_backend
    acceptance = backend if isinstance(backend, Acceptance) else Acceptance(backend)
    run = _BatchedRun(model, proposer, requests, sampling, policy=policy or VerificationPolicy("fixed"),
                      sps=settings.sps, acceptance=acceptance, max_concurrency=settings.max_concurrency,
                      layer_ids=settings.layer_ids, eos={int(e) for e in settings.eos_token_ids},
                      generator=generator, compact_every=settings.compact_every,
                      compact_hole_fraction=settings.compact_hole_fraction)
    run.admit()
    while run.active:
        run.round(on_round)
    return BatchedGeneration(run.results, run.rounds, time.perf_counter() - run.start)
