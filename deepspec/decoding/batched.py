"""Batched speculative decoding: R concurrent requests, ONE target forward per round, ragged lengths.

Each round reads draft -> schedule -> verify -> accept -> retire/admit:
  * draft: the `BatchProposer` drafts after every row's anchor (`deepspec.decoding.proposers`);
  * schedule: the `VerificationPolicy` picks how many of each row's drafts the target verifies (l_r: fixed /
    static threshold / Algorithm 1 with the profiled SPS table over B = sum_r (1 + l_r)); the round is then
    described by one `RoundMetadata` (`deepspec.decoding.proposal`);
  * verify: the target scores every row's [anchor, drafts] in one forward (`batch_cache.BatchedTargetCache`);
  * accept: `accept_draft` with the ragged lengths - the same rejection rule as the batch-1 loop, so every
    request's output law is the target's (greedy: token for token);
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

from deepspec.decoding.acceptance import Acceptance, AcceptanceNoise
from deepspec.decoding.batch_cache import BatchedTargetCache, check_full_attention, prefill_requests
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
    acceptance_backend: str | Acceptance = "auto",
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
    accept = acceptance_backend if isinstance(acceptance_backend, Acceptance) else Acceptance(acceptance_backend)
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
                proposer.add_request(prompts[row], prefill.features_nTF[row, :length],
                                     prefill.final_hidden_nTH[row, :length])

    admit()
    while active:
        # Draft.
        anchors_R = torch.tensor([a.anchor for a in active], dtype=torch.long, device=device)
        anchor_pos_R = torch.tensor(target.next_pos_R, dtype=torch.long, device=device)
        t_draft = time.perf_counter()
        draft = proposer.propose(anchors_R, anchor_pos_R, sampling, generator)
        synchronize(device)
        # Schedule.
        t_schedule = time.perf_counter()
        lengths_R = schedule_lengths(draft, active, policy, sps)
        # Verify.
        t_verify = time.perf_counter()
        meta = RoundMetadata.build(anchors_R, draft, lengths_R)
        hidden_RLH, features_RLF = target.forward(meta.input_ids_RL, meta.real_RL, layer_ids)
        logits_RLV = target_logits(model, hidden_RLH)
        # Accept.
        noise = None if sampling.is_greedy else AcceptanceNoise.draw(
            meta.num_rows, meta.width, logits_RLV.shape[-1], generator=generator, device=device)
        accepted = accept(meta.draft_ids_RK, meta.draft_probs_RKV, logits_RLV, meta.num_draft_R, sampling, noise)
        num_accepted_R = accepted.num_accepted_B.tolist()
        num_kept_R = [n + 1 for n in num_accepted_R]  # the anchor plus the accepted drafts
        target.commit(meta.width + 1, num_kept_R)
        proposer.on_accept(meta.input_ids_RL, features_RLF, hidden_RLH, num_kept_R)
        synchronize(device)
        now = time.perf_counter()
        rounds.append(BatchRoundRecord([results[a.index].request_id for a in active], list(lengths_R), num_accepted_R,
                                       meta.tokens_verified, meta.tokens_computed,
                                       t_schedule - t_draft, t_verify - t_schedule, now - t_verify))
        if on_round is not None:
            on_round(RoundTrace(rounds[-1].request_ids, draft, list(lengths_R), num_accepted_R))

        # Retire finished requests, admit waiting ones.
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
        if len(keep_rows) < meta.num_rows:
            target.keep_rows(keep_rows)
            proposer.keep_rows(keep_rows)
            active = [active[r] for r in keep_rows]
        rounds_since_compact += 1
        if active and (rounds_since_compact >= compact_every or target.hole_fraction() > compact_hole_fraction):
            target.compact()
            rounds_since_compact = 0
        admit()
    return BatchedGeneration(results, rounds, time.perf_counter() - start)
