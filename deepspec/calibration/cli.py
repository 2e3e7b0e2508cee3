"""`deepspec calibrate`: fit STS temperatures for a saved drafter with a confidence head and store them with it.

Usage: deepspec calibrate --drafter DIR --cache DIR [--target NAME] [--out DIR] [--labels empirical|analytic]
       [--holdout H] [--num-bins N] [--min-samples N] [--max-prompts N] [--max-new-tokens N] [--no-write-config]
The settings and their defaults are `CalibrationSchema`'s (deepspec/calibration/config.py), a training run's
`calibration:` section.
Empirical labels (the default): observed acceptance in rollouts on the validation prompts; `--holdout` of the
rollouts are not fitted on and report ECE before/after (`heldout`). Analytic labels are what the confidence
head was trained on: fitting on them leaves T ~ 1.
Prints one JSON object (mean ECE before/after on the fit and held-out rollouts, temperatures, files written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepspec.calibration.config import CalibrationSchema
from deepspec.calibration.run import CALIBRATION_FILE, RELIABILITY_FILE, calibrate
from deepspec.utils.checksums import check_drafter_checksums
from deepspec.utils.errors import command_line
from deepspec.utils.io import check_output_folder


def build_parser(prog: str = "deepspec calibrate") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Sequential Temperature Scaling of a DSpark "
                                     "drafter's confidence head on a cache's validation split.")
    parser.add_argument("--drafter", required=True, help="saved drafter directory (config.json + weights)")
    parser.add_argument("--cache", required=True, help="feature cache directory (its validation split is used)")
    parser.add_argument("--target", default=None, help="target name/path (default: the drafter config's target_name)")
    parser.add_argument("--out", default=None, help="folder for calibration.json/reliability.png (default: --drafter)")
    CalibrationSchema.add_cli_args(parser)  # --labels, --holdout, ...: the settings, their defaults and help
    parser.add_argument("--device", default=None)
    parser.add_argument("--no-write-config", action="store_true", help="do not store temperatures in config.json")
    return parser


def target_name_of(drafter_dir: Path) -> str:
    """The target a saved drafter records, read once its checksums (a training checkpoint's) are verified."""
    config_file = drafter_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a saved drafter directory")
    check_drafter_checksums(drafter_dir)
    name = json.loads(config_file.read_text()).get("target_name")
    if not name:
        raise ValueError(f"{config_file}: no target_name recorded; pass --target")
    return name


@command_line("deepspec calibrate")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    drafter_dir = Path(args.drafter)
    check_output_folder(args.out or drafter_dir, "--out")
    settings = CalibrationSchema.from_cli_args(args)
    target = args.target or target_name_of(drafter_dir)
    result = calibrate(drafter_dir, args.cache, target, settings, out=args.out, device=args.device,
                       write_config=not args.no_write_config)
    out_dir = Path(args.out or drafter_dir)
    summary = {"labels": settings.labels, "label_kind": result.label_kind, "temperatures": result.temperatures,
               "mean_ece_before": result.mean_ece_before, "mean_ece_after": result.mean_ece_after,
               "ece_before": result.ece_before, "ece_after": result.ece_after, "auroc": result.auroc,
               "num_samples": result.num_samples, "heldout": result.heldout, "notes": result.notes,
               "files": [str(out_dir / CALIBRATION_FILE), str(out_dir / RELIABILITY_FILE)],
               "config_updated": None if args.no_write_config else str(drafter_dir / "config.json")}
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
