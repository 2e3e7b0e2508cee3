"""The typed `calibration:` section of a training run: STS of the confidence head right after training.

Used by `deepspec.calibration.run.calibrate_after_training` (the kind's preferred label source: analytic labels
from the training cache's validation split, or, for kinds whose confidences only real rollouts can label, T=1
rollouts on its validation prompts; drafters without a confidence head are skipped). `deepspec calibrate` calibrates a saved
drafter later with the same settings as command-line flags.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CalibrationSchema:
    enabled: bool = True  # fit STS temperatures at the end of training (drafters with a confidence head)
    num_bins: int = 20  # ECE bins
    min_samples: int = 50  # fewer validation blocks at a position: fitting fails with a clear error
    max_anchors_per_seq: int = 64
    seed: int = 0
    max_prompts: int = 64  # empirical labels: validation prompts rolled out
    max_new_tokens: int = 128  # empirical labels: tokens per rollout
