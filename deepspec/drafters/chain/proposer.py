"""Chain drafters (Eagle3, MTP) seen from the batch-1 loop: target rows are committed with the token that follows.

A chain drafter commits target row t together with x[t+1]; the row of the newest kept token is committed at
the next `propose`, once its successor (the new anchor) is known. Which per-row target tensor the drafter
reads is the spec's choice (`row_inputs`: Eagle3 the fused feature layers, MTP the final hidden state).
The batched loop runs one of these per request (`deepspec.decoding.proposers.PerRequestBatchProposer`).

Shape legend: T = prompt tokens, N = kept tokens, F = feature width, H = hidden, X = the per-row input width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.proposers import check_num_draft
from deepspec.decoding.sampling import SamplingParams, draft_sampler

RowInputs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (features_NF, final_hidden_NH) -> rows_NX


def target_features(features_NF: torch.Tensor, final_hidden_NH: torch.Tensor) -> torch.Tensor:
    return features_NF


def target_final_hidden(features_NF: torch.Tensor, final_hidden_NH: torch.Tensor) -> torch.Tensor:
    return final_hidden_NH


class ChainDrafterProposer:
    """Batch-1 proposer for any chain drafter with `propose(state, rows, next_tokens, sampler, num_draft)`."""

    def __init__(self, drafter, row_inputs: RowInputs, default_num_draft: int, num_draft_tokens: int | None = None):
        self.drafter = drafter
        self.row_inputs = row_inputs
        self.max_tokens = check_num_draft(num_draft_tokens, default_num_draft, None, drafter.config.drafter_kind)
        self.state = None
        self.pending_tokens_N: torch.Tensor | None = None  # kept tokens whose rows are not committed yet
        self.pending_rows_NX: torch.Tensor | None = None

    def reset(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        self.state = self.drafter.new_decode_state()
        self.pending_tokens_N = prompt_ids_T
        self.pending_rows_NX = self.row_inputs(features_TF, final_hidden_TH)

    def propose(self, anchor_id: int, anchor_pos: int, sampling: SamplingParams, generator) -> DraftProposal:
        if self.pending_tokens_N is None:
            raise RuntimeError("propose called twice without on_accept (or before reset)")
        anchor_1 = torch.tensor([anchor_id], device=self.pending_tokens_N.device)
        # Row t is committed with x[t+1]: the pending tokens shifted by one, closed by the anchor.
        next_tokens_1N = torch.cat([self.pending_tokens_N[1:], anchor_1])[None]
        proposal = self.drafter.propose(self.state, self.pending_rows_NX[None], next_tokens_1N,
                                        draft_sampler(sampling, generator), num_draft=self.max_tokens)
        self.pending_tokens_N = self.pending_rows_NX = None
        return proposal

    def on_accept(self, token_ids_N, features_NF, final_hidden_NH) -> None:
        self.pending_tokens_N = token_ids_N
        self.pending_rows_NX = self.row_inputs(features_NF, final_hidden_NH)
