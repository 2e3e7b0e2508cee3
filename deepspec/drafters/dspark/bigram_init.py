"""Data-dependent start for DSpark's Markov head (`drafter.markov_init=bigram`): the sequential bias begins as a
rank-r fit of the training split's bigram statistics, so slot 0 (whose previous token is the anchor) starts near
the bigram-table floor and the backbone learns the residual.

Counts c[p, n] over every supervised next token n (loss_mask[t + 1]) and its previous token p = x[t] (the
pairs the block batcher trains the head on: slot 0's previous token is the anchor, later slots' the ground-truth
token before them). The fitted matrix is sparse and nonnegative:

    M[p, n] = markov_init_scale * max(log(c[p, n] / n_p * V), 0)        (n_p = sum_n c[p, n], V = vocabulary)

i.e. the log ratio of the bigram probability to a uniform 1/V (with a reduced draft vocabulary, the head's
rows: previous tokens through `draft_rows`, next tokens outside the draft vocabulary dropped, V = its size): within a row, differences of M are the bigram's
log-probability differences, and unseen pairs add nothing. W1 = U sqrt(S), W2 = V sqrt(S) from a truncated
SVD of M (`torch.svd_lowrank`, seeded so the drafter's RNG stream is untouched), with the head's rank r.
Tokens never seen as a previous token get a zero W1 row (no bias). Measured on the embedded target in
docs/results.md.

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


def bigram_counts(samples: Iterable, vocab_size: int) -> torch.Tensor:
    """Coalesced sparse [V, V] float64 counts c[prev, next] over supervised next tokens (module docstring)."""
    keys = []
    for sample in samples:
        ids_T, mask_T = sample.input_ids.long(), sample.loss_mask.bool()
        if ids_T.numel() < 2:
            continue
        next_is_supervised_T = mask_T[1:]
        keys.append(ids_T[:-1][next_is_supervised_T] * vocab_size + ids_T[1:][next_is_supervised_T])
    pairs_N, counts_N = (torch.unique(torch.cat(keys), return_counts=True) if keys
                         else (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))
    indices = torch.stack([pairs_N // vocab_size, pairs_N % vocab_size])
    return torch.sparse_coo_tensor(indices, counts_N.double(), (vocab_size, vocab_size), check_invariants=True).coalesce()


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
    counts_VV = draft_row_counts(drafter, bigram_counts(samples, config.target_vocab_size), num_prev_rows, num_next)
    if counts_VV.values().numel() == 0:
        raise ValueError("drafter.markov_init=bigram: the training split has no supervised token pairs")
    ratio_VV = bigram_log_ratio(counts_VV, config.markov_init_scale)
    # The SVD runs on the seen rows and columns only (a few thousand of V): the rest of W1/W2 is zero.
    rows_P, row_N = torch.unique(ratio_VV.indices()[0], return_inverse=True)
    cols_C, col_N = torch.unique(ratio_VV.indices()[1], return_inverse=True)
    compact_PC = torch.sparse_coo_tensor(torch.stack([row_N, col_N]), ratio_VV.values(),
                                         (rows_P.numel(), cols_C.numel()), check_invariants=False).coalesce()
    q = min(rank, rows_P.numel(), cols_C.numel())
    with torch.random.fork_rng(devices=[]):  # svd_lowrank draws from the global RNG
        torch.manual_seed(SVD_SEED)
        u_PQ, s_Q, v_CQ = torch.svd_lowrank(compact_PC, q=q, niter=SVD_ITERATIONS)
    root_Q = s_Q.clamp(min=0).sqrt()
    w1_VR = torch.zeros(num_prev_rows, rank, dtype=torch.float64)
    w2_VR = torch.zeros(num_next, rank, dtype=torch.float64)
    w1_VR[rows_P, :q], w2_VR[cols_C, :q] = u_PQ * root_Q, v_CQ * root_Q
    head.prev_embed.weight.copy_(w1_VR.to(head.prev_embed.weight))
    head.out.weight.copy_(w2_VR.to(head.out.weight))
    log.info("Markov head from bigrams: %d pairs, %d previous tokens, %.0f counted next tokens, rank %d, scale %g",
             counts_VV.values().numel(), rows_P.numel(), float(counts_VV.values().sum()), q, config.markov_init_scale)
