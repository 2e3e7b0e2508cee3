"""Drafter-free proposers, the floors a trained drafter must clear: prompt lookup and a bigram table.

Both are deterministic proposals (`probs_BKV = None`: p_d is one-hot on the proposed token), so the
loop's acceptance test is `u < p_t(x)` at T > 0 and argmax matching at T = 0: lossless like any
drafter. They read no target features.

* `PromptLookupProposer`: n-gram lookup in the request's own tokens (prompt + everything emitted), as
  transformers' prompt-lookup decoding does: for n = max_ngram..1, the first earlier occurrence of
  the last n tokens whose continuation is non-empty; propose up to K tokens that followed it.
* `BigramProposer`: a table anchor -> next token, chained (`y_1 = table[anchor]`, `y_k = table[y_{k-1}]`)
  until K tokens or an unknown entry. `bigram_table` builds it from token sequences and the target's
  argmax next token at each position: table[v] = the argmax seen most often after v (ties: smallest id).

Shape legend: T = tokens, V = vocabulary, K = draft tokens, N = counted positions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from deepspec.decoding.proposal import DraftProposal

UNKNOWN = -1  # table entry of a token never seen as an anchor


def bigram_table(sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """LongTensor [V]: for each token v, the most frequent `next_T[t]` over positions t with `token_T[t] == v`
    and `counted_T[t]`; UNKNOWN where v was never counted. `sequences` yields (token_T, next_T, counted_T)."""
    keys = []
    for token_T, next_T, counted_T in sequences:
        if not token_T.shape == next_T.shape == counted_T.shape:
            raise ValueError(f"bigram_table: token/next/counted shapes differ: {tuple(token_T.shape)}, "
                             f"{tuple(next_T.shape)}, {tuple(counted_T.shape)}")
        counted_T = counted_T.bool()
        keys.append(token_T[counted_T].long() * vocab_size + next_T[counted_T].long())
    table_V = torch.full((vocab_size,), UNKNOWN, dtype=torch.long)
    if not keys:
        return table_V
    pairs_N, counts_N = torch.unique(torch.cat(keys), return_counts=True)  # sorted by (token, next)
    first_N, second_N = pairs_N // vocab_size, pairs_N % vocab_size
    # Stable sort by count descending: within a token, the most frequent next comes first and ties keep
    # ascending next ids; then take the first row of each token.
    order_N = torch.sort(counts_N, descending=True, stable=True).indices
    order_N = order_N[torch.sort(first_N[order_N], stable=True).indices]
    first_sorted_N = first_N[order_N]
    is_first_N = torch.ones_like(first_sorted_N, dtype=torch.bool)
    is_first_N[1:] = first_sorted_N[1:] != first_sorted_N[:-1]
    table_V[first_sorted_N[is_first_N]] = second_N[order_N][is_first_N]
    return table_V


def prompt_lookup_match(history_T: list[int], num_tokens: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """(tokens that followed the first earlier occurrence of the longest matching suffix n-gram, n); ([], 0)
    when no suffix of length <= max_ngram occurred before with a continuation."""
    length = len(history_T)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = history_T[length - n:]
        for start in range(0, length - n):
            if history_T[start:start + n] == suffix:
                follow = history_T[start + n:start + n + num_tokens]
                if follow:
                    return follow, n
    return [], 0


def prompt_lookup(history_T: list[int], num_tokens: int, max_ngram: int = 3) -> list[int]:
    """Tokens that followed the first earlier occurrence of the longest matching suffix n-gram (n <= max_ngram)."""
    return prompt_lookup_match(history_T, num_tokens, max_ngram)[0]


class _TokenHistoryProposer:
    """Keeps the request's tokens (prompt + kept tokens); subclasses draft from them."""

    def __init__(self, num_draft_tokens: int):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={num_draft_tokens!r} must be an int >= 1")
        self.max_tokens = num_draft_tokens
        self.history: list[int] = []
        self.device = torch.device("cpu")

    def reset(self, prompt_ids_T, features_TF=None, final_hidden_TH=None) -> None:
        self.history = [int(t) for t in prompt_ids_T.tolist()]
        self.device = prompt_ids_T.device

    def on_accept(self, token_ids_N, features_NF=None, final_hidden_NH=None) -> None:
        # token_ids_N = [previous anchor, accepted drafts]: the anchor was not in the history yet.
        self.history.extend(int(t) for t in token_ids_N.tolist())

    def draft(self, anchor_id: int) -> list[int]:
        raise NotImplementedError

    def propose(self, anchor_id: int, anchor_pos: int, sampling=None, generator=None) -> DraftProposal:
        if anchor_pos != len(self.history):
            raise RuntimeError(f"anchor position {anchor_pos} but the proposer holds {len(self.history)} tokens")
        tokens = self.draft(int(anchor_id))[: self.max_tokens]
        return DraftProposal(torch.tensor([tokens], dtype=torch.long, device=self.device).view(1, len(tokens)), None)


