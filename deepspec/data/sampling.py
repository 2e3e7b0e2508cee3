"""Sampling parameters, one class for every stage that samples from the target: regeneration (deepspec.data),
speculative decoding and evaluation (deepspec.decoding re-exports it beside its logit filters).

The temperature has no default: regeneration follows the target's recommendation (or decodes greedily), decoding
and evaluation default to T = 1 (the paper's protocol), so each caller states the one it means. Keyword-only, so
no call can put a value in the wrong field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1.0 mean "no filter"."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be a finite number >= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 0 (0 disables top-k)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1] (1 disables top-p)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters_vocab(self) -> bool:
        """True when top-k or top-p removes tokens (not just a temperature rescale)."""
        return self.top_k > 0 or self.top_p < 1.0
