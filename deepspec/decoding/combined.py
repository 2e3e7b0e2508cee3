"""Prompt lookup or the drafter, chosen per round by expected accepted length (a batch-1 `Proposer`; the batched
loop runs one per request, `make_batch_proposer(..., with_prompt_lookup=True)`).

Prompt lookup wins where the text repeats itself (a small target's greedy answers copy their prompt and their own
earlier sentences), a trained drafter elsewhere. Each round `LookupOrDrafterProposer` asks both and proposes the
block expected to keep more drafts:
  * the drafter's expectation is its calibrated conditional confidences' prefix products, sum_j prod_{i<=j} c_i
    (the quantity the verification scheduler ranks by, scheduler.py);
  * prompt lookup's is the same sum over `LookupAcceptance.conditional(n)`, its acceptance after a matched n-gram
    of length n measured on held-out data (lookup.py), which also becomes the proposal's confidences, so a
    confidence-based verification policy reads either proposal alike.

Lossless either way: every proposal goes through the same verification, and the choice never depends on a
token the round samples. At T = 0 the drafter's drafts are its argmaxes, so all its confidences may decide; at
T > 0 a confidence after the first reads the sampled previous draft (DSpark's c_k sees x_{k-1}), so only the
first draft's confidence c_0 may, taken as the rate of every draft (a choice that depended on the drafter's
sampled tokens would skew the distribution they are verified against).

Shape legend: K = draft tokens.
"""

from __future__ import annotations

import torch

from deepspec.decoding.lookup import LookupAcceptance, prompt_lookup_match
from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.sampling import SamplingParams


def expected_accepted(confidence_K: torch.Tensor, greedy: bool) -> float:
    """sum_j prod_{i<=j} c_i; with `greedy=False` every c_i is c_0 (module docstring)."""
    c_K = confidence_K.detach().float().cpu()
    if c_K.numel() == 0:
        return 0.0
    if not greedy:
        c_K = c_K[:1].expand(c_K.shape[0])
    return float(torch.cumprod(c_K, dim=0).sum())


class LookupOrDrafterProposer:
    """Batch-1: the drafter's proposer (`inner`, with a confidence head) and prompt lookup over the request's
    tokens; `lookup_rounds` / `rounds` count the choices."""

    def __init__(self, inner, acceptance: LookupAcceptance):
        self.inner = inner
        self.acceptance = acceptance
        self.max_tokens = inner.max_tokens
        self.history: list[int] = []
        self.rounds = 0
        self.lookup_rounds = 0

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.inner.reset(prompt_ids_T, features_TF, final_hidden_TH)
        self.history = [int(t) for t in prompt_ids_T.tolist()]

    def propose(self, anchor_id: int, anchor_pos: int, sampling: SamplingParams, generator) -> DraftProposal:
        proposal = self.inner.propose(anchor_id, anchor_pos, sampling, generator)
        if proposal.confidence_BK is None:
            raise ValueError("prompt lookup or the drafter: the choice needs the drafter's confidences, and this "
                             "drafter has no confidence head")
        self.rounds += 1
        num_tokens = min(self.max_tokens, self.acceptance.num_tokens)
        drafts, ngram = prompt_lookup_match(self.history + [int(anchor_id)], num_tokens, self.acceptance.max_ngram)
        if not drafts:
            return proposal
        confidence_K = torch.tensor(self.acceptance.conditional(ngram, len(drafts)))
        drafter = expected_accepted(proposal.confidence_BK[0], sampling.is_greedy)
        if expected_accepted(confidence_K, greedy=True) <= drafter:
            return proposal
        self.lookup_rounds += 1
        device = proposal.token_ids_BK.device
        return DraftProposal(torch.tensor([drafts], dtype=torch.long, device=device), None,
                             confidence_K[None].to(device))

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        # token_ids_N = [previous anchor, accepted drafts]: the anchor was not in the history yet.
        self.history.extend(int(t) for t in token_ids_N.tolist())
        self.inner.on_accept(token_ids_N, features_NF, final_hidden_NH)
