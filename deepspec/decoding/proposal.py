"""Data passed between proposer, verifier and acceptance in one decoding round.

`DraftProposal` is the one proposal type: what every drafter's `propose`, every batch-1 `Proposer`
and every batched `BatchProposer` returns (a batch-1 proposal is the B = 1 case).

Shape legend: B = requests (rows), K = proposed draft tokens, V = target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftProposal:
    token_ids_BK: torch.Tensor  # int64, in the target vocabulary; entries past num_drafted_B[b] are padding
    probs_BKV: torch.Tensor | None  # distribution each token was drawn from (None: deterministic/greedy)
    confidence_BK: torch.Tensor | None = None  # calibrated conditional survival c_k, if the drafter has a head
    num_drafted_B: list[int] | None = None  # ragged rows: tokens drafted per row (None: all K)
    confidence_logits_BK: torch.Tensor | None = None  # raw confidence logits (before calibration), when recorded

    @property
    def num_tokens(self) -> int:
        return self.token_ids_BK.shape[1]

    @property
    def drafted_per_row(self) -> list[int]:
        if self.num_drafted_B is not None:
            return list(self.num_drafted_B)
        return [self.num_tokens] * self.token_ids_BK.shape[0]

    def truncate(self, length: int) -> "DraftProposal":
        """The first `length` positions of every row."""
        def cut(x):
            return None if x is None else x[:, :length]

        drafted = None if self.num_drafted_B is None else [min(n, length) for n in self.num_drafted_B]
        return DraftProposal(cut(self.token_ids_BK), cut(self.probs_BKV), cut(self.confidence_BK), drafted,
                             cut(self.confidence_logits_BK))


@dataclass
class RoundRecord:
    proposed: int  # draft tokens sent to verification
    accepted: int  # draft tokens accepted
    draft_s: float
    verify_s: float
    drafted: int = 0  # draft tokens produced before truncation by the verification policy

    @property
    def tau(self) -> int:
        """Tokens emitted this round: accepted drafts plus the corrected/bonus token."""
        return self.accepted + 1


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (prompt excluded), truncated at max_new_tokens / EOS
    rounds: list[RoundRecord] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0  # wall-clock of the rounds (prefill excluded)

    @property
    def mean_tau(self) -> float:
        return sum(r.tau for r in self.rounds) / max(len(self.rounds), 1)



@dataclass
class RoundMetadata:
    """One round of the batched loop, from the proposals to what the target scores (cf. vLLM's SpecDecodeMetadata).

    Row r drafted `draft.drafted_per_row[r]` tokens after its anchor; the verification policy chose to verify
    `lengths_R[r]` of them. The target scores `input_ids_RL` = [anchor, verified drafts] per row in one
    forward, padded to the longest row (padding slots hold the anchor, any valid id, and are masked);
    acceptance reads `draft_ids_RK` / `draft_probs_RKV` with the ragged lengths `num_draft_R`.
    """

    anchor_ids_R: torch.Tensor  # [R] int64, the last emitted token per row (not yet in the target cache)
    draft: DraftProposal  # [R, K] what each row drafted
    lengths_R: list[int]  # l_r: draft tokens the target verifies per row (<= drafted, <= the request's budget)
    num_draft_R: torch.Tensor  # [R] int64, lengths_R as a tensor (acceptance's ragged lengths)
    draft_ids_RK: torch.Tensor  # [R, W] int64, W = max_r l_r; entries past l_r are padding
    draft_probs_RKV: torch.Tensor | None  # [R, W, V] the distributions drafts were drawn from (None: greedy)
    input_ids_RL: torch.Tensor  # [R, W + 1] int64, anchor then the verified drafts
    real_RL: torch.Tensor  # [R, W + 1] bool, slot <= l_r (False: padding, masked in the target forward)

    @classmethod
    def build(cls, anchor_ids_R: torch.Tensor, draft: DraftProposal, lengths_R: list[int]) -> "RoundMetadata":
        device = anchor_ids_R.device
        width = max(lengths_R, default=0)
        slot_L = torch.arange(width + 1, device=device)
        num_draft_R = torch.tensor(lengths_R, dtype=torch.long, device=device)
        draft_ids_RK = draft.token_ids_BK[:, :width].to(device)
        real_RL = slot_L[None] <= num_draft_R[:, None]
        input_ids_RL = torch.cat([anchor_ids_R[:, None], draft_ids_RK], dim=1)
        input_ids_RL = torch.where(real_RL, input_ids_RL, anchor_ids_R[:, None])  # padding: any valid id
        probs_RKV = None if draft.probs_BKV is None else draft.probs_BKV[:, :width]
        return cls(anchor_ids_R, draft, list(lengths_R), num_draft_R, draft_ids_RK, probs_RKV, input_ids_RL, real_RL)

    @classmethod
    def make_dummy(cls, draft_token_ids: list[list[int]], anchor_ids: list[int] | None = None,
                   device: torch.device | str = "cpu") -> "RoundMetadata":
        """A round verifying every listed draft (ragged lists allowed; tests)."""
        width = max((len(d) for d in draft_token_ids), default=0)
        ids_RK = torch.tensor([d + [0] * (width - len(d)) for d in draft_token_ids], dtype=torch.long,
                              device=device).view(len(draft_token_ids), width)
        anchors = anchor_ids if anchor_ids is not None else [0] * len(draft_token_ids)
        lengths = [len(d) for d in draft_token_ids]
        draft = DraftProposal(ids_RK, None, None, lengths)
        return cls.build(torch.tensor(anchors, dtype=torch.long, device=device), draft, lengths)

    @property
    def num_rows(self) -> int:
        return len(self.lengths_R)

    @property
    def width(self) -> int:
        """W: the longest verified draft; every row appends W + 1 target slots."""
        return self.draft_ids_RK.shape[1]

    @property
    def tokens_verified(self) -> int:
        """B = sum_r (1 + l_r): the scheduler's verification batch size."""
        return int(sum(self.lengths_R)) + self.num_rows

    @property
    def tokens_computed(self) -> int:
        """R * (W + 1): what the padded forward computes."""
        return self.num_rows * (self.width + 1)
