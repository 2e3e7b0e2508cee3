"""The options of the distribution terms (`deepspec.losses.distribution`): which terms, how they are chunked and
checkpointed, and the target side of a reduced draft vocabulary. Apart so that the input checks (`term_checks`)
and the terms both read them without importing each other."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

TERM_NAMES = ("ce", "tv", "soft_ce")
CHECKPOINT_MODES = ("auto", "always", "never")
# Bytes autograd keeps per logit without checkpointing (fp32 log p_d, p_d, p_d - p_t, ...) with CE + TV, rounded up
# so that the budget never undercounts (tests/losses/test_distribution.py checks it, with and without a bias).
SAVED_BYTES_PER_LOGIT = 16
DEFAULT_CHECKPOINT_BUDGET_MB = 1024.0


@dataclass(frozen=True)
class TermsOptions:
    """Which terms `distribution_terms` / `top_k_target_terms` compute and how: rows per chunk, activation
    checkpointing (`deepspec.losses.distribution`), the input checks (`term_checks`) and the fused Triton kernel
    (None: on CUDA when Triton imports). Training builds one from its loss config (`LossParams.terms_options`)."""

    need: Sequence[str] = TERM_NAMES
    chunk_rows: int = 512
    checkpoint: str = "always"
    checkpoint_budget_mb: float = DEFAULT_CHECKPOINT_BUDGET_MB
    check_values: bool = True
    use_triton: bool | None = None


@dataclass(frozen=True)
class ReducedVocab:
    """The target side of a reduced draft vocabulary: the target id of each draft id, and optionally the
    target's full log-normaliser per row (the exact target side, `deepspec.losses.distribution`).
    ``exact_target_argmax=False`` leaves the rows whose argmax may lie outside the draft vocabulary unresolved
    (-1), for steps that read no argmax."""

    target_vocab_index: torch.Tensor
    target_lse_N: torch.Tensor | None = None
    exact_target_argmax: bool = True


DEFAULT_TERMS_OPTIONS = TermsOptions()


