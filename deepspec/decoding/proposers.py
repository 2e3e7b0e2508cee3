"""How the decoding loops see a drafter: the batch-1 `Proposer` and the batched `BatchProposer` protocols.

A proposer owns the drafter's per-request inference state and translates the loop's calls:
  * `reset(prompt, features, final_hidden)` / `add_request(...)` - target outputs of the prompt (positions
    0..T-1) when a request starts;
  * `propose(anchor, anchor_pos, sampling, generator)` - draft after the anchor (the last emitted token, not
    yet in the target cache), every draft token drawn with `sampling.draft_sampler(sampling, generator)`, so
    the returned `DraftProposal.probs_BKV` is the distribution each token was actually drawn from;
  * `on_accept(tokens, features, final_hidden[, num_kept])` - target outputs of the previous anchor and the
    accepted drafts (the tokens whose target K/V were kept).

The proposers of a drafter kind live with the kind (`deepspec/drafters/<kind>/`) and are built by
`deepspec.drafters.make_proposer` / `make_batch_proposer`, which ask the drafter's spec. A kind implements one
of the two protocols (block and standalone kinds the batched one, chain kinds the batch-1 one) and its spec
adapts it to the other loop with the adapters here. This module holds the protocols and the proposers that need
no drafter: `NoDraftProposer` (the autoregressive baseline),
`PerRequestBatchProposer` (any batch-1 proposer, one per request, for the batched loop), its converse
`SingleRowProposer` (a batched proposer serving the batch-1 loop with one row) and `NoDraftBatchProposer`.
A drafter-free proposer such as prompt lookup / n-gram fits the same protocol (it returns `probs_BKV=None`: a
deterministic proposal).

Shape legend: B = 1 request, R = active requests (rows), T = prompt tokens, N = kept tokens, K = draft tokens,
F = feature width, H = hidden, V = target vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from deepspec.decoding.kv_cache import pad_entries
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.sampling import SamplingParams


class Proposer(Protocol):
    """A drafter seen from the batch-1 loop (`deepspec.decoding.loop`)."""

    max_tokens: int

    def reset(self, prompt_ids_T: torch.Tensor, features_TF: torch.Tensor, final_hidden_TH: torch.Tensor) -> None: ...

    def propose(self, anchor_id: int, anchor_pos: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftProposal: ...

    def on_accept(self, token_ids_N: torch.Tensor, features_NF: torch.Tensor,
                  final_hidden_NH: torch.Tensor) -> None: ...


class BatchProposer(Protocol):
    """A drafter seen from the batched loop (`deepspec.decoding.batched`); rows follow the active requests.

    `add_request` appends a row (prompt features from its prefill); `keep_rows` keeps the listed rows in that
    order; `propose` drafts every row (`DraftProposal.num_drafted_B` when rows draft different counts);
    `on_accept` hands over the target features of the tokens whose K/V were kept this round (row r: the
    first `num_kept_R[r]` of N).
    """

    def add_request(self, prompt_ids_T: torch.Tensor, features_TF: torch.Tensor,
                    final_hidden_TH: torch.Tensor) -> None: ...

    def keep_rows(self, rows: list[int]) -> None: ...

    def propose(self, anchor_ids_R: torch.Tensor, anchor_pos_R: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftProposal: ...

    def on_accept(self, token_ids_RN: torch.Tensor, features_RNF: torch.Tensor, final_hidden_RNH: torch.Tensor,
                  num_kept_R: list[int]) -> None: ...


def check_num_draft(num_draft_tokens, default: int, limit: int | None, kind: str) -> int:
    """A proposer's drafts per round: `num_draft_tokens` (an int >= 1, at most `limit`), else `default`."""
    if num_draft_tokens is None:
        return default
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be an int >= 1")
    if limit is not None and num_draft_tokens > limit:
        raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the {limit} drafts per round of the "
                         f"{kind} drafter")
    return num_draft_tokens


class NoDraftProposer:
    """Proposes nothing: the batch-1 loop then is plain autoregressive decoding (the baseline)."""

    max_tokens = 0

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self._device = prompt_ids_T.device

    def propose(self, anchor_id, anchor_pos, sampling, generator) -> DraftProposal:
        return DraftProposal(torch.zeros(1, 0, dtype=torch.long, device=self._device), None, None)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        pass


class PerRequestBatchProposer:
    """One batch-1 `Proposer` per request (built by `factory()`), called one after another.

    Works with any proposer of the batch-1 protocol; drafts of different lengths are padded (the loop caps
    each request's verification at its own `num_drafted_B[r]`). A deterministic row (probs None) next to
    sampled rows gets a one-hot distribution, which is what p_d is for it.
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

    def propose(self, anchor_ids_R, anchor_pos_R, sampling, generator) -> DraftProposal:
        drafts = [p.propose(int(a), int(pos), sampling, generator)
                  for p, a, pos in zip(self.proposers, anchor_ids_R.tolist(), anchor_pos_R.tolist())]
        num_drafted_R = [d.num_tokens for d in drafts]
        width = max(num_drafted_R, default=0)
        device = anchor_ids_R.device
        token_ids_RK = torch.stack([pad_entries(d.token_ids_BK[0], width, 0) for d in drafts]) if drafts \
            else torch.zeros(0, 0, dtype=torch.long, device=device)
        probs_RKV = None
        if any(d.probs_BKV is not None for d in drafts):
            vocab = next(d.probs_BKV.shape[-1] for d in drafts if d.probs_BKV is not None)
            rows = []
            for d in drafts:
                probs_KV = d.probs_BKV[0] if d.probs_BKV is not None else \
                    torch.nn.functional.one_hot(d.token_ids_BK[0], vocab).float()
                rows.append(pad_entries(probs_KV.float(), width, 0))
            probs_RKV = torch.stack(rows)
        confidence_RK = None
        if drafts and all(d.confidence_BK is not None for d in drafts):
            confidence_RK = torch.stack([pad_entries(d.confidence_BK[0].float(), width, 0) for d in drafts])
        return DraftProposal(token_ids_RK, probs_RKV, confidence_RK, num_drafted_R)

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R) -> None:
        for r, (proposer, n) in enumerate(zip(self.proposers, num_kept_R)):
            proposer.on_accept(token_ids_RN[r, :n], features_RNF[r, :n], final_hidden_RNH[r, :n])


class SingleRowProposer:
    """A `BatchProposer` used by the batch-1 loop: one row, reset per request (one implementation serves both loops)."""

    def __init__(self, batch_proposer: BatchProposer, max_tokens: int):
        self.batch = batch_proposer
        self.max_tokens = max_tokens

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.batch.keep_rows([])
        self.batch.add_request(prompt_ids_T, features_TF, final_hidden_TH)

    def propose(self, anchor_id, anchor_pos, sampling, generator) -> DraftProposal:
        device = self.batch.device
        return self.batch.propose(torch.tensor([anchor_id], device=device), torch.tensor([anchor_pos], device=device),
                                  sampling, generator)

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        self.batch.on_accept(token_ids_N[None], features_NF[None], final_hidden_NH[None], [int(token_ids_N.shape[0])])


class NoDraftBatchProposer:
    """Drafts nothing: the batched loop then is plain batched autoregressive decoding (the baseline)."""

    def add_request(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def propose(self, anchor_ids_R, anchor_pos_R, sampling, generator) -> DraftProposal:
        num_rows = anchor_ids_R.shape[0]
        return DraftProposal(anchor_ids_R.new_zeros(num_rows, 0), None, None, [0] * num_rows)

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R) -> None:
        pass
