"""Data passed between proposer, verifier and acceptance in one decoding round.

Shape legend: B = requests, K = proposed draft tokens, V = target vocabulary, F = feature width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from deepspec.decoding.sampling import SamplingParams


@dataclass
class DraftProposal:
    token_ids_BK: torch.Tensor  # int64, in target vocabulary
    probs_BKV: torch.Tensor | None  # distribution each token was drawn from (None: deterministic/greedy)
    confidence_BK: torch.Tensor | None = None  # calibrated conditional survival c_k, if the drafter has a head

    @property
    def num_tokens(self) -> int:
        return self.token_ids_BK.shape[1]

    def truncate(self, length: int) -> "DraftProposal":
        return DraftProposal(
            self.token_ids_BK[:, :length],
            None if self.probs_BKV is None else self.probs_BKV[:, :length],
            None if self.confidence_BK is None else self.confidence_BK[:, :length],
        )


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


class Proposer(Protocol):
    """A drafter seen from the decoding loop (one request).

    The loop calls `reset` once with the prompt's target features, then per round `propose`
    (anchor = the last emitted token, not yet seen by the target) and `on_accept` with the target
    features of the tokens whose target K/V were kept (the previous anchor and the accepted drafts).
    """

    max_tokens: int

    def reset(self, prompt_ids_T: torch.Tensor, features_TF: torch.Tensor, final_hidden_TH: torch.Tensor) -> None: ...

    def propose(self, anchor_id: int, anchor_pos: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> DraftProposal: ...

    def on_accept(self, token_ids_N: torch.Tensor, features_NF: torch.Tensor, final_hidden_NH: torch.Tensor) -> None: ...