class PromptLookupProposer(_TokenHistoryProposer):
    def __init__(self, num_draft_tokens: int = 7, max_ngram: int = 3):
        super().__init__(num_draft_tokens)
        if max_ngram < 1:
            raise ValueError(f"max_ngram={max_ngram} must be >= 1")
        self.max_ngram = max_ngram

    def draft(self, anchor_id: int) -> list[int]:
        return prompt_lookup(self.history + [anchor_id], self.max_tokens, self.max_ngram)


class BigramProposer(_TokenHistoryProposer):
    def __init__(self, table_V: torch.Tensor, num_draft_tokens: int = 7):
        super().__init__(num_draft_tokens)
        if table_V.dim() != 1 or table_V.dtype != torch.long:
            raise ValueError(f"table_V must be a 1-D LongTensor, got {table_V.dtype} {tuple(table_V.shape)}")
        self.table = table_V.tolist()

    def draft(self, anchor_id: int) -> list[int]:
        tokens, prev = [], anchor_id
        while len(tokens) < self.max_tokens:
            prev = self.table[prev]
            if prev == UNKNOWN:
                break
            tokens.append(prev)
        return tokens


@dataclass
class LookupAcceptance:
    """How often prompt lookup's drafts are accepted at T = 0, measured on held-out data: `accepted[n][j]` of
    `reached[n][j]` lookups whose matched n-gram had length n + 1 and whose drafts before j were all accepted got
    draft j accepted too. `conditional(n)` is the smoothed rate ((accepted + 1) / (reached + 2)), the
    counterpart of a drafter's calibrated conditional confidence c_j."""

    max_ngram: int
    num_tokens: int
    accepted: list[list[int]]  # [max_ngram][num_tokens]
    reached: list[list[int]]

    def __post_init__(self) -> None:
        shape = (self.max_ngram, self.num_tokens)
        for name in ("accepted", "reached"):
            rows = getattr(self, name)
            if len(rows) != shape[0] or any(len(r) != shape[1] for r in rows):
                raise ValueError(f"LookupAcceptance.{name} must be {shape[0]} rows of {shape[1]} counts")
        if any(a < 0 or a > r for ar, rr in zip(self.accepted, self.reached) for a, r in zip(ar, rr)):
            raise ValueError("LookupAcceptance: accepted counts must lie in [0, reached]")

    def conditional(self, ngram: int, length: int) -> list[float]:
        """The smoothed conditional acceptance of drafts 0..length-1 after a match of `ngram` tokens."""
        row_a, row_r = self.accepted[ngram - 1], self.reached[ngram - 1]
        return [(row_a[j] + 1) / (row_r[j] + 2) for j in range(min(length, self.num_tokens))]

    def to_dict(self) -> dict:
        return {"max_ngram": self.max_ngram, "num_tokens": self.num_tokens, "accepted": self.accepted,
                "reached": self.reached}

    @classmethod
    def from_dict(cls, data: dict) -> "LookupAcceptance":
        return cls(int(data["max_ngram"]), int(data["num_tokens"]), [[int(x) for x in r] for r in data["accepted"]],
                   [[int(x) for x in r] for r in data["reached"]])

    @classmethod
    def fit(cls, sequences: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], num_tokens: int,
            max_ngram: int = 3) -> "LookupAcceptance":
        """Counts over every anchor a of `sequences` (token_T, target_next_T, anchor_T): prompt lookup over
        x[:a + 1], its drafts compared in order with the target's argmax after a, a + 1, ... (`target_next_T`:
        teacher-forced, the sequence's own tokens before each position) up to the first miss or the end of the
        sequence's anchors."""
        accepted = [[0] * num_tokens for _ in range(max_ngram)]
        reached = [[0] * num_tokens for _ in range(max_ngram)]
        for token_T, next_T, anchor_T in sequences:
            tokens, target_next, anchor = token_T.tolist(), next_T.tolist(), anchor_T.bool().tolist()
            for a in range(len(tokens)):
                if not anchor[a]:
                    continue
                drafts, ngram = prompt_lookup_match(tokens[: a + 1], num_tokens, max_ngram)
                for j, token in enumerate(drafts):
                    if a + j >= len(tokens) or not anchor[a + j]:
                        break
                    reached[ngram - 1][j] += 1
                    if token != target_next[a + j]:
                        break
                    accepted[ngram - 1][j] += 1
        return cls(max_ngram, num_tokens, accepted, reached)
