"""The typed `calibration:` section of a training run: STS of the confidence head right after training.

Used by `deepspec.calibration.run.calibrate_after_training` on the training cache's validation split:
empirical labels by default (rollouts of the decoding loop on the validation prompts with the trained
drafter and the target; a `holdout` share of the rollouts is kept out of the fit to report ECE before/after),
`labels: analytic` for the cheap soft labels (1 - TV/2, no rollouts; what the head was trained on, so the
fit leaves T ~ 1; DSpark only: a standalone drafter's confidences have no teacher-forced label). Drafters
without a confidence head are skipped. `deepspec calibrate` calibrates a saved drafter later with the same
settings as command-line flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

LABELS = ("empirical", "analytic")


@dataclass
class CalibrationSchema:
    """Every default of calibration, written once: the `calibration:` section of a training run, and the flags of
    `deepspec calibrate` (and `deepspec bench calibration`), built from these fields (`add_cli_args`)."""

    enabled: bool = True  # fit STS temperatures at the end of training (drafters with a confidence head)
    labels: str = "empirical"  # empirical (acceptance in rollouts) | analytic (1 - TV/2 from the cache, DSpark)
    holdout: float = field(default=0.5, metadata={
        "help": "share of rollouts (analytic: validation sequences) held out to report ECE; 0: none"})
    num_bins: int = 20  # ECE bins
    min_samples: int = 50  # fewer fit rows at a position: fitting fails with a clear error
    max_anchors_per_seq: int = 64  # analytic: blocks per validation sequence
    max_prompts: int = field(default=64, metadata={"help": "empirical labels: validation prompts used"})
    max_new_tokens: int = field(default=128, metadata={"help": "empirical labels: tokens per rollout"})
    seed: int = 0

    def __post_init__(self) -> None:
        if self.labels not in LABELS:
            raise ValueError(f"calibration.labels={self.labels!r} must be one of {LABELS}")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"calibration.holdout={self.holdout} must lie in [0, 1)")
        for name in ("num_bins", "min_samples", "max_prompts", "max_new_tokens", "max_anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration.{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """`--labels`, `--holdout`, ...: one flag per setting but `enabled`, with the field's default and help."""
        types = {"int": int, "float": float, "str": str}
        for f in cli_fields(cls):
            extra = {"choices": LABELS} if f.name == "labels" else {}
            parser.add_argument("--" + f.name.replace("_", "-"), type=types[f.type], default=f.default,
                                help=f.metadata.get("help"), **extra)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> CalibrationSchema:
        return cls(**{f.name: getattr(args, f.name) for f in cli_fields(cls)})


def cli_fields(cls) -> list:
    """The settings a command line sets: all but `enabled` (training's switch)."""
    return [f for f in fields(cls) if f.name != "enabled"]
