"""Sequential Temperature Scaling (STS, paper §3.2.1) for the per-position confidence head.

Shape legend: N = validation blocks, K = draft positions per block (gamma), G = grid points.

The confidence head predicts conditional acceptance ``c_k = sigmoid(z_k)`` ("x_k survives given
x_1..x_{k-1} survived"); the scheduler needs the *joint* prefix survival ``prod_{i<=k} c_i`` in
absolute terms. STS fits one temperature per position, left to right: T_k minimises the ECE of
``prod_{i<=k} sigmoid(z_i / T_i)`` against the observed prefix survival at k, with T_1..T_{k-1}
already fixed. Temperature scaling is monotone in z_k, so the ranking of c_k across samples at
each position is unchanged (the ranking of the *cumulative products* across samples is not
guaranteed to be, since different positions get different temperatures).

Search: a log-spaced grid (default 0.05..20) followed by a golden-section refinement in log T
between the best grid point's neighbours; the refined value is kept only if it lowers the ECE.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from deepspec.calibration.metrics import (
    DEFAULT_NUM_BINS,
    as_float64_array,
    auroc,
    brier_score,
    expected_calibration_error,
    reliability_bins,
)
from deepspec.utils.io import atomic_write_json, read_json

LABEL_KINDS = ("analytic", "hard")
DEFAULT_GRID = tuple(np.geomspace(0.05, 20.0, 121).tolist())
GOLDEN_ITERATIONS = 40


@dataclass
class CalibrationResult:
    """Fitted STS temperatures plus per-position diagnostics (lists are indexed by position k-1)."""

    temperatures: list[float]
    ece_before: list[float]
    ece_after: list[float]
    auroc: list[float | None]  # of the calibrated cumulative product; None where labels degenerate
    brier_before: list[float]
    brier_after: list[float]
    num_samples: list[int]
    label_kind: str
    num_bins: int
    notes: list[str] = field(default_factory=list)
    bins_before: list[dict] = field(default_factory=list)  # reliability_bins per position
    bins_after: list[dict] = field(default_factory=list)
    # The same metrics on held-out rollouts the temperatures were not fitted on (`evaluate_temperatures`,
    # plus mean_ece_before/after and the split's sizes); empty when everything was used for the fit.
    heldout: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_ece_before(self) -> float:
        return float(np.mean(self.ece_before))

    @property
    def mean_ece_after(self) -> float:
        return float(np.mean(self.ece_after))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CalibrationResult":
        if not isinstance(data, dict):
            raise ValueError(f"CalibrationResult.from_json: expected a dict, got {type(data).__name__}")
        missing = [name for name in ("temperatures", "label_kind", "num_bins") if name not in data]
        if missing:
            raise ValueError(f"CalibrationResult.from_json: missing field(s) {missing}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"CalibrationResult.from_json: unknown field(s) {unknown}")
        temperatures = [float(t) for t in data["temperatures"]]
        bad = [k + 1 for k, t in enumerate(temperatures) if not (math.isfinite(t) and t > 0)]
        if bad:
            raise ValueError(f"CalibrationResult.from_json: temperatures at position(s) {bad} must be finite and > 0")
        return cls(**{**data, "temperatures": temperatures})

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "CalibrationResult":
        return cls.from_json(read_json(path))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


def apply_temperatures(confidence_logits_NK: Any, temperatures: Sequence[float]) -> Any:
    """Calibrated conditional probabilities ``sigmoid(z_k / T_k)``; same type as the input.

    Accepts a torch tensor (returned as a tensor of the same dtype/device) or an array-like
    (returned as a float64 ndarray). The last dimension is the position K.
    """
    temps = [float(t) for t in temperatures]
    if any(not (math.isfinite(t) and t > 0) for t in temps):
        raise ValueError(f"temperatures must be finite and > 0, got {temps}")
    if hasattr(confidence_logits_NK, "detach"):
        import torch

        if confidence_logits_NK.shape[-1] != len(temps):
            raise ValueError(
                f"confidence_logits has {confidence_logits_NK.shape[-1]} positions but {len(temps)} temperatures"
            )
        temps_K = torch.tensor(temps, dtype=confidence_logits_NK.dtype, device=confidence_logits_NK.device)
        return torch.sigmoid(confidence_logits_NK / temps_K)
    logits_NK = as_float64_array(confidence_logits_NK, "confidence_logits")
    if logits_NK.shape[-1] != len(temps):
        raise ValueError(f"confidence_logits has {logits_NK.shape[-1]} positions but {len(temps)} temperatures")
    return _sigmoid(logits_NK / np.asarray(temps))


def _check_inputs(logits, survival, valid, label_kind):
    if label_kind not in LABEL_KINDS:
        raise ValueError(f"label_kind must be one of {LABEL_KINDS}, got {label_kind!r}")
    logits_NK = as_float64_array(logits, "confidence_logits_NK")
    survival_NK = as_float64_array(survival, "survival_NK")
    if logits_NK.ndim != 2:
        raise ValueError(f"confidence_logits_NK must be 2-D [N, K], got shape {logits_NK.shape}")
    if survival_NK.shape != logits_NK.shape:
        raise ValueError(f"survival_NK shape {survival_NK.shape} != confidence_logits_NK shape {logits_NK.shape}")
    if valid is None:
        valid_NK = np.ones(logits_NK.shape, dtype=bool)
    else:
        valid_NK = np.asarray(valid.detach().cpu().numpy() if hasattr(valid, "detach") else valid).astype(bool)
        if valid_NK.shape != logits_NK.shape:
            raise ValueError(f"valid_NK shape {valid_NK.shape} != confidence_logits_NK shape {logits_NK.shape}")
        # A block ends somewhere: valid positions must form a prefix so that cumulative products exist.
        holes = valid_NK[:, 1:] & ~valid_NK[:, :-1]
        if holes.any():
            n, k = np.argwhere(holes)[0]
            raise ValueError(
                f"valid_NK: block {n} is valid at position {k + 2} but not at position {k + 1}; "
                "valid positions must be a prefix"
            )
    labels = survival_NK[valid_NK]
    if labels.size and (labels.min() < 0.0 or labels.max() > 1.0):
        raise ValueError("survival_NK: values must lie in [0, 1]")
    if label_kind == "hard" and not np.all((labels == 0.0) | (labels == 1.0)):
        raise ValueError(
            "survival_NK: label_kind='hard' needs labels in {0, 1}; use label_kind='analytic' for soft labels"
        )
    # Prefix survival can only fall along a block (tiny slack for float round-off of products).
    rising = valid_NK[:, 1:] & (survival_NK[:, 1:] > survival_NK[:, :-1] + 1e-6)
    if rising.any():
        n, k = np.argwhere(rising)[0]
        raise ValueError(
            f"survival_NK: block {n} has survival {survival_NK[n, k + 1]:.6g} at position {k + 2} > "
            f"{survival_NK[n, k]:.6g} at position {k + 1}; "
            "pass prefix survival (cumulative), not per-position acceptance"
        )
    return logits_NK, survival_NK, valid_NK


def _golden_section_log(objective, low: float, high: float, iterations: int) -> tuple[float, float]:
    """Minimise objective(T) over log T in [log low, log high]; returns (T, value)."""
    inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = math.log(low), math.log(high)
    c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
    fc, fd = objective(math.exp(c)), objective(math.exp(d))
    for _ in range(iterations):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - inv_phi * (b - a)
            fc = objective(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + inv_phi * (b - a)
            fd = objective(math.exp(d))
    return (math.exp(c), fc) if fc <= fd else (math.exp(d), fd)


def _fit_temperature(prev_cum_M, logits_M, labels_M, grid_G, num_bins) -> float:
    def objective(temperature: float) -> float:
        return expected_calibration_error(prev_cum_M * _sigmoid(logits_M / temperature), labels_M, num_bins)

    values_G = [objective(t) for t in grid_G]
    best = int(np.argmin(values_G))
    best_t, best_value = float(grid_G[best]), values_G[best]
    low = float(grid_G[max(best - 1, 0)])
    high = float(grid_G[min(best + 1, len(grid_G) - 1)])
    if high > low:
        refined_t, refined_value = _golden_section_log(objective, low, high, GOLDEN_ITERATIONS)
        if refined_value < best_value:
            best_t = refined_t
    return best_t


def sequential_temperature_scaling(
    confidence_logits_NK: Any,
    survival_NK: Any,
    valid_NK: Any = None,
    num_bins: int = DEFAULT_NUM_BINS,
    grid: Sequence[float] | None = None,
    min_samples: int = 50,
    label_kind: str = "analytic",
) -> CalibrationResult:
    """Fit per-position temperatures left to right (see module docstring).

    Args:
        confidence_logits_NK: raw confidence-head logits z_k (before the sigmoid).
        survival_NK: observed prefix survival at each position: hard 1/0 ("x_1..x_k all accepted")
            or analytic soft labels (product of per-position acceptance probabilities).
        valid_NK: bool mask, False past a block's end; must be a prefix per block.
        grid: candidate temperatures (> 0); default 121 log-spaced values in [0.05, 20].
        min_samples: fewer valid samples at a position raises ValueError.
        label_kind: "analytic" (soft) or "hard".

    Degenerate positions (all labels 1 or all 0) keep T_k = 1.0, get ``auroc`` None and a note.
    """
    logits_NK, survival_NK, valid_NK = _check_inputs(confidence_logits_NK, survival_NK, valid_NK, label_kind)
    grid_G = np.asarray(DEFAULT_GRID if grid is None else grid, dtype=np.float64)
    if grid_G.ndim != 1 or grid_G.size == 0 or not np.all(np.isfinite(grid_G)) or np.any(grid_G <= 0):
        raise ValueError("grid: need a non-empty 1-D list of finite temperatures > 0")
    grid_G = np.unique(grid_G)
    num_positions = logits_NK.shape[1]
    counts_K = valid_NK.sum(axis=0)
    for k in range(num_positions):
        if counts_K[k] < min_samples:
            raise ValueError(
                f"position {k + 1}: only {int(counts_K[k])} valid samples, need at least min_samples={min_samples}"
                " (more validation data, or a lower min_samples: --min-samples, "
                "calibration.min_samples)"
            )

    raw_cum_NK = np.cumprod(_sigmoid(logits_NK), axis=1)
    temperatures: list[float] = []
    notes: list[str] = []
    calibrated_cum_N = np.ones(logits_NK.shape[0])
    result = CalibrationResult([], [], [], [], [], [], [int(c) for c in counts_K], label_kind, num_bins, notes)
    for k in range(num_positions):
        mask_N = valid_NK[:, k]
        labels_M = survival_NK[mask_N, k]
        prev_cum_M = calibrated_cum_N[mask_N]
        degenerate = labels_M.min() == labels_M.max() and labels_M[0] in (0.0, 1.0)
        if degenerate:
            temperature = 1.0
            outcome = "all survived" if labels_M[0] == 1.0 else "none survived"
            notes.append(f"position {k + 1}: {outcome} in {labels_M.size} samples; temperature kept at 1.0")
        else:
            temperature = _fit_temperature(prev_cum_M, logits_NK[mask_N, k], labels_M, grid_G, num_bins)
        temperatures.append(temperature)
        calibrated_cum_N = calibrated_cum_N * _sigmoid(logits_NK[:, k] / temperature)
        after_M, before_M = calibrated_cum_N[mask_N], raw_cum_NK[mask_N, k]
        result.ece_before.append(expected_calibration_error(before_M, labels_M, num_bins))
        result.ece_after.append(expected_calibration_error(after_M, labels_M, num_bins))
        result.brier_before.append(brier_score(before_M, labels_M))
        result.brier_after.append(brier_score(after_M, labels_M))
        result.bins_before.append(reliability_bins(before_M, labels_M, num_bins))
        result.bins_after.append(reliability_bins(after_M, labels_M, num_bins))
        try:
            result.auroc.append(auroc(after_M, labels_M))
        except ValueError as err:
            result.auroc.append(None)
            if not degenerate:
                notes.append(f"position {k + 1}: {err}")
    result.temperatures = temperatures
    return result


def _safe_auroc(scores, labels) -> float | None:
    try:
        return auroc(scores, labels)
    except ValueError:
        return None


def evaluate_temperatures(confidence_logits_NK: Any, survival_NK: Any, valid_NK: Any, temperatures: Sequence[float],
                          num_bins: int = DEFAULT_NUM_BINS) -> dict[str, Any]:
    """Per-position metrics of the raw and the calibrated prefix survival on the given rows (e.g. held-out
    rollouts): ECE, Brier and AUROC before/after, mean confidence and survival, reliability bins, counts."""
    logits, survival, valid = _check_inputs(confidence_logits_NK, survival_NK, valid_NK, "analytic")
    raw_cum = np.cumprod(_sigmoid(logits), axis=1)
    cal_cum = np.cumprod(apply_temperatures(logits, temperatures), axis=1)
    rows: dict[str, list] = {"ece_before": [], "ece_after": [], "brier_before": [], "brier_after": [],
                             "auroc_before": [], "auroc_after": [], "num_samples": [], "mean_confidence_before": [],
                             "mean_confidence_after": [], "mean_survival": [], "bins_before": [], "bins_after": []}
    for k in range(logits.shape[1]):
        mask = valid[:, k]
        if not mask.any():
            raise ValueError(f"position {k + 1}: no held-out samples; hold out more rollouts or add validation data")
        labels, before, after = survival[mask, k], raw_cum[mask, k], cal_cum[mask, k]
        rows["ece_before"].append(expected_calibration_error(before, labels, num_bins))
        rows["ece_after"].append(expected_calibration_error(after, labels, num_bins))
        rows["brier_before"].append(brier_score(before, labels))
        rows["brier_after"].append(brier_score(after, labels))
        rows["auroc_before"].append(_safe_auroc(before, labels))
        rows["auroc_after"].append(_safe_auroc(after, labels))
        rows["num_samples"].append(int(mask.sum()))
        rows["mean_confidence_before"].append(float(before.mean()))
        rows["mean_confidence_after"].append(float(after.mean()))
        rows["mean_survival"].append(float(labels.mean()))
        rows["bins_before"].append(reliability_bins(before, labels, num_bins))
        rows["bins_after"].append(reliability_bins(after, labels, num_bins))
    return rows
