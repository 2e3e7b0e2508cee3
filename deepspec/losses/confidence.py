"""Confidence-head loss (paper eq. 7, 8, 11): soft acceptance labels and per-row BCE.

The confidence head predicts c_k = P(slot k is accepted | all earlier slots were accepted). Its soft
label is the per-step acceptance probability of speculative sampling, ``c*_k = 1 - 0.5 ||p_d - p_t||_1``
(Leviathan et al., 2023), detached so the confidence loss never moves the draft distribution.

Shape legend: N = rows (flattened draft positions).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def confidence_targets(tv_N: torch.Tensor) -> torch.Tensor:
    """Soft labels ``1 - 0.5 * tv`` in [0, 1] (fp32, detached)."""
    return (1.0 - 0.5 * tv_N.detach().float()).clamp(0.0, 1.0)


def confidence_bce(confidence_logits_N: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Per-row BCE-with-logits (numerically stable for large |logit|), fp32, no reduction."""
    if confidence_logits_N.shape != targets_N.shape:
        raise ValueError(
            f"confidence_logits_N {tuple(confidence_logits_N.shape)} and targets_N {tuple(targets_N.shape)} must match"
        )
    return F.binary_cross_entropy_with_logits(
        confidence_logits_N.float(), targets_N.detach().float(), reduction="none"
    )
