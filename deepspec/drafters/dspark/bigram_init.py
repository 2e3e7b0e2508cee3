"""Data-dependent start for DSpark's Markov head (`drafter.markov_init=bigram`): the sequential bias begins as a
rank-r fit of the training split's bigram statistics whose argmax is the bigram table's, so slot 0 (whose previous
token is the anchor) starts at the bigram-table floor and the backbone learns the residual (with the backbone's
logits starting at zero, `drafter.output_adapter=zero` or `drafter.final_norm_init=0`; else a random backbone's
logits swamp the bias).

Counts c[p, n] over every supervised position t + 1 (loss_mask[t + 1]) with its previous token p = x[t] (the
pairs the block batcher trains the head on: slot 0's previous token is the anchor, later slots' the ground-truth
token before them), where n is the target's argmax next token after t when the samples carry it
(`sample.target_next`: a feature cache stores the target's outputs), else the data's own x[t + 1] (online
features). The target's argmax is what drafts are verified against and what the bigram-table floor counts
(deepspec/benchmarks/floors.py); on data the target did not write (raw ShareGPT answers) the two differ on
most positions. The fitted matrix is sparse and nonnegative:

    M[p, n] = markov_init_scale * max(log(c[p, n] / n_p * V), 0)        (n_p = sum_n c[p, n], V = vocabulary)

i.e. the log ratio of the bigram probability to a uniform 1/V (with a reduced draft vocabulary, the head's
rows: previous tokens through `draft_rows`, next tokens outside the draft vocabulary dropped, V = its size):
within a row, differences of M are the bigram's log-probability differences, and unseen pairs add nothing.
W1 = U sqrt(S), W2 = V sqrt(S) from a truncated SVD of M (`torch.svd_lowrank`, seeded so the drafter's RNG stream
is untouched), with the head's rank r.
Tokens never seen as a previous token get a zero W1 row (no bias).

A rank below the seen rows and columns cannot hold the table: a plain low-rank fit has the table's token on top of
too few rows and scores below the table at slot 0 (docs/results.md, section 8). So the SVD then fits rank r - r/4,
and the last r/4 dimensions select each row's most counted next token (`complete_argmax`: seeded unit vectors per
column, each row the multiple of its token's vector that lifts it SELECTOR_MARGIN above the rest): the bias's argmax
is the table's on every seen row (ties: the smallest target id, the table's rule), at the cost of one pass over the
rows.
Measured on the embedded target in docs/results.md.

Shape legend: V = vocabulary, R = rank, N = counted pairs, P / C = seen previous / next tokens, Q = fitted rank.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

from deepspec.drafters.dspark.heads import MarkovHead

log = logging.getLogger(__name__)

SVD_SEED = 0
SVD_ITERATIONS = 4
SELECTOR_SHARE = 4  # rank // 4 dimensions select the table's token when the rank cannot hold the table
SELECTOR_SEED = 1
SELECTOR_MARGIN = 1.0  # logits by which the selected token leads its row
ROWS_PER_CHUNK = 1024


def bigram_counts(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Coalesced sparse [V, V] float64 counts c[prev, next] over supervised positions (module docstring): next is
    `sample.target_next[t]` (the target's argmax after t) where a sample has it, else the data's x[t + 1]."""
    keys = []
    for sample in samples:
        ids_T, mask_T = sample.input_ids.long(), sample.loss_mask.bool()
        if ids_T.numel() < 2:
            continue
        target_next_T = getattr(sample, "target_next", None)
        next_T = ids_T[1:] if target_next_T is None else target_next_T[:-1].long()
        next_is_supervised_T = mask_T[1:]
        keys.append(ids_T[:-1][next_is_supervised_T] * vocab_size + next_T[next_is_supervised_T])
    pairs_N, counts_N = (torch.unique(torch.cat(keys), return_counts=True) if keys
                         else (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
    indices = torch.stack([pairs_N // vocab_size, pairs_N % vocab_size])
    return torch.sparse_coo_tensor(indices, counts_N.double(), (vocab_size, vocab_size),
                                   check_invariants=True).coalesce()


def bigram_log_ratio(counts_PC: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sparse M[p, n] = scale * max(log(c / n_p * C), 0) of coalesced sparse counts [P, C] (module docstring)."""
    num_rows, num_cols = counts_PC.shape
    prev_N, _ = counts_PC.indices()
    count_N = counts_PC.values()
    row_total_P = torch.zeros(num_rows, dtype=count_N.dtype).index_add_(0, prev_N, count_N)
    value_N = (torch.log(count_N / row_total_P[prev_N]) + math.log(num_cols)).clamp(min=0.0) * scale
    return torch.sparse_coo_tensor(counts_PC.indices(), value_N, counts_PC.shape, check_invariants=False).coalesce()


def draft_row_counts(drafter, counts_VV: torch.Tensor, num_prev_rows: int, num_next: int) -> torch.Tensor:
    """Target-id counts [V, V] -> the head's rows [P, C]: previous tokens through `draft_rows` (every token
    outside a reduced draft vocabulary shares one row), next tokens outside the draft vocabulary dropped."""
    device = drafter.t2d.device if getattr(drafter, "reduced_vocab", False) else torch.device("cpu")
    prev_N, next_N = (drafter.draft_rows(ids.to(device)).cpu() for ids in counts_VV.indices())
    kept_N = next_N < num_next
    return torch.sparse_coo_tensor(torch.stack([prev_N[kept_N], next_N[kept_N]]), counts_VV.values()[kept_N],
                                   (num_prev_rows, num_next), check_invariants=True).coalesce()


def most_counted_next(counts_PC: torch.Tensor,
                      order_C: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(seen rows [S], each row's most counted column [S]) of coalesced sparse counts; ties go to the smallest
    `order_C` (the target ids of the columns; default the column index), the bigram table's rule (lookup.py)."""
    rows_N, cols_N = counts_PC.indices()
    order_N = cols_N if order_C is None else order_C[cols_N]
    # Sort by column order, then stably by count (descending), then stably by row: each row's first entry wins.
    index_N = torch.sort(order_N, stable=True).indices
    index_N = index_N[torch.sort(counts_PC.values()[index_N], descending=True, stable=True).indices]
    index_N = index_N[torch.sort(rows_N[index_N], stable=True).indices]
    rows_sorted_N = rows_N[index_N]
    first_N = torch.ones_like(rows_sorted_N, dtype=torch.bool)
    first_N[1:] = rows_sorted_N[1:] != rows_sorted_N[:-1]
    return rows_sorted_N[first_N], cols_N[index_N][first_N]


def complete_argmax(w1_PR: torch.Tensor, w2_CR: torch.Tensor, counts_PC: torch.Tensor, fitted_rank: int,
                    order_C: torch.Tensor | None = None) -> float:
    """Make every seen row's most counted column its argmax, in place, with the dimensions past `fitted_rank`.

    Seen columns n get seeded random unit vectors u_n in those D dimensions (W2), and row p the multiple
    alpha_p u_t of its most counted column t (W1): the bias of column n grows by alpha_p cos(u_t, u_n), which is
    alpha_p for t itself and less for every other column (distinct unit vectors), so the smallest alpha_p with
    B[p, t] + alpha_p >= B[p, n] + alpha_p cos(u_t, u_n) + SELECTOR_MARGIN for all n puts t on top. Returns the
    share of rows whose fitted bias had t on top already."""
    num_cols, dims = w2_CR.shape[0], w2_CR.shape[1] - fitted_rank
    rows_S, best_S = most_counted_next(counts_PC, order_C)
    seen_C = torch.zeros(num_cols, dtype=torch.bool)
    seen_C[counts_PC.indices()[1]] = True
    generator = torch.Generator().manual_seed(SELECTOR_SEED)
    unit_CD = torch.randn(num_cols, dims, generator=generator, dtype=w2_CR.dtype)
    unit_CD = unit_CD / unit_CD.norm(dim=1, keepdim=True) * seen_C[:, None]
    w2_CR[:, fitted_rank:] = unit_CD
    already = 0
    for start in range(0, rows_S.numel(), ROWS_PER_CHUNK):
        rows, best = rows_S[start:start + ROWS_PER_CHUNK], best_S[start:start + ROWS_PER_CHUNK]
        bias_XC = w1_PR[rows, :fitted_rank] @ w2_CR[:, :fitted_rank].T
        already += int((bias_XC.argmax(dim=1) == best).sum())
        gap_XC = bias_XC - bias_XC.gather(1, best[:, None]) + SELECTOR_MARGIN
        need_XC = gap_XC / (1 - unit_CD[best] @ unit_CD.T).clamp(min=1e-6)
        need_XC.scatter_(1, best[:, None], 0.0)
        w1_PR[rows, fitted_rank:] = need_XC.max(dim=1).values.clamp(min=0)[:, None] * unit_CD[best]
    return already / max(rows_S.numel(), 1)


@torch.no_grad()
def init_markov_from_bigrams(drafter, samples: Iterable, tokenizer=None) -> None:
    """DSpark's `prepare_for_training`: with `markov_init=bigram`, W1/W2 from the bigram fit; else nothing."""
    config = drafter.config
    if config.markov_init == "random":
        return
    head = drafter.sequential
    if not isinstance(head, MarkovHead):
        raise ValueError(f"drafter.markov_init={config.markov_init!r} needs sequential_head=markov, "
                         f"got {config.sequential_head!r}")
    num_prev_rows, rank = head.prev_embed.weight.shape
    num_next = head.out.weight.shape[0]
    samples = list(samples)
    from_target = sum(getattr(sample, "target_next", None) is not None for sample in samples)
    counts_VV = draft_row_counts(drafter, bigram_counts(samples, config.target_vocab_size), num_prev_rows, num_next)
    if counts_VV.values().numel() == 0:
        raise ValueError("drafter.markov_init=bigram: the training split has no supervised token pairs")
    ratio_VV = bigram_log_ratio(counts_VV, config.markov_init_scale)
    # The SVD runs on the seen rows and columns only (a few thousand of V): the rest of W1/W2 is zero.
    rows_P, row_N = torch.unique(ratio_VV.indices()[0], return_inverse=True)
    cols_C, col_N = torch.unique(ratio_VV.indices()[1], return_inverse=True)
    compact_PC = torch.sparse_coo_tensor(torch.stack([row_N, col_N]), ratio_VV.values(),
                                         (rows_P.numel(), cols_C.numel()), check_invariants=False).coalesce()
    # A rank below the seen rows and columns cannot hold the table: the last rank // 4 dimensions then select
    # each row's most counted next token (complete_argmax); the SVD fits the rest.
    selector = rank // SELECTOR_SHARE if min(rows_P.numel(), cols_C.numel()) > rank else 0
    q = min(rank - selector, rows_P.numel(), cols_C.numel())
    with torch.random.fork_rng(devices=[]):  # svd_lowrank draws from the global RNG
        torch.manual_seed(SVD_SEED)
        u_PQ, s_Q, v_CQ = torch.svd_lowrank(compact_PC, q=q, niter=SVD_ITERATIONS)
    root_Q = s_Q.clamp(min=0).sqrt()
    w1_VR = torch.zeros(num_prev_rows, rank, dtype=torch.float64)
    w2_VR = torch.zeros(num_next, rank, dtype=torch.float64)
    w1_VR[rows_P, :q], w2_VR[cols_C, :q] = u_PQ * root_Q, v_CQ * root_Q
    fitted = 1.0
    if selector:
        order_C = drafter.target_vocab_index().cpu() if getattr(drafter, "reduced_vocab", False) else None
        fitted = complete_argmax(w1_VR, w2_VR, counts_VV, q, order_C)
    head.prev_embed.weight.copy_(w1_VR.to(head.prev_embed.weight))
    head.out.weight.copy_(w2_VR.to(head.out.weight))
    log.info("Markov head from bigrams: %d pairs, %d previous tokens, %.0f counted next tokens (the target's argmax "
             "in %d of %d samples, the data's next token in the rest), SVD rank %d + %d selector dimensions (the fit "
             "alone had the most counted token on top in %.1f%% of the rows), scale %g", counts_VV.values().numel(),
             rows_P.numel(), float(counts_VV.values().sum()), from_target, len(samples), q, selector, 100 * fitted,
             config.markov_init_scale)
