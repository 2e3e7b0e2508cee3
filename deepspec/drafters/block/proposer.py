"""Block drafters (DFlash, DSpark) seen from the decoding loops: one proposer serves both.

`BlockDrafterBatchProposer` drafts every row in one parallel block forward plus the (optional) sequential head;
the batch-1 loop runs it with one row (`deepspec.decoding.proposers.SingleRowProposer`, built by
`block_proposer`). The drafter's `DraftKVCache` holds the context K/V of the accepted tokens (never the block's
own K/V: each round's block is new): a row's prompt when it joins, after each round its kept tokens (the
previous anchor and the accepted drafts). Rows advance by different numbers of accepted tokens, so appended
entries are marked valid per row, and the padding is compacted away once it exceeds half of the entries (one row
never has any).

Shape legend: R = rows, T = prompt tokens, N = kept tokens, F = feature width.
"""

from __future__ import annotations

import torch

from deepspec.decoding.proposal import DraftProposal
from deepspec.decoding.proposers import check_num_draft
from deepspec.decoding.sampling import draft_sampler


class BlockDrafterBatchProposer:
    """Every row drafted in one `propose` call over a batched context cache; each row's block truncated to
    `num_draft_tokens` (default: all the block's drafts)."""

    def __init__(self, drafter, num_draft_tokens: int | None = None):
        num_drafts = drafter.config.num_drafts  # g (anchor-predicts) or g - 1 (mask-predicts)
        self.drafter = drafter
        self.max_tokens = check_num_draft(num_draft_tokens, num_drafts, num_drafts, drafter.config.drafter_kind)
        self.device = next(drafter.parameters()).device
        self.cache = drafter.new_decode_state()
        self.next_pos_R: list[int] = []  # per row: the position of the next token whose context K/V is appended

    def add_request(self, prompt_ids_T, features_TF, final_hidden_TH) -> None:
        length = int(prompt_ids_T.shape[0])
        row = self.drafter.extend_context(self.drafter.new_decode_state(), features_TF[None],
                                          torch.arange(length, device=features_TF.device)[None])
        self.next_pos_R.append(length)
        self.cache.merge(row)

    def keep_rows(self, rows: list[int]) -> None:
        self.next_pos_R = [self.next_pos_R[r] for r in rows]
        self.cache.select_rows(rows)

    def propose(self, anchor_ids_R, anchor_pos_R, sampling, generator) -> DraftProposal:
        if anchor_pos_R.tolist() != self.next_pos_R:
            raise RuntimeError(f"anchor positions {anchor_pos_R.tolist()} but the drafter's contexts end at "
                               f"{self.next_pos_R}")
        proposal = self.drafter.propose(self.cache, anchor_ids_R, anchor_pos_R, draft_sampler(sampling, generator),
                                        num_draft=self.max_tokens)
        proposal.num_drafted_B = [proposal.num_tokens] * proposal.token_ids_BK.shape[0]
        return proposal

    def on_accept(self, token_ids_RN, features_RNF, final_hidden_RNH, num_kept_R) -> None:
        device = features_RNF.device
        width = features_RNF.shape[1]
        start_R = torch.tensor(self.next_pos_R, dtype=torch.long, device=device)
        positions_RN = start_R[:, None] + torch.arange(width, device=device)[None, :]
        valid_RN = torch.arange(width, device=device)[None, :] < torch.tensor(num_kept_R, device=device)[:, None]
        self.drafter.extend_context(self.cache, features_RNF, positions_RN, valid_RN)
        self.next_pos_R = [p + n for p, n in zip(self.next_pos_R, num_kept_R)]
        if self.cache.num_holes > self.cache.valid_BC.numel() // 2:
            self.cache.compact()
