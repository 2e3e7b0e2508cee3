"""DSpark's heads: the sequential stage (paper eq. 4-6) and the confidence head (eq. 7).

Sequential stage: a transition bias B_k added to the parallel draft logits.

Both heads return the bias as a low-rank pair `(bias_in_NR, bias_out_RV)` with
`B = bias_in @ bias_out`, so the chunked losses never materialise an [N, V] bias at once.
- Markov: `B(x_{k-1}, .) = W1[x_{k-1}] W2`.
- RNN (gated): `z = [s_{k-1}; W1[x_{k-1}]; h_k]`, `s_k = sig(W_g z) * s_{k-1} + (1 - sig(W_g z)) * tanh(W_c z)`,
  `B_k = W2^T tanh(W_o z)`; W_g/W_c/W_o are one Linear split in three; s_0 = 0.
In training x_{k-1} is the ground-truth previous token (slot 0: the anchor); at inference it is the
token sampled at the previous slot.

Confidence head: `c_k = sigmoid(w^T [h_k; W1[x_{k-1}]])` estimates the probability that slot k is accepted
given all earlier slots were. It returns the logit; calibration (STS) divides it by a per-position
temperature at inference. W1 is the sequential head's previous-token embedding when there is one,
otherwise the head owns one.

Vocabulary spaces: W2 produces a bias over the drafter's own vocabulary V (the draft vocabulary Vd when it
is reduced); W1 is indexed by the previous token's row (`BlockDrafter.draft_rows`): the token id with the
full vocabulary, else its draft id, with one extra row (Vd) shared by every token outside the draft
vocabulary: the sequential head still sees "some other token" there, and W1/W2 hold (Vd + 1) r + r Vd
parameters instead of 2 V r.

Shape legend: N = rows (blocks * G), B = batch, G = block size, H = hidden, R = rank, V = vocabulary,
P = previous-token rows of W1 (V, or Vd + 1).
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, num_prev_rows: int | None = None):
        super().__init__()
        self.prev_embed = nn.Embedding(num_prev_rows or vocab_size, rank)  # W1 [P, R]
        self.out = nn.Linear(rank, vocab_size, bias=False)  # W2 (weight [V, R])

    @property
    def bias_out_RV(self) -> torch.Tensor:
        return self.out.weight.T

    def bias_factors(self, hidden_NH: torch.Tensor, prev_ids_N: torch.Tensor, block_size: int) -> torch.Tensor:
        """Training: bias_in_NR for every slot at once (the Markov bias does not depend on h)."""
        return self.prev_embed(prev_ids_N)

    def init_state(self, batch: int, like: torch.Tensor) -> torch.Tensor | None:
        return None

    def step(self, state, hidden_BH: torch.Tensor, prev_ids_B: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.prev_embed(prev_ids_B), None


class RNNHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int, hidden_size: int, num_prev_rows: int | None = None):
        super().__init__()
        self.rank = rank
        self.prev_embed = nn.Embedding(num_prev_rows or vocab_size, rank)  # W1 [P, R]
        self.gates = nn.Linear(2 * rank + hidden_size, 3 * rank)  # [W_g; W_c; W_o]
        self.out = nn.Linear(rank, vocab_size, bias=False)  # W2

    @property
    def bias_out_RV(self) -> torch.Tensor:
        return self.out.weight.T

    def init_state(self, batch: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(batch, self.rank)

    def step(self, state_BR: torch.Tensor, hidden_BH: torch.Tensor, prev_ids_B: torch.Tensor):
        z = torch.cat([state_BR, self.prev_embed(prev_ids_B), hidden_BH], dim=-1)
        gate, cand, out = self.gates(z).split(self.rank, dim=-1)
        gate = torch.sigmoid(gate)
        new_state_BR = gate * state_BR + (1 - gate) * torch.tanh(cand)
        return torch.tanh(out), new_state_BR

    def bias_factors(self, hidden_NH: torch.Tensor, prev_ids_N: torch.Tensor, block_size: int) -> torch.Tensor:
        """Training: unroll the recurrence over the G slots of all blocks in parallel."""
        hidden_BGH = hidden_NH.view(-1, block_size, hidden_NH.shape[-1])
        prev_BG = prev_ids_N.view(-1, block_size)
        state = self.init_state(hidden_BGH.shape[0], hidden_NH)
        outs = []
        for k in range(block_size):
            bias_in_BR, state = self.step(state, hidden_BGH[:, k], prev_BG[:, k])
            outs.append(bias_in_BR)
        return torch.stack(outs, dim=1).reshape(-1, self.rank)


SEQUENTIAL_HEAD_CLASSES = {"markov": MarkovHead, "rnn": RNNHead}


class ConfidenceHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int, num_prev_rows: int, own_embedding: bool):
        super().__init__()
        self.prev_embed = nn.Embedding(num_prev_rows, rank) if own_embedding else None  # W1 [P, R]
        self.score = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden_NH: torch.Tensor, prev_embed_NR: torch.Tensor | None = None,
                prev_ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """Confidence logits [N]; pass the shared W1 rows, or the previous-token rows when the head owns W1."""
        if prev_embed_NR is None:
            if self.prev_embed is None or prev_ids_N is None:
                raise ValueError("ConfidenceHead needs prev_embed_NR (shared W1) or prev_ids_N (own W1)")
            prev_embed_NR = self.prev_embed(prev_ids_N)
        return self.score(torch.cat([hidden_NH, prev_embed_NR], dim=-1)).squeeze(-1)
