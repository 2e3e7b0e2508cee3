"""Per-position and per-TTT-step loss weights (DSpark paper §3.3).

DSpark/DFlash weight block slot k (1-based) by ``w_k = exp(-(k-1)/gamma)``: earlier slots contribute
more to the expected acceptance length under prefix verification. The paper writes gamma = block
size; DeepSpec's reference code uses gamma = 4.0, which we take as the default
(``DEFAULT_POSITION_GAMMA``); record the value used in the training config.

Eagle3's test-time-training unroll weights step s (0-based) by ``decay**s`` (0.8 in SpecForge).

Shape legend: K = block positions, S = TTT steps.
"""

from __future__ import annotations

import math

import torch

DEFAULT_POSITION_GAMMA = 4.0
DEFAULT_TTT_DECAY = 0.8


def position_weights(num_positions: int, gamma: float = DEFAULT_POSITION_GAMMA) -> torch.Tensor:
    """Return ``w_K`` with ``w[k-1] = exp(-(k-1)/gamma)`` for k = 1..num_positions (float32)."""
    if int(num_positions) != num_positions or num_positions < 1:
        raise ValueError(f"num_positions must be a positive integer, got {num_positions!r}")
    if not (isinstance(gamma, (int, float)) and math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"gamma must be a positive finite number, got {gamma!r}")
    slot_K = torch.arange(int(num_positions), dtype=torch.float64)
    return torch.exp(-slot_K / float(gamma)).to(torch.float32)


def ttt_step_weights(num_steps: int, decay: float = DEFAULT_TTT_DECAY) -> torch.Tensor:
    """Return ``w_S`` with ``w[s] = decay**s`` for s = 0..num_steps-1 (float32)."""
    if int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
    if not (isinstance(decay, (int, float)) and math.isfinite(decay) and decay > 0):
        raise ValueError(f"decay must be a positive finite number, got {decay!r}")
    step_S = torch.arange(int(num_steps), dtype=torch.float64)
    return torch.pow(float(decay), step_S).to(torch.float32)
