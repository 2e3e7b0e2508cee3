"""Length policies for the batch-1 decoding loop: how many of the proposed drafts the target verifies.

A length policy is `(confidence_K | None, max_len) -> length` (see `deepspec.decoding.loop.LengthPolicy`);
the loop clamps the result to `max_len` (what was drafted and what the request may still emit).
All policies here are thin views of `VerificationPolicy` (scheduler.py), the single source of the rules:
  * fixed      - verify min(verify_length, max_len) drafts (verify_length None: all of them);
  * threshold  - static confidence threshold (paper fig. 5): up to the first position whose calibrated
                 conditional confidence c_k (or prefix survival with cumulative=True) is below it;
  * scheduler  - Algorithm 1 at batch 1 with a profiled SPS table.
Confidence-based policies need a drafter with a confidence head and raise ValueError otherwise (a
silent fallback to fixed length would mislabel results).

Shape legend: K = proposed draft positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepspec.decoding.loop import LengthPolicy
from deepspec.decoding.scheduler import SPSTable, VerificationPolicy


def _check_verify_length(verify_length: int | None) -> None:
    if verify_length is not None and (isinstance(verify_length, bool) or not isinstance(verify_length, int)
                                      or verify_length < 0):
        raise ValueError(f"verify_length={verify_length!r} must be None or an int >= 0")


def length_policy(policy: VerificationPolicy, verify_length: int | None = None,
                  sps: SPSTable | Callable[[int], float] | None = None) -> LengthPolicy:
    """The loop's length policy for `policy`, additionally capped at `verify_length` drafts."""
    _check_verify_length(verify_length)

    def choose(confidence_K: torch.Tensor | None, max_len: int) -> int:
        cap = max_len if verify_length is None else min(max_len, verify_length)
        if policy.mode == "fixed":
            return cap
        if confidence_K is None:
            raise ValueError(f"verification policy {policy.mode!r} needs confidences: this drafter has no "
                             "confidence head (use mode 'fixed')")
        if cap == 0:
            return 0
        confidence_1K = confidence_K[:cap].detach().float().cpu()[None]
        return int(policy.lengths(confidence_1K, sps=sps)[0])

    return choose


def fixed_policy(verify_length: int | None = None) -> LengthPolicy:
    """Verify every draft (or at most `verify_length` of them)."""
    return length_policy(VerificationPolicy(mode="fixed"), verify_length)


def threshold_policy(threshold: float, cumulative: bool = False, verify_length: int | None = None) -> LengthPolicy:
    """Static confidence threshold; threshold 0 is fixed-length verification."""
    return length_policy(VerificationPolicy(mode="threshold", threshold=threshold, cumulative_threshold=cumulative),
                         verify_length)
