"""What a direct caller of the distribution terms can get wrong, refused with a ValueError naming the argument.

`distribution_terms` and `top_k_target_terms` run these checks with ``check_values=True``: their default for a
direct caller, and in training the debugging switch `loss.check_values`. A training step runs without them: the
objectives build every tensor from the batch and the drafter, the loss config (`LossParams`) validates its options
once, the cache reader checks every token id where it reads it and `set_draft_vocab` the draft vocabulary. The hot
path keeps asserts only where a wrong row count would compute garbage without an error.

Shapes, dtypes and options are metadata; the values of the ids (labels, vocabulary index, top-k ids) are read from
the device (host syncs).

Shape legend: N = rows, H = hidden size, V = vocabulary (draft vocabulary Vd when reduced), Vt = target vocabulary,
R = bias rank, K = top-k entries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepspec.losses.term_options import TERM_NAMES, ReducedVocab, TermsOptions

IGNORE_INDEX = -100  # a label that is not scored (torch's cross-entropy convention)


def check_chunk_rows(chunk_rows: int) -> None:
    if int(chunk_rows) != chunk_rows or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")


def check_need(need: Sequence[str]) -> frozenset[str]:
    need_set = frozenset(need)
    if not need_set or need_set - set(TERM_NAMES):
        raise ValueError(f"need must be a non-empty subset of {TERM_NAMES}; got {tuple(need)}")
    return need_set


def check_terms_inputs(
    draft_hidden_NH: torch.Tensor,
    draft_head_VH: torch.Tensor,
    target_hidden_NH: torch.Tensor,
    target_head_VtH: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    draft_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    reduced: ReducedVocab | None = None,
    options: TermsOptions | None = None,
) -> None:
    """Every input of `distribution_terms` (its docstring says what each one is)."""
    need, chunk_rows = (TERM_NAMES, 512) if options is None else (options.need, options.chunk_rows)
    target_vocab_index = None if reduced is None else reduced.target_vocab_index
    target_lse_N = None if reduced is None else reduced.target_lse_N
    check_chunk_rows(chunk_rows)
    num_rows, vocab = _check_draft_side(draft_hidden_NH, draft_head_VH, labels_N, draft_bias)
    _check_target_side(target_hidden_NH, target_head_VtH, target_vocab_index, num_rows, vocab)
    _check_log_normalizer(target_lse_N, check_need(need), num_rows)
    _check_id_values(labels_N, vocab, target_vocab_index, target_head_VtH.shape[0],
                     ascending=target_lse_N is not None)


def _check_draft_side(draft_hidden_NH: torch.Tensor, draft_head_VH: torch.Tensor, labels_N: torch.Tensor,
                      draft_bias: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[int, int]:
    """(N, V) of the draft rows, their head, labels and low-rank bias."""
    if draft_hidden_NH.dim() != 2 or draft_head_VH.dim() != 2:
        raise ValueError(f"draft_hidden_NH must be [N, H] and draft_head_VH [V, H]; got {tuple(draft_hidden_NH.shape)} "
                         f"and {tuple(draft_head_VH.shape)}")
    num_rows, hidden = draft_hidden_NH.shape
    vocab = draft_head_VH.shape[0]
    if draft_head_VH.shape[1] != hidden:
        raise ValueError(f"draft_head_VH hidden size {draft_head_VH.shape[1]} != draft_hidden_NH hidden size {hidden}")
    if labels_N.dim() != 1 or labels_N.shape[0] != num_rows:
        raise ValueError(f"labels_N must be [{num_rows}]; got {tuple(labels_N.shape)}")
    if labels_N.dtype not in (torch.long, torch.int32):
        raise ValueError(f"labels_N must be an integer tensor, got {labels_N.dtype}")
    if draft_bias is not None:
        if len(draft_bias) != 2:
            raise ValueError("draft_bias must be a pair (bias_in_NR, bias_out_RV)")
        bias_in_NR, bias_out_RV = draft_bias
        if bias_in_NR.dim() != 2 or bias_in_NR.shape[0] != num_rows:
            raise ValueError(f"draft_bias[0] (bias_in_NR) must be [{num_rows}, R]; got {tuple(bias_in_NR.shape)}")
        if bias_out_RV.dim() != 2 or bias_out_RV.shape != (bias_in_NR.shape[1], vocab):
            raise ValueError(f"draft_bias[1] (bias_out_RV) must be [{bias_in_NR.shape[1]}, {vocab}]; "
                             f"got {tuple(bias_out_RV.shape)}")
    return num_rows, vocab


def _check_target_side(target_hidden_NH: torch.Tensor, target_head_VtH: torch.Tensor,
                       target_vocab_index: torch.Tensor | None, num_rows: int, vocab: int) -> None:
    if target_hidden_NH.dim() != 2 or target_hidden_NH.shape[0] != num_rows:
        raise ValueError(f"target_hidden_NH must be [{num_rows}, Ht]; got {tuple(target_hidden_NH.shape)}")
    if target_head_VtH.dim() != 2 or target_head_VtH.shape[1] != target_hidden_NH.shape[1]:
        raise ValueError(f"target_head_VH must be [Vt, {target_hidden_NH.shape[1]}]; "
                         f"got {tuple(target_head_VtH.shape)}")
    if target_vocab_index is None:
        if target_head_VtH.shape[0] != vocab:
            raise ValueError(f"target vocabulary {target_head_VtH.shape[0]} != draft vocabulary {vocab}; "
                             "pass reduced=ReducedVocab(target_vocab_index) for a reduced draft vocabulary")
        return
    if target_vocab_index.dim() != 1 or target_vocab_index.shape[0] != vocab:
        raise ValueError(f"target_vocab_index must be [{vocab}] (one target id per draft id); "
                         f"got {tuple(target_vocab_index.shape)}")
    if target_vocab_index.dtype != torch.long:
        raise ValueError(f"target_vocab_index must be a LongTensor, got {target_vocab_index.dtype}")


def _check_log_normalizer(target_lse_N: torch.Tensor | None, need_set: frozenset[str], num_rows: int) -> None:
    if target_lse_N is None:
        return
    if target_lse_N.shape != (num_rows,):
        raise ValueError(f"target_lse_N must be [{num_rows}]; got {tuple(target_lse_N.shape)}")
    if "soft_ce" in need_set:
        raise ValueError("soft_ce is infinite when the target has mass outside the draft vocabulary; "
                         "with target_lse_N ask for ce/tv only")


def _check_id_values(labels_N: torch.Tensor, vocab: int, target_vocab_index: torch.Tensor | None,
                     target_vocab: int, ascending: bool) -> None:
    """The ids' values (reads the device). `ascending`: the exact target argmax searches the index."""
    if target_vocab_index is not None and vocab:
        if int(target_vocab_index.min()) < 0 or int(target_vocab_index.max()) >= target_vocab:
            raise ValueError(f"target_vocab_index values must lie in [0, {target_vocab})")
        if ascending and vocab > 1 and not bool((target_vocab_index[1:] > target_vocab_index[:-1]).all()):
            raise ValueError("target_vocab_index must be strictly ascending (kept target ids, as d2t describes them)")
    valid_labels = labels_N[labels_N != IGNORE_INDEX]
    if valid_labels.numel() and (int(valid_labels.min()) < 0 or int(valid_labels.max()) >= vocab):
        raise ValueError(f"labels_N must be -100 (ignored) or draft-vocabulary ids in [0, {vocab})")


