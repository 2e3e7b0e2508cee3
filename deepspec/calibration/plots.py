"""Reliability diagrams for the confidence head (paper fig. 6 style), one subplot per position.

Each subplot: bars of observed survival (accuracy) per equal-width confidence bin, before and
after calibration, the perfect-calibration diagonal, a faint histogram of sample counts, and the
ECE before -> after (plus AUROC) in the title. Uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from deepspec.calibration.sts import CalibrationResult
from deepspec.utils.io import atomic_path


def _bar_values(bins: dict) -> tuple[list[float], list[float], float]:
    edges = bins["edges"]
    width = edges[1] - edges[0]
    lefts = edges[:-1]
    heights = [0.0 if acc is None else acc for acc in bins["accuracy"]]
    return lefts, heights, width


def save_reliability_diagrams(
    result: CalibrationResult | Sequence[dict],
    path_png: str | Path,
    positions: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """Write a PNG with one reliability subplot per position; returns the path.

    ``result`` is a ``CalibrationResult`` (before/after bars) or a list of ``reliability_bins``
    dicts, one per position (single set of bars). ``positions`` are 1-based; default all.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(result, CalibrationResult):
        before, after = result.bins_before, result.bins_after
        if not before:
            raise ValueError("save_reliability_diagrams: CalibrationResult has no reliability bins "
                             "(bins_before is empty)")
    else:
        before, after = list(result), []
        if not before:
            raise ValueError("save_reliability_diagrams: no reliability bins given")
    chosen = list(positions) if positions is not None else list(range(1, len(before) + 1))
    bad = [p for p in chosen if not 1 <= p <= len(before)]
    if bad:
        raise ValueError(f"save_reliability_diagrams: positions {bad} out of range 1..{len(before)}")

    fig, axes = plt.subplots(1, len(chosen), figsize=(3.2 * len(chosen), 3.4), squeeze=False)
    for ax, position in zip(axes[0], chosen):
        bins_b = before[position - 1]
        lefts, heights, width = _bar_values(bins_b)
        total = max(sum(bins_b["counts"]), 1)
        ax.bar(lefts, [c / total for c in bins_b["counts"]], width=width, align="edge", color="0.9", zorder=0)
        ax.bar(lefts, heights, width=width, align="edge", alpha=0.5, color="tab:red", edgecolor="k",
               label="Before calibration", zorder=1)
        subtitle = f"Position {position}"
        if after:
            lefts_a, heights_a, _ = _bar_values(after[position - 1])
            ax.bar(lefts_a, heights_a, width=width, align="edge", alpha=0.5, color="tab:blue", edgecolor="k",
                   label="After calibration", zorder=2)
            ece_before, ece_after = result.ece_before[position - 1], result.ece_after[position - 1]
            subtitle += f"\nECE: {100 * ece_before:.1f}% -> {100 * ece_after:.1f}%"
            auc = result.auroc[position - 1]
            if auc is not None:
                subtitle += f"  AUC: {auc:.3f}"
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="Perfect calibration", zorder=3)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(subtitle, fontsize=9)
        ax.set_xlabel("Predicted survival")
    axes[0][0].set_ylabel("Observed survival")
    axes[0][0].legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path_png = Path(path_png)
    with atomic_path(path_png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    return path_png
