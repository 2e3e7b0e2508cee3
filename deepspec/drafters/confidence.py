"""DSpark's confidence head (paper eq. 7): `c_k = sigmoid(w^T [h_k; W1[x_{k-1}]])`.

c_k estimates the probability that slot k is accepted given all earlier slots were. It returns the
logit; calibration (STS) divides it by a per-position temperature at inference. W1 is the
sequential head's previous-token embedding when there is one, otherwise the head owns one.

Shape legend: N = rows, H = hidden, R = rank.
"""

from __future__ import annotations

import torch
from torch import nn


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int, vocab_size: int, own_embedding: bool):
        super().__init__()
        self.prev_embed = nn.Embedding(vocab_size, rank) if own_embedding else None
        self.score = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden_NH: torch.Tensor, prev_embed_NR: torch.Tensor | None = None,
                prev_ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """Confidence logits [N]; pass the shared W1 rows, or the ids when the head owns W1."""
        if prev_embed_NR is None:
            if self.prev_embed is None or prev_ids_N is None:
                raise ValueError("ConfidenceHead needs prev_embed_NR (shared W1) or prev_ids_N (own W1)")
            prev_embed_NR = self.prev_embed(prev_ids_N)
        return self.score(torch.cat([hidden_NH, prev_embed_NR], dim=-1)).squeeze(-1)