def check_top_k_inputs(draft_hidden_NH: torch.Tensor, draft_head_VH: torch.Tensor, top_k_ids_NK: torch.Tensor,
                       top_k_logprobs_NK: torch.Tensor, labels_N: torch.Tensor, *, need: Sequence[str] = TERM_NAMES,
                       chunk_rows: int = 512) -> None:
    """Every input of `top_k_target_terms`; the top-k ids' values too (reads the device)."""
    check_chunk_rows(chunk_rows)
    if draft_hidden_NH.dim() != 2 or draft_head_VH.dim() != 2 or draft_head_VH.shape[1] != draft_hidden_NH.shape[1]:
        raise ValueError(f"draft_hidden_NH must be [N, H] and draft_head_VH [V, H]; got {tuple(draft_hidden_NH.shape)} "
                         f"and {tuple(draft_head_VH.shape)}")
    num_rows, vocab = draft_hidden_NH.shape[0], draft_head_VH.shape[0]
    if top_k_ids_NK.dim() != 2 or top_k_ids_NK.shape[0] != num_rows or top_k_logprobs_NK.shape != top_k_ids_NK.shape:
        raise ValueError(f"top_k_ids_NK and top_k_logprobs_NK must both be [{num_rows}, K]; got "
                         f"{tuple(top_k_ids_NK.shape)} and {tuple(top_k_logprobs_NK.shape)}")
    if top_k_ids_NK.numel() and (int(top_k_ids_NK.min()) < 0 or int(top_k_ids_NK.max()) >= vocab):
        raise ValueError(f"top_k_ids_NK must be vocabulary ids in [0, {vocab})")
    if labels_N.dim() != 1 or labels_N.shape[0] != num_rows:
        raise ValueError(f"labels_N must be [{num_rows}]; got {tuple(labels_N.shape)}")
    check_need(need)
