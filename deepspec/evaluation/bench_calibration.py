"""Calibration benchmark for a DSpark checkpoint: per-position ECE before/after STS, AUROC, Brier.

Usage (or python eval/bench_calibration.py ...):
  deepspec bench calibration --drafter DIR --cache DIR [--target NAME] [--labels analytic|empirical]
      [--holdout 0.5] [--out outputs/bench_calibration.json] [--png-dir outputs/calibration]
      [--write-config]

Collects (confidence logit, prefix survival) pairs on the cache's validation split, fits STS on a
`1 - holdout` share of the blocks and reports the metrics on the held-out rest (holdout 0: fit and
report on all blocks, as the paper does). Prints one JSON object and writes it to --out; the
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
import torch

from deepspec.calibration.cli import target_name_of
from deepspec.calibration.collect import (
    collect_analytic,
    collect_empirical,
    require_confidence_head,
    validation_prompts,
)
from deepspec.calibration.metrics import (
    auroc,
    brier_score,
    expected_calibration_error,
    reliability_bins,
)
from deepspec.calibration.run import (
    fit_collected,
    open_cache_for_target,
    store_temperatures,
)
from deepspec.calibration.sts import CalibrationResult, apply_temperatures
from deepspec.utils.io import emit_report


def _safe_auroc(scores, labels):
    try:
        return auroc(scores, labels)
    except ValueError:
        return None


def evaluate(logits_NK, survival_NK, valid_NK, temperatures, num_bins: int) -> dict:
    """Per-position metrics of the raw and the calibrated prefix survival on the given rows."""
    logits = logits_NK.double().numpy()
    survival = survival_NK.double().numpy()
    valid = valid_NK.numpy()
    raw_cum = np.cumprod(1.0 / (1.0 + np.exp(-logits)), axis=1)
    cal_cum = np.cumprod(apply_temperatures(logits, temperatures), axis=1)
    rows = {"ece_before": [], "ece_after": [], "brier_before": [], "brier_after": [], "auroc_before": [],
            "auroc_after": [], "num_samples": [], "mean_confidence_before": [], "mean_confidence_after": [],
            "mean_survival": [], "bins_before": [], "bins_after": []}
    for k in range(logits.shape[1]):
        mask = valid[:, k]
        if not mask.any():
            raise ValueError(f"position {k + 1}: no held-out samples; lower --holdout or add validation data")
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


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--target", default=None, help="default: the drafter config's target_name")
    parser.add_argument("--labels", choices=("analytic", "empirical"), default="analytic")
    parser.add_argument("--holdout", type=float, default=0.5, help="share of blocks held out for reporting")
    parser.add_argument("--num-bins", type=int, default=20)
    parser.add_argument("--min-samples", type=int, default=50)
    parser.add_argument("--max-anchors-per-seq", type=int, default=64)
    parser.add_argument("--max-validation-samples", type=int, default=None)
    parser.add_argument("--max-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default="outputs/bench_calibration.json")
    parser.add_argument("--png-dir", default=None, help="default: next to --out")
    parser.add_argument("--write-config", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.0 <= args.holdout < 1.0:
        raise ValueError(f"--holdout={args.holdout} must lie in [0, 1)")

    from deepspec.drafters.build import load_drafter
    from deepspec.targets.load import load_target

    drafter_dir = Path(args.drafter)
    target = load_target(args.target or target_name_of(drafter_dir), dtype="float32", device=args.device)
    drafter = load_drafter(drafter_dir, target).eval()
    require_confidence_head(drafter)
    cache = open_cache_for_target(args.cache, target)
    start = time.perf_counter()
    if args.labels == "analytic":
        collected = collect_analytic(drafter, cache, max_anchors_per_seq=args.max_anchors_per_seq,
                                     max_samples=args.max_validation_samples, seed=args.seed)
    else:
        eos = [target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else []
        collected = collect_empirical(drafter, target.model, validation_prompts(cache, args.max_prompts),
                                      max_new_tokens=args.max_new_tokens, seed=args.seed, eos_token_ids=eos)
    collect_s = time.perf_counter() - start

    num_rows = collected.valid_NK.shape[0]
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(args.seed))
    num_held = round(args.holdout * num_rows)
    held, fit = order[:num_held], order[num_held:]
    fit_part = type(collected)(collected.confidence_logits_NK[fit], collected.survival_NK[fit],
                               collected.valid_NK[fit], collected.labels, collected.info)
    result: CalibrationResult = fit_collected(fit_part, num_bins=args.num_bins, min_samples=args.min_samples)
    report_rows = held if num_held else fit
    metrics = evaluate(collected.confidence_logits_NK[report_rows], collected.survival_NK[report_rows],
                       collected.valid_NK[report_rows], result.temperatures, args.num_bins)

    out = Path(args.out)
    png_dir = Path(args.png_dir) if args.png_dir else out.parent / "calibration_png"
    report = CalibrationResult(result.temperatures, metrics["ece_before"], metrics["ece_after"], metrics["auroc_after"],
                               metrics["brier_before"], metrics["brier_after"], metrics["num_samples"],
                               result.label_kind, args.num_bins, list(result.notes), metrics["bins_before"],
                               metrics["bins_after"])
    from deepspec.calibration.plots import save_reliability_diagrams

    png = save_reliability_diagrams(report, png_dir / "reliability_heldout.png",
                                    title=f"{drafter_dir.name}: {args.labels} labels, held-out blocks")
    mean_before, mean_after = float(np.mean(metrics["ece_before"])), float(np.mean(metrics["ece_after"]))
    summary = {
        "drafter": str(drafter_dir), "cache": str(args.cache), "labels": args.labels,
        "label_kind": result.label_kind, "holdout": args.holdout,
        "num_blocks": {"total": num_rows, "fit": int(fit.numel()), "reported": int(report_rows.numel())},
        "temperatures": result.temperatures,
        "mean_ece_before": mean_before, "mean_ece_after": mean_after,
        "goal_ece_after_le_2pct": mean_after <= 0.02, "goal_ece_at_least_halved": mean_after <= 0.5 * mean_before,
        **{k: v for k, v in metrics.items() if not k.startswith("bins_")},
        "fit_split": {"ece_before": result.ece_before, "ece_after": result.ece_after},
        "notes": result.notes, "collect_s": collect_s, "png": str(png),
    }
    if args.write_config:
        store_temperatures(drafter, drafter_dir, result, args.labels)
        summary["config_updated"] = str(drafter_dir / "config.json")
    emit_report(summary, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
