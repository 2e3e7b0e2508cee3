"""Calibration metrics for confidence scores: ECE, AUROC, Brier score and reliability bins.

Shape legend: N = number of samples (flattened; callers drop invalid positions first).

Labels may be hard ({0, 1}: "the prefix survived verification") or soft (in [0, 1]: the
analytic acceptance probability, e.g. the product of per-position ``1 - TV/2``). ECE, Brier and
reliability bins treat a soft label as its expected value. AUROC generalises to soft labels by
counting every sample as a positive with weight ``y`` and as a negative with weight ``1 - y``;
for hard labels this is exactly the Mann-Whitney rank statistic with ties averaged.

All functions accept NumPy arrays, torch tensors or sequences, compute in float64 and never
return NaN: bad input raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DEFAULT_NUM_BINS = 20


def as_float64_array(values: Any, name: str) -> np.ndarray:
    """Convert a tensor / array / sequence to a float64 NumPy array (no copy of torch graphs)."""
    if hasattr(values, "detach"):  # torch.Tensor without importing torch here
        values = values.detach().cpu().double().numpy()
    array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name}: contains NaN or infinite values")
    return array


def _check_pair(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    probs_N = as_float64_array(probs, "probs").reshape(-1)
    labels_N = as_float64_array(labels, "labels").reshape(-1)
    if probs_N.shape != labels_N.shape:
        raise ValueError(f"probs has {probs_N.size} values but labels has {labels_N.size}")
    if probs_N.size == 0:
        raise ValueError("probs: empty, need at least one sample")
    if probs_N.min() < 0.0 or probs_N.max() > 1.0:
        raise ValueError(f"probs: values must lie in [0, 1], got range [{probs_N.min()}, {probs_N.max()}]")
    if labels_N.min() < 0.0 or labels_N.max() > 1.0:
        raise ValueError(f"labels: values must lie in [0, 1], got range [{labels_N.min()}, {labels_N.max()}]")
    return probs_N, labels_N


def _bin_index(probs_N: np.ndarray, num_bins: int) -> np.ndarray:
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    # Equal-width bins [i/n, (i+1)/n); p = 1.0 goes into the last bin.
    return np.minimum((probs_N * num_bins).astype(np.int64), num_bins - 1)


def reliability_bins(probs: Any, labels: Any, num_bins: int = DEFAULT_NUM_BINS) -> dict[str, list]:
    """Equal-width reliability bins over [0, 1].

    Returns a JSON-ready dict: ``edges`` (num_bins + 1 values), and per bin ``mean_confidence``,
    ``accuracy`` (mean label) and ``counts``. Empty bins have count 0 and mean values ``None``.
    """
    probs_N, labels_N = _check_pair(probs, labels)
    bin_N = _bin_index(probs_N, num_bins)
    counts_b = np.bincount(bin_N, minlength=num_bins)
    conf_sum_b = np.bincount(bin_N, weights=probs_N, minlength=num_bins)
    label_sum_b = np.bincount(bin_N, weights=labels_N, minlength=num_bins)
    mean_conf, accuracy = [], []
    for count, conf_sum, label_sum in zip(counts_b, conf_sum_b, label_sum_b):
        mean_conf.append(float(conf_sum / count) if count else None)
        accuracy.append(float(label_sum / count) if count else None)
    return {
        "edges": np.linspace(0.0, 1.0, num_bins + 1).tolist(),
        "mean_confidence": mean_conf,
        "accuracy": accuracy,
        "counts": [int(c) for c in counts_b],
    }


def expected_calibration_error(probs: Any, labels: Any, num_bins: int = DEFAULT_NUM_BINS) -> float:
    """ECE with ``num_bins`` equal-width bins on [0, 1], each bin weighted by its sample count.

    ``ECE = sum_b (n_b / N) * |mean(probs in b) - mean(labels in b)|``; labels hard or soft.
    """
    probs_N, labels_N = _check_pair(probs, labels)
    bin_N = _bin_index(probs_N, num_bins)
    # sum_b |sum(p) - sum(y)| / N equals the count-weighted gap of the bin means.
    gap_sum_b = np.bincount(bin_N, weights=probs_N - labels_N, minlength=num_bins)
    return float(np.abs(gap_sum_b).sum() / probs_N.size)


def brier_score(probs: Any, labels: Any) -> float:
    """Mean squared difference between probabilities and (hard or soft) labels."""
    probs_N, labels_N = _check_pair(probs, labels)
    return float(np.mean((probs_N - labels_N) ** 2))


def auroc(scores: Any, labels: Any) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties count 1/2.

    Hard labels give the rank-based Mann-Whitney statistic (ties averaged). Soft labels in
    [0, 1] weight each sample as a positive by ``y`` and as a negative by ``1 - y``.
    Raises ``ValueError`` when the labels are degenerate (no positive or no negative mass),
    because AUROC is undefined there; callers that want to continue catch it (STS records
    ``None`` plus a note).
    """
    scores_N = as_float64_array(scores, "scores").reshape(-1)
    labels_N = as_float64_array(labels, "labels").reshape(-1)
    if scores_N.shape != labels_N.shape:
        raise ValueError(f"scores has {scores_N.size} values but labels has {labels_N.size}")
    if labels_N.size and (labels_N.min() < 0.0 or labels_N.max() > 1.0):
        raise ValueError("labels: values must lie in [0, 1]")
    positive_N, negative_N = labels_N, 1.0 - labels_N
    total_pos, total_neg = positive_N.sum(), negative_N.sum()
    if total_pos <= 0.0 or total_neg <= 0.0:
        kind = "all negative" if total_pos <= 0.0 else "all positive"
        raise ValueError(f"auroc: labels are {kind} ({labels_N.size} samples); AUROC is undefined")
    # Group equal scores; a positive beats all negatives in lower groups and half of its own group.
    unique_scores_G, group_N = np.unique(scores_N, return_inverse=True)
    num_groups = unique_scores_G.size
    pos_G = np.bincount(group_N, weights=positive_N, minlength=num_groups)
    neg_G = np.bincount(group_N, weights=negative_N, minlength=num_groups)
    neg_below_G = np.cumsum(neg_G) - neg_G
    wins = float(np.sum(pos_G * (neg_below_G + 0.5 * neg_G)))
    return wins / float(total_pos * total_neg)
