"""The typed `calibration:` section of a training run: STS of the confidence head right after training.

Used by `deepspec.calibration.run.calibrate_after_training` on the training cache's validation split:
empirical labels by default (rollouts of the decoding loop on the validation prompts with the trained
drafter and the target; a `holdout` share of the rollouts is kept out of the fit to report ECE before/after),
`labels: analytic` for the cheap soft labels (1 - TV/2, no rollouts; what the head was trained on, so the
fit leaves T ~ 1). Drafters without a confidence head are skipped. `deepspec calibrate` calibrates a saved
drafter later with the same settings as command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass

LABELS = ("empirical", "analytic")


@dataclass
class CalibrationSchema:
    enabled: bool = True  # fit STS temperatures at the end of training (drafters with a confidence head)
    labels: str = "empirical"  # empirical (observed acceptance in rollouts) | analytic (1 - TV/2 from the cache)
    holdout: float = 0.5  # share of rollouts (validation sequences, analytic) held out to report ECE; 0: none
    num_bins: int = 20  # ECE bins
    min_samples: int = 50  # fewer fit rows at a position: fitting fails with a clear error
    max_prompts: int = 64  # empirical: validation prompts rolled out
    max_new_tokens: int = 128  # empirical: tokens per rollout
    max_anchors_per_seq: int = 64  # analytic: blocks per validation sequence
    seed: int = 0

    def __post_init__(self) -> None:
        if self.labels not in LABELS:
            raise ValueError(f"calibration.labels={self.labels!r} must be one of {LABELS}")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"calibration.holdout={self.holdout} must lie in [0, 1)")
        for name in ("num_bins", "min_samples", "max_prompts", "max_new_tokens", "max_anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration.{name}={getattr(self, name)} must be >= 1")
