"""The standalone drafter in the decoding loops: K autoregressive drafts per round over its own batched KV cache.

One `StandaloneBatchProposer` serves the batched loop (one KV-cache row per request) and, through
`deepspec.decoding.proposers.SingleRowProposer`, the batch-1 loop. Per row it keeps the tokens the target kept
that the draft model has not read yet (`pending`: the prompt when a request joins, the last draft when a round
accepted all of them). A round:
  1. one forward over `pending + [anchor]` per row (right-padded, padding masked) gives the first draft;
  2. K - 1 one-token forwards give the others, each sampled with the loop's `draft_sampler`, so `probs_BKV` is
     the distribution each draft was drawn from (None when greedy);
  3. `on_accept`: the target kept the anchor and n drafts; the draft cache holds the anchor and drafts
     1..K-1, so the K - 1 - min(n, K - 1) rejected ones are rolled back (`BatchedTargetCache.rollback`, cropped
     where every row dropped them) and, when all K were accepted, draft K becomes the next round's pending token.
The draft cache thus always holds exactly the accepted prefix (the target's own tokens), like the target's.

Confidence of draft k: the draft model's own probability of the token it proposed (softmax of its logits at
temperature 1, whatever the sampling settings), as the logit `log p - log(1 - p)` (`confidence_logits_BK`,
what STS calibrates) and `sigmoid(logit / T_k)` with the STS temperatures (`confidence_BK`; = p uncalibrated).

Shape legend: R = rows (requests), L = tokens fed per row, K = drafts, V = target vocabulary, W = draft width.
"""

from __future__ import annotations

import torch

from deepspec.decoding.batch_cache import BatchedTargetCache
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.proposers import SingleRowProposer, check_num_draft
from deepspec.decoding.sampling import SamplingParams, draft_sampler

COMPACT_HOLE_FRACTION = 0.5  # gather each row's kept slots to the front once half the cache is holes


def confidence_logits(logits_RV: torch.Tensor, token_R: torch.Tensor) -> torch.Tensor:
    """float32 `log p - log(1 - p)` of each row's token under softmax(logits) (temperature 1)."""
    logp_R = torch.log_softmax(logits_RV.float(), dim=-1).gather(1, token_R[:, None]).squeeze(1)
    # log(1 - p) = log(-expm1(log p)): exact for p near 1, where 1 - exp(log p) cancels; floor at p = 1.
    return logp_R - torch.log(-torch.expm1(logp_R)).clamp(min=-100.0)


class StandaloneBatchProposer:
    """`BatchProposer` of a standalone drafter (module docstring)."""

    def __init__(self, drafter, num_draft_tokens: int | None = None):
        self.drafter = drafter
        self.max_tokens = check_num_draft(num_draft_tokens, drafter.config.num_speculative_tokens, None, "standalone")
        self.device = next(drafter.parameters()).device
        self.cache = BatchedTargetCache(drafter.decoder)
        self.pending: list[list[int]] = []  # per row: kept tokens the draft model has not read yet
        self.drafts_RK: torch.Tensor | None = None  # the last round's drafts

    def add_request(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.cache.add_empty_rows(1)
        self.pending.append([int(t) for t in prompt_ids_T.tolist()])

    def keep_rows(self, rows: list[int]) -> None:
        self.cache.keep_rows(rows)
        self.pending = [self.pending[r] for r in rows]
        self.drafts_RK = None if self.drafts_RK is None or not rows else self.drafts_RK[rows]

    def _forward(self, ids_RL: torch.Tensor, real_RL: torch.Tensor, lengths_R: list[int]) -> torch.Tensor:
        hidden_RLW, _ = self.cache.forward(ids_RL, real_RL, inputs_embeds_RLH=self.drafter.embed(ids_RL))
        self.cache.commit(ids_RL.shape[1], lengths_R)
        return hidden_RLW

    @torch.no_grad()
    def propose(self, anchor_ids_R: torch.Tensor, anchor_pos_R: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftProposal:
        sampler = draft_sampler(sampling, generator)
        feeds = [pending + [anchor] for pending, anchor in zip(self.pending, anchor_ids_R.tolist())]
        lengths_R = [len(feed) for feed in feeds]
        width, num_rows = max(lengths_R), len(feeds)
        ids_RL = torch.tensor([feed + [0] * (width - len(feed)) for feed in feeds], device=self.device)
        real_RL = torch.arange(width, device=self.device)[None] < torch.tensor(lengths_R, device=self.device)[:, None]
        hidden_RLW = self._forward(ids_RL, real_RL, lengths_R)
        last_RW = hidden_RLW[torch.arange(num_rows, device=self.device),
                             torch.tensor(lengths_R, device=self.device) - 1]
        tokens, probs, logits_of_confidence = [], [], []
        for k in range(self.max_tokens):
            if k:
                last_RW = self._forward(tokens[-1][:, None], torch.ones(num_rows, 1, dtype=torch.bool,
                                                                         device=self.device), [1] * num_rows)[:, 0]
            logits_RV = self.drafter.logits(last_RW)
            token_R, probs_RV = sampler(logits_RV, k)
            tokens.append(token_R)
            probs.append(probs_RV)
            logits_of_confidence.append(confidence_logits(logits_RV, token_R))
        self.pending = [[] for _ in feeds]
        self.drafts_RK = torch.stack(tokens, dim=1)
        logits_RK = torch.stack(logits_of_confidence, dim=1)
        scaled_RK = logits_RK / self._temperatures_K() if self.drafter.config.calibration_temperatures else logits_RK
        probs_RKV = None if probs[0] is None else torch.stack(probs, dim=1)
        return DraftProposal(self.drafts_RK, probs_RKV, torch.sigmoid(scaled_RK), None, logits_RK)

    def _temperatures_K(self) -> torch.Tensor:
        """STS temperatures of positions 1..K (a position past the calibrated ones takes the last temperature)."""
        temperatures = list(self.drafter.config.calibration_temperatures)
        temperatures += temperatures[-1:] * (self.max_tokens - len(temperatures))
        return torch.tensor(temperatures[: self.max_tokens], device=self.device)

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R: list[int]) -> None:
        num_drafts = self.drafts_RK.shape[1]
        accepted_R = [int(n) - 1 for n in num_kept_R]  # the anchor, then the accepted drafts
        for row, accepted in enumerate(accepted_R):
            assert torch.equal(token_ids_RN[row, 1: 1 + accepted].to(self.drafts_RK.device),
                               self.drafts_RK[row, :accepted]), "kept tokens are not this round's drafts"
        in_cache = num_drafts - 1  # drafts 1..K-1 were fed back to draft the next one
        self.cache.rollback([in_cache - min(accepted, in_cache) for accepted in accepted_R])
        self.pending = [[int(self.drafts_RK[row, -1])] if accepted == num_drafts else []
                        for row, accepted in enumerate(accepted_R)]
        if self.cache.hole_fraction() > COMPACT_HOLE_FRACTION:
            self.cache.compact()


def standalone_proposer(drafter, num_draft_tokens: int | None = None) -> SingleRowProposer:
    batch = StandaloneBatchProposer(drafter, num_draft_tokens)
    return SingleRowProposer(batch, batch.max_tokens)


def standalone_batch_proposer(drafter, num_draft_tokens: int | None = None) -> StandaloneBatchProposer:
    return StandaloneBatchProposer(drafter, num_draft_tokens)
