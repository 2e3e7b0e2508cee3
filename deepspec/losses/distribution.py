"""Per-row draft-vs-target distribution terms (CE, TV, soft CE), chunked over rows (paper §3.3).

For N flattened draft rows we need the draft distribution ``p_d = softmax(h_d W_d^T [+ bias])`` and
the frozen target distribution ``p_t = softmax(h_t W_t^T)`` (temperature 1) over the whole vocabulary.
Materialising ``[N, V]`` fp32 softmaxes (plus their autograd copies) dominates training memory
(N = 7 * 512 rows x V = 49k-150k), so ``distribution_terms`` processes ``chunk_rows`` rows at a time
under ``torch.utils.checkpoint`` (non-reentrant): autograd keeps only each chunk's inputs and
recomputes the chunk's ``[chunk_rows, V]`` logits/softmaxes in backward. Peak extra memory is
O(chunk_rows * V), not O(N * V). Logits are computed in the input dtype (bf16 on GPU, fp32
accumulation) and every softmax/log-softmax runs in fp32.

Checkpointing costs a second forward of every chunk in backward, a large share of a small drafter's step, so
``checkpoint="auto"`` (what training uses) checkpoints only when the activations autograd would keep,
``rows x V x SAVED_BYTES_PER_LOGIT``, exceed ``checkpoint_budget_mb``; ``"always"`` (this function's default) /
``"never"`` force it. Both give the same numbers: the recomputed forward is the same computation.

Reduced draft vocabulary (Eagle3 d2t/t2d): ``target_vocab_index`` (LongTensor [Vd]) selects, for each
draft-vocabulary id, its target-vocabulary column; the target logits are restricted to those columns
*before* the softmax, i.e. the target distribution is restricted to the draft vocabulary and
renormalised (as SGLang/SpecForge do). Labels then index the draft vocabulary (map them with t2d;
tokens outside it must be -100). TV/argmax under a reduced vocabulary are therefore measured on that
support (optimistic by the target mass outside it).

Exact target side under a reduced vocabulary (block drafters): with ``target_lse_N``, the target's
log-normaliser over its FULL vocabulary (stored per token in the cache), only the Vd kept rows of the
head are multiplied and ``p_t(v) = exp(h_t . w_v - lse)`` for v in the draft vocabulary: the target's
true probabilities, not renormalised. The mass the target puts outside the draft vocabulary,
``m_out = 1 - sum_v p_t(v)``, is where the drafter puts zero mass, so it enters the L1 distance as is:
``tv = sum_{v in Vd} |p_d(v) - p_t(v)| + m_out`` = the full-vocabulary TV of the zero-extended draft.
Implemented by appending one "outside" column to both logit rows (draft: -inf; target: log m_out, its
row holding log-probabilities), so the fused kernel and the reference run unchanged. CE of a label inside
the draft vocabulary is unchanged (the extra column carries no draft mass). Soft CE is infinite as soon
as ``m_out > 0`` (the drafter gives those tokens probability 0); do not ask for it. The target argmax is
exact too: a row whose outside mass exceeds every kept probability may have its argmax outside, and
only those rows are resolved with the full head (``target_argmax_N`` = -1 when it is outside). Training
steps, which read no argmax, skip that (``exact_target_argmax=False``: such rows get -1, "maybe outside").

On CUDA the per-chunk row terms come from the fused Triton kernel in ``tv_triton.py``
(``use_triton=None`` picks it automatically); elsewhere from ``row_terms_from_logits`` (the PyTorch
reference with the same signature).

Top-k targets (``top_k_target_terms``, a top-k log-prob cache, deepspec/cache/FORMAT.md): the target is known
on its K most likely tokens S (log-probabilities normalised over the whole vocabulary) plus the mass
``r_t = 1 - sum_S p_t`` of everything else. The terms are those of the *coarsened* distributions over
S + {rest}: ``TV = sum_S |p_d - p_t| + |r_d - r_t|`` and ``soft CE = -sum_S p_t log p_d - r_t log r_d``, with
``r_d`` the draft's mass outside S (a log-sum-exp over the complement, no cancellation). Coarsening never
increases TV or KL, so both are lower bounds of the full-vocabulary terms, exact when the target puts all
its mass on S; CE and the argmaxes are exact.

Shape legend: N = rows (flattened draft positions), C = rows in one chunk, H = hidden size,
V = vocabulary (draft vocabulary Vd when reduced), Vt = target vocabulary, R = bias rank, K = top-k entries.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from deepspec.losses.term_checks import IGNORE_INDEX, check_terms_inputs, check_top_k_inputs
from deepspec.losses.term_options import (  # TermsOptions and ReducedVocab are this module's API too
    CHECKPOINT_MODES,
    DEFAULT_CHECKPOINT_BUDGET_MB,
    DEFAULT_TERMS_OPTIONS,
    SAVED_BYTES_PER_LOGIT,
    TERM_NAMES,
    ReducedVocab,
    TermsOptions,
)
from deepspec.targets.features import head_logits
from deepspec.utils.phases import phase


@dataclass(frozen=True)
class CheckpointDecision:
    """Whether the chunked terms run under activation checkpointing, and why (for the run's log)."""

    checkpoint: bool
    mode: str
    saved_mb: float  # what autograd would keep without checkpointing
    budget_mb: float

    @property
    def note(self) -> str:
        why = {"always": "loss.checkpoint=always", "never": "loss.checkpoint=never"}.get(
            self.mode, f"{self.saved_mb:,.0f} MB of saved logits {'>' if self.checkpoint else '<='} "
                       f"loss.checkpoint_budget_mb={self.budget_mb:,.0f}")
        state = "checkpointed (recomputed in backward)" if self.checkpoint else "not checkpointed"
        return f"chunked loss {state}: {why}"


def checkpoint_decision(mode: str, num_rows: int, vocab: int, budget_mb: float = DEFAULT_CHECKPOINT_BUDGET_MB
                        ) -> CheckpointDecision:
    """The module docstring's rule: `auto` checkpoints when rows x vocab x SAVED_BYTES_PER_LOGIT > budget."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"loss.checkpoint={mode!r} must be one of {CHECKPOINT_MODES}")
    saved_mb = num_rows * vocab * SAVED_BYTES_PER_LOGIT / 2**20
    checkpoint = mode == "always" or (mode == "auto" and saved_mb > budget_mb)
    return CheckpointDecision(checkpoint, mode, saved_mb, float(budget_mb))


@dataclass
class DistributionTerms:
    """Per-row terms for N draft rows; a term not requested via ``need`` is None.

    ce_N: -log p_d(label), 0 where the label is ignored. tv_N: ||p_d - p_t||_1 in [0, 2].
    soft_ce_N: -sum_v p_t(v) log p_d(v). Argmaxes index the (draft) vocabulary (target_argmax_N = -1: the
    target's argmax lies outside the draft vocabulary, with ``target_lse_N``); valid_N: label != -100.
    """

    ce_N: torch.Tensor | None
    tv_N: torch.Tensor | None
    soft_ce_N: torch.Tensor | None
    draft_argmax_N: torch.Tensor
    target_argmax_N: torch.Tensor
    valid_N: torch.Tensor
    checkpoint: CheckpointDecision | None = None  # how the chunks ran (None: no gradient was needed)

    @property
    def num_rows(self) -> int:
        return int(self.valid_N.shape[0])

    def take(self, index_M: torch.Tensor) -> "DistributionTerms":
        """The rows `index_M` (in that order, repeats allowed): e.g. one row seen at several draft positions."""
        def pick(value_N):
            return None if value_N is None else value_N[index_M]

        return DistributionTerms(pick(self.ce_N), pick(self.tv_N), pick(self.soft_ce_N), pick(self.draft_argmax_N),
                                 pick(self.target_argmax_N), pick(self.valid_N), self.checkpoint)

    def term(self, name: str) -> torch.Tensor:
        """Return the term ``name`` ("ce", "tv", "soft_ce"); ValueError if it was not computed."""
        if name not in TERM_NAMES:
            raise ValueError(f"unknown term {name!r}; expected one of {TERM_NAMES}")
        value = getattr(self, f"{name}_N")
        if value is None:
            raise ValueError(f"term {name!r} was not computed; pass need=(..., {name!r}) to distribution_terms")
        return value


def row_terms_from_logits(
    draft_logits_NV: torch.Tensor,
    target_logits_NV: torch.Tensor,
    labels_N: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    with_soft_ce: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """PyTorch reference: fp32 (ce_N, tv_N, soft_ce_N) from one draft and one target logit row each
    (soft_ce_N None when `with_soft_ce` is False).

    The target logits are treated as constants (no gradient flows into them).
    """
    logp_d_NV = torch.log_softmax(draft_logits_NV.float(), dim=-1)
    logp_t_NV = torch.log_softmax(target_logits_NV.detach().float(), dim=-1)
    p_t_NV = logp_t_NV.exp()
    valid_N = labels_N != ignore_index
    safe_labels_N = torch.where(valid_N, labels_N, torch.zeros_like(labels_N))
    ce_N = -logp_d_NV.gather(1, safe_labels_N[:, None]).squeeze(1)
    ce_N = torch.where(valid_N, ce_N, torch.zeros_like(ce_N))
    tv_N = (logp_d_NV.exp() - p_t_NV).abs().sum(dim=-1)
    if not with_soft_ce:  # three more [N, V] passes (and their saved activations) for a term nobody reads
        return ce_N, tv_N, None
    # p_t * log p_d with p_t == 0 must contribute 0 even where log p_d == -inf.
    soft_ce_N = -torch.where(p_t_NV > 0, p_t_NV * logp_d_NV, torch.zeros_like(p_t_NV)).sum(dim=-1)
    return ce_N, tv_N, soft_ce_N


def _draft_logits(
    draft_hidden_CH: torch.Tensor,
    draft_head_VH: torch.Tensor,
    bias_in_CR: torch.Tensor | None,
    bias_out_RV: torch.Tensor | None,
) -> torch.Tensor:
    logits_CV = head_logits(draft_hidden_CH, draft_head_VH)
    if bias_in_CR is not None:
        logits_CV = logits_CV + head_logits(bias_in_CR, bias_out_RV.T)
    return logits_CV


def _target_rows(target_head_VtH: torch.Tensor, target_vocab_index_V: torch.Tensor | None) -> torch.Tensor:
    """The frozen target head's rows of the draft vocabulary (all of it without an index), gathered once per call."""
    with torch.no_grad():
        head_VtH = target_head_VtH.detach()
        return head_VtH if target_vocab_index_V is None else head_VtH.index_select(0, target_vocab_index_V)


def outside_mass(target_logits_CV: torch.Tensor, target_lse_C: torch.Tensor) -> torch.Tensor:
    """``1 - sum_v exp(z_v - lse)`` per row, clamped at 0 (rounding can push the kept mass a hair above 1)."""
    with torch.no_grad():
        kept_C = torch.exp(target_logits_CV.float() - target_lse_C.float()[:, None]).sum(dim=-1)
        return (1.0 - kept_C).clamp_min(0.0)


def with_outside_column(
    draft_logits_CV: torch.Tensor, target_logits_CV: torch.Tensor, target_lse_C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both rows extended by one column for everything outside the draft vocabulary (module docstring):
    draft logit -inf (no mass), target log-probability ``log m_out``; the target row becomes log p_t."""
    mass_C = outside_mass(target_logits_CV, target_lse_C)
    target_CV1 = torch.cat([target_logits_CV.float() - target_lse_C.float()[:, None], mass_C.log()[:, None]], dim=1)
    no_mass_C1 = torch.full_like(draft_logits_CV[:, :1], float("-inf"))
    return torch.cat([draft_logits_CV, no_mass_C1], dim=1), target_CV1


@torch.no_grad()
def _exact_target_argmax(
    target_argmax_C: torch.Tensor,
    target_hidden_CH: torch.Tensor,
    target_head_VtH: torch.Tensor,
    target_vocab_index_V: torch.Tensor,
) -> torch.Tensor:
    """Rows whose argmax landed on the outside column get their full-vocabulary argmax, mapped to the draft
    vocabulary (-1 when it lies outside it); the other rows keep theirs (a kept token beat the whole outside mass)."""
    num_kept = target_vocab_index_V.shape[0]
    # The one host sync (a variable-size result): only these rows pay for the full head. Runs when argmaxes are read
    # (validation), never in a training step (`exact_target_argmax=False`).
    rows_U = torch.nonzero(target_argmax_C == num_kept).squeeze(1)
    full_UV = head_logits(target_hidden_CH.index_select(0, rows_U).detach(), target_head_VtH)
    argmax_U = full_UV.argmax(dim=-1)
    position_U = torch.searchsorted(target_vocab_index_V, argmax_U).clamp(max=num_kept - 1)
    kept_U = target_vocab_index_V[position_U] == argmax_U
    return target_argmax_C.index_copy(0, rows_U, torch.where(kept_U, position_U, torch.full_like(position_U, -1)))


def _chunk_terms(
    draft_hidden_CH: torch.Tensor,
    draft_head_VH: torch.Tensor,
    target_hidden_CH: torch.Tensor,
    target_rows_VH: torch.Tensor,
    target_head_VtH: torch.Tensor,
    labels_C: torch.Tensor,
    bias_in_CR: torch.Tensor | None,
    bias_out_RV: torch.Tensor | None,
    target_vocab_index_V: torch.Tensor | None,
    target_lse_C: torch.Tensor | None,
    need: frozenset[str],
    use_triton: bool,
    exact_target_argmax: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    draft_logits_CV = _draft_logits(draft_hidden_CH, draft_head_VH, bias_in_CR, bias_out_RV)
    with torch.no_grad(), phase("target"):
        target_logits_CV = head_logits(target_hidden_CH.detach(), target_rows_VH)
    if target_lse_C is not None:
        draft_logits_CV, target_logits_CV = with_outside_column(draft_logits_CV, target_logits_CV, target_lse_C)
    if use_triton:
        from deepspec.losses.tv_triton import fused_row_terms

        ce_C, tv_C, soft_ce_C = fused_row_terms(draft_logits_CV, target_logits_CV, labels_C)
    else:
        ce_C, tv_C, soft_ce_C = row_terms_from_logits(draft_logits_CV, target_logits_CV, labels_C,
                                                      with_soft_ce="soft_ce" in need)
    draft_argmax_C = draft_logits_CV.detach().argmax(dim=-1)  # never the -inf outside column
    target_argmax_C = target_logits_CV.argmax(dim=-1)
    if target_lse_C is not None and exact_target_argmax:
        target_argmax_C = _exact_target_argmax(target_argmax_C, target_hidden_CH, target_head_VtH, target_vocab_index_V)
    elif target_lse_C is not None:
        target_argmax_C = torch.where(target_argmax_C == target_vocab_index_V.shape[0], -1, target_argmax_C)
    return (
        ce_C if "ce" in need else None,
        tv_C if "tv" in need else None,
        soft_ce_C if "soft_ce" in need else None,
        draft_argmax_C,
        target_argmax_C,
    )


def _assert_same_rows(*rows_N: torch.Tensor | None) -> None:
    # Rows are sliced per chunk: a shorter tensor would misalign them (labels gather fewer CE rows) and a one-row
    # tensor would broadcast, both without an error.
    num_rows = rows_N[0].shape[0]
    assert all(t is None or t.shape[0] == num_rows for t in rows_N), [None if t is None else t.shape for t in rows_N]


def _resolve_use_triton(use_triton: bool | None, device: torch.device) -> bool:
    if use_triton is None:
        if device.type != "cuda":
            return False
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    if use_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("use_triton=True needs a CUDA device (or TRITON_INTERPRET=1 set before importing triton)")
    return bool(use_triton)


def distribution_terms(
    draft_hidden_NH: torch.Tensor,
    draft_head_VH: torch.Tensor,
    target_hidden_NH: torch.Tensor,
    target_head_VH: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    draft_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    reduced: ReducedVocab | None = None,
    options: TermsOptions = DEFAULT_TERMS_OPTIONS,
) -> DistributionTerms:
    """Chunked CE / TV / soft-CE of draft rows against the frozen target (see module docstring).

    ``draft_bias = (bias_in_NR, bias_out_RV)`` adds ``bias_in @ bias_out`` to the draft logits (DSpark's
    low-rank Markov/RNN transition bias). Gradients reach draft_hidden, draft_head (if it requires
    grad) and the bias factors; never the target tensors. ``reduced``: the target side of a reduced draft
    vocabulary (`ReducedVocab`). ``options``: the terms computed and how (`TermsOptions`); with
    ``options.check_values`` every input is checked first, a ValueError naming the argument
    (`term_checks.check_terms_inputs`: shapes, dtypes and options, and the ids' values, which read the device).
    Training passes `loss.check_values`, off by default: the objectives build these tensors and the ids were
    checked once where they were read.
    """
    if options.check_values:
        check_terms_inputs(draft_hidden_NH, draft_head_VH, target_hidden_NH, target_head_VH, labels_N,
                           draft_bias=draft_bias, reduced=reduced, options=options)
    need_set = frozenset(options.need)
    target_vocab_index = None if reduced is None else reduced.target_vocab_index
    target_lse_N = None if reduced is None else reduced.target_lse_N
    exact_target_argmax = reduced is None or reduced.exact_target_argmax
    bias_in_NR, bias_out_RV = draft_bias if draft_bias is not None else (None, None)
    _assert_same_rows(draft_hidden_NH, target_hidden_NH, labels_N, bias_in_NR, target_lse_N)
    assert target_lse_N is None or "soft_ce" not in need_set, "soft CE is infinite against the outside mass"
    triton_path = _resolve_use_triton(options.use_triton, draft_hidden_NH.device)
    labels_N = labels_N.long()
    target_rows_VH = _target_rows(target_head_VH, target_vocab_index)
    return _chunked_terms(_chunk_terms, options, (draft_hidden_NH, bias_in_NR, bias_out_RV, draft_head_VH),
                          row_args=(draft_hidden_NH, target_hidden_NH, labels_N, bias_in_NR, target_lse_N),
                          arrange=lambda hidden, target, labels, bias_in, lse: (
                              hidden, draft_head_VH, target, target_rows_VH, target_head_VH, labels, bias_in,
                              bias_out_RV, target_vocab_index, lse, need_set, triton_path, exact_target_argmax),
                          labels_N=labels_N, vocab=draft_head_VH.shape[0] + (target_lse_N is not None))


def _chunked_terms(chunk_fn, options: TermsOptions, grad_sources: Sequence[torch.Tensor | None],
                   row_args: Sequence, arrange, labels_N: torch.Tensor, vocab: int) -> DistributionTerms:
    """Run `chunk_fn(*arrange(*row_args[rows]))` over chunks of `options.chunk_rows` rows and concatenate its
    (ce, tv, soft_ce, draft_argmax, target_argmax) columns; under checkpoint when a gradient is needed and
    `checkpoint_decision` says so."""
    num_rows, chunk_rows = labels_N.shape[0], options.chunk_rows
    decision = checkpoint_decision(options.checkpoint, num_rows, vocab, options.checkpoint_budget_mb)
    # Checkpointing only pays when something needs a gradient; under no_grad it is plain chunking.
    grad_needed = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grad_sources)
    use_checkpoint = grad_needed and decision.checkpoint
    outputs: list[tuple[torch.Tensor | None, ...]] = []
    # N == 0 still runs one empty chunk so the result keeps real dtypes and devices.
    for start in list(range(0, num_rows, int(chunk_rows))) or [0]:
        rows = slice(start, min(start + int(chunk_rows), num_rows))
        args = arrange(*(None if a is None else a[rows] for a in row_args))
        if use_checkpoint:
            outputs.append(activation_checkpoint(chunk_fn, *args, use_reentrant=False))
        else:
            outputs.append(chunk_fn(*args))
    columns = list(zip(*outputs))
    ce_N, tv_N, soft_ce_N, draft_argmax_N, target_argmax_N = (
        None if column[0] is None else torch.cat(column) for column in columns
    )
    return DistributionTerms(
        ce_N=ce_N,
        tv_N=tv_N,
        soft_ce_N=soft_ce_N,
        draft_argmax_N=draft_argmax_N,
        target_argmax_N=target_argmax_N,
        valid_N=labels_N != IGNORE_INDEX,
        checkpoint=decision if grad_needed else None,
    )


def _chunk_top_k_terms(draft_hidden_CH: torch.Tensor, draft_head_VH: torch.Tensor, top_k_ids_CK: torch.Tensor,
                       top_k_logprobs_CK: torch.Tensor, labels_C: torch.Tensor, need: frozenset[str]):
    logits_CV = head_logits(draft_hidden_CH, draft_head_VH)
    logp_d_CV = torch.log_softmax(logits_CV, dim=-1)
    valid_C = labels_C != IGNORE_INDEX
    ce_C = -logp_d_CV.gather(1, torch.where(valid_C, labels_C, torch.zeros_like(labels_C))[:, None]).squeeze(1)
    ce_C = torch.where(valid_C, ce_C, torch.zeros_like(ce_C))
    logp_d_CK = logp_d_CV.gather(1, top_k_ids_CK)
    p_t_CK = top_k_logprobs_CK.detach().float().exp()
    rest_t_C = (1.0 - p_t_CK.sum(dim=-1)).clamp(min=0.0)
    # The draft's mass outside S, in log space: log-sum-exp over the complement (never 1 - sum, which cancels).
    log_rest_d_C = torch.logsumexp(logp_d_CV.scatter(1, top_k_ids_CK, float("-inf")), dim=-1).clamp(min=-80.0)
    tv_C = (logp_d_CK.exp() - p_t_CK).abs().sum(dim=-1) + (log_rest_d_C.exp() - rest_t_C).abs()
    soft_ce_C = -(p_t_CK * logp_d_CK).sum(dim=-1) - rest_t_C * log_rest_d_C
    target_argmax_C = top_k_ids_CK.gather(1, top_k_logprobs_CK.argmax(dim=-1, keepdim=True)).squeeze(1)
    return (ce_C if "ce" in need else None, tv_C if "tv" in need else None, soft_ce_C if "soft_ce" in need else None,
            logits_CV.detach().argmax(dim=-1), target_argmax_C)


def top_k_target_terms(
    draft_hidden_NH: torch.Tensor,
    draft_head_VH: torch.Tensor,
    top_k_ids_NK: torch.Tensor,
    top_k_logprobs_NK: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    options: TermsOptions = DEFAULT_TERMS_OPTIONS,
) -> DistributionTerms:
    """CE / TV / soft-CE of draft rows against a target known on its top-k tokens (see module docstring).

    ``top_k_ids_NK`` index the draft's vocabulary (the full target vocabulary: no reduced draft vocabulary
    here); ``top_k_logprobs_NK`` are the target's log-probabilities of those tokens over its whole vocabulary.
    ``options.check_values``: first check every input (`term_checks.check_top_k_inputs`), as in
    ``distribution_terms`` (``options.use_triton`` is not read: no fused kernel here).
    """
    if options.check_values:
        check_top_k_inputs(draft_hidden_NH, draft_head_VH, top_k_ids_NK, top_k_logprobs_NK, labels_N,
                           need=options.need, chunk_rows=options.chunk_rows)
    _assert_same_rows(draft_hidden_NH, top_k_ids_NK, top_k_logprobs_NK, labels_N)
    need_set = frozenset(options.need)
    vocab = draft_head_VH.shape[0]
    labels_N = labels_N.long()
    return _chunked_terms(_chunk_top_k_terms, options, (draft_hidden_NH, draft_head_VH),
                          row_args=(draft_hidden_NH, top_k_ids_NK.long(), top_k_logprobs_NK, labels_N),
                          arrange=lambda hidden, ids, logprobs, labels: (
                              hidden, draft_head_VH, ids, logprobs, labels, need_set),
                          labels_N=labels_N, vocab=vocab)


def distribution_terms_naive(
    draft_hidden_NH: torch.Tensor,
    draft_head_VH: torch.Tensor,
    target_hidden_NH: torch.Tensor,
    target_head_VH: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    draft_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    reduced: ReducedVocab | None = None,
    need: Sequence[str] = TERM_NAMES,
) -> DistributionTerms:
    """One-shot reference of ``distribution_terms``: materialises ``[N, V]`` fp32 (tests, memory bench).

    With ``reduced.target_lse_N`` it computes the target side directly, without the outside column: ``p_t`` =
    exp(logits - lse) on the kept ids, TV plus the explicit outside mass, argmax over the full head."""

    check_terms_inputs(draft_hidden_NH, draft_head_VH, target_hidden_NH, target_head_VH, labels_N,
                       draft_bias=draft_bias, reduced=reduced, options=TermsOptions(need=need))
    target_vocab_index = None if reduced is None else reduced.target_vocab_index
    target_lse_N = None if reduced is None else reduced.target_lse_N
    need_set = frozenset(need)
    labels_N = labels_N.long()
    draft_logits_NV = _draft_logits(draft_hidden_NH, draft_head_VH, *(draft_bias or (None, None)))
    full_head_VtH = target_head_VH.detach()
    target_head_VH = full_head_VtH if target_vocab_index is None else full_head_VtH[target_vocab_index]
    target_logits_NV = head_logits(target_hidden_NH.detach(), target_head_VH)
    p_d_NV = F.softmax(draft_logits_NV, dim=-1)
    ce_N = F.cross_entropy(draft_logits_NV, labels_N, ignore_index=IGNORE_INDEX, reduction="none")
    if target_lse_N is None:
        p_t_NV = F.softmax(target_logits_NV, dim=-1)
        tv_N = (p_d_NV - p_t_NV).abs().sum(dim=-1)
        target_argmax_N = target_logits_NV.argmax(dim=-1)
    else:
        p_t_NV = torch.exp(target_logits_NV - target_lse_N.float()[:, None])
        tv_N = (p_d_NV - p_t_NV).abs().sum(dim=-1) + (1.0 - p_t_NV.sum(dim=-1)).clamp_min(0.0)
        full_argmax_N = head_logits(target_hidden_NH.detach(), full_head_VtH).argmax(dim=-1)
        draft_id_of_Vt = torch.full((full_head_VtH.shape[0],), -1, dtype=torch.long, device=full_argmax_N.device)
        draft_id_of_Vt[target_vocab_index] = torch.arange(target_vocab_index.shape[0], device=full_argmax_N.device)
        target_argmax_N = draft_id_of_Vt[full_argmax_N]
    soft_ce_N = -(p_t_NV * F.log_softmax(draft_logits_NV, dim=-1)).sum(dim=-1)
    return DistributionTerms(
        ce_N=ce_N if "ce" in need_set else None,
        tv_N=tv_N if "tv" in need_set else None,
        soft_ce_N=soft_ce_N if "soft_ce" in need_set else None,
        draft_argmax_N=draft_logits_NV.detach().argmax(dim=-1),
        target_argmax_N=target_argmax_N,
        valid_N=labels_N != IGNORE_INDEX,
    )
