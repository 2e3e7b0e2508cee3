"""Calibration benchmark for a DSpark checkpoint: per-position ECE before/after STS, AUROC, Brier.

Usage:
  deepspec bench calibration --drafter DIR --cache DIR [--target NAME] [--labels empirical|analytic]
      [--holdout H] [--out outputs/bench_calibration.json] [--png-dir outputs/calibration]
      [--write-config]
(the settings of `deepspec calibrate`, with its defaults: deepspec/calibration/config.py)

Collects (confidence logit, prefix survival) pairs on the cache's validation split (empirical labels by
default: rollouts of the decoding loop on the validation prompts; analytic labels are what the confidence
head was trained on, so STS fitted on them leaves T ~ 1), fits STS on the rollouts not held out and reports
the metrics on the held-out `holdout` share of whole rollouts (validation sequences for analytic labels;
holdout 0: fit and report on all, as the paper does). Prints one JSON object and writes it to --out; the
reliability diagrams (before/after, one panel per position) go to --png-dir. Goal (paper fig. 6):
mean ECE after STS <= 2% and at most half of the ECE before; both are reported as booleans.
The checkpoint is not modified unless --write-config is given (then the temperatures fitted on the
fit share are stored in its config.json, as `deepspec calibrate` does).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from deepspec.calibration.cli import target_name_of
from deepspec.calibration.collect import require_confidence_head
from deepspec.calibration.config import CalibrationSchema
from deepspec.calibration.run import collect_labels, fit_and_report, open_cache_for_target, store_temperatures
from deepspec.calibration.sts import CalibrationResult, evaluate_temperatures
from deepspec.utils.errors import command_line
from deepspec.utils.io import emit_report


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--target", default=None, help="default: the drafter config's target_name")
    CalibrationSchema.add_cli_args(parser)  # `deepspec calibrate`'s settings, their defaults and help
    parser.add_argument("--max-validation-samples", type=int, default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="outputs/bench_calibration.json")
    parser.add_argument("--png-dir", default=None, help="default: next to --out")
    parser.add_argument("--write-config", action="store_true")
    return parser


@command_line("deepspec bench calibration")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settings = CalibrationSchema.from_cli_args(args)

    from deepspec.drafters.build import load_drafter
    from deepspec.targets.load import load_target

    drafter_dir = Path(args.drafter)
    target = load_target(args.target or target_name_of(drafter_dir), dtype="float32", device=args.device)
    drafter = load_drafter(drafter_dir, target).eval()
    require_confidence_head(drafter)
    cache = open_cache_for_target(args.cache, target)
    start = time.perf_counter()
    collected = collect_labels(drafter, cache, target, settings, max_validation_samples=args.max_validation_samples)
    collect_s = time.perf_counter() - start

    result: CalibrationResult = fit_and_report(collected, settings)
    # Held-out rollouts when holding out, else (the paper's way) every row, which was also the fit's.
    metrics = result.heldout or evaluate_temperatures(collected.confidence_logits_NK, collected.survival_NK,
                                                      collected.valid_NK, result.temperatures, settings.num_bins)

    out = Path(args.out)
    png_dir = Path(args.png_dir) if args.png_dir else out.parent / "calibration_png"
    report = CalibrationResult(result.temperatures, metrics["ece_before"], metrics["ece_after"], metrics["auroc_after"],
                               metrics["brier_before"], metrics["brier_after"], metrics["num_samples"],
                               result.label_kind, settings.num_bins, list(result.notes), metrics["bins_before"],
                               metrics["bins_after"])
    from deepspec.calibration.plots import save_reliability_diagrams

    rows = "held-out rollouts" if result.heldout else "all rows (also the fit's)"
    png = save_reliability_diagrams(report, png_dir / "reliability_heldout.png",
                                    title=f"{drafter_dir.name}: {settings.labels} labels, {rows}")
    mean_before, mean_after = float(np.mean(metrics["ece_before"])), float(np.mean(metrics["ece_after"]))
    summary = {
        "drafter": str(drafter_dir), "cache": str(args.cache), "labels": settings.labels,
        "label_kind": result.label_kind, "holdout": settings.holdout,
        "num_rows": {"total": int(collected.valid_NK.shape[0]),
                     **result.heldout.get("num_rows", {"fit": int(collected.valid_NK.shape[0])})},
        "num_groups": result.heldout.get("num_groups"),
        "temperatures": result.temperatures,
        "mean_ece_before": mean_before, "mean_ece_after": mean_after,
        "goal_ece_after_le_2pct": mean_after <= 0.02, "goal_ece_at_least_halved": mean_after <= 0.5 * mean_before,
        **{k: v for k, v in metrics.items() if k not in ("bins_before", "bins_after", "num_rows", "num_groups",
                                                          "holdout", "mean_ece_before", "mean_ece_after")},
        "fit_split": {"ece_before": result.ece_before, "ece_after": result.ece_after},
        "notes": result.notes, "collect_s": collect_s, "png": str(png),
    }
    if args.write_config:
        store_temperatures(drafter, drafter_dir, result, settings.labels)
        summary["config_updated"] = str(drafter_dir / "config.json")
    emit_report(summary, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
