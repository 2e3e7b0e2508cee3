"""Per-position acceptance metrics of draft rows against the target (validation, logging).

- top-1 agreement: draft argmax == target argmax (what greedy verification accepts);
- expected acceptance ``1 - TV/2``: speculative sampling's per-step acceptance probability;
- simulated acceptance length per block ``tau_sim = 1 + sum_j prod_{i<=j} (1 - TV_i / 2)``, averaged
  over blocks. The leading 1 counts the bonus token the target emits every round, so it matches the
  evaluation's tau (<= block size + 1). The chain stops at a block's first unsupervised slot
  (acceptance 0 from there on); blocks without supervised rows are skipped.
  ``tau_greedy_sim`` is the same with the 0/1 top-1 agreement in place of ``1 - TV/2``.
Rows are placed by ``position_index_N`` (slot in the block) and ``block_index_N`` (any integer id per
block; ids need not be contiguous); a (block, slot) pair must occur at most once.

Shape legend: N = rows, K = block positions, B = blocks.
"""

from __future__ import annotations

import torch

from deepspec.losses.distribution import DistributionTerms


def _check_indices(position_index_N: torch.Tensor, block_index_N: torch.Tensor, num_rows: int,
                   num_positions: int) -> None:
    for name, index_N in (("position_index_N", position_index_N), ("block_index_N", block_index_N)):
        if index_N.dim() != 1 or index_N.shape[0] != num_rows:
            raise ValueError(f"{name} must be [{num_rows}]; got {tuple(index_N.shape)}")
        if index_N.dtype not in (torch.long, torch.int32):
            raise ValueError(f"{name} must be an integer tensor, got {index_N.dtype}")
    if num_rows and (int(position_index_N.min()) < 0 or int(position_index_N.max()) >= num_positions):
        raise ValueError(f"position_index_N values must lie in [0, {num_positions})")


def _block_grid(
    value_N: torch.Tensor, valid_N: torch.Tensor, position_index_N: torch.Tensor, block_index_N: torch.Tensor,
    num_positions: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows into ``value_BK`` (0 where unsupervised/missing) and ``has_valid_B``."""
    block_ids_B, block_of_row_N = torch.unique(block_index_N.long(), return_inverse=True)
    num_blocks = block_ids_B.shape[0]
    flat_N = block_of_row_N * num_positions + position_index_N.long()
    occupancy = torch.bincount(flat_N, minlength=num_blocks * num_positions)
    if occupancy.numel() and int(occupancy.max()) > 1:
        raise ValueError("each (block_index_N, position_index_N) pair must occur at most once")
    value_BK = torch.zeros(num_blocks * num_positions, dtype=torch.float64, device=value_N.device)
    value_BK[flat_N] = torch.where(valid_N, value_N.detach().double(), torch.zeros_like(value_N, dtype=torch.float64))
    has_valid_B = torch.zeros(num_blocks, dtype=torch.bool, device=value_N.device)
    has_valid_B[block_of_row_N[valid_N]] = True
    return value_BK.view(num_blocks, num_positions), has_valid_B


def simulated_acceptance_length(
    accept_N: torch.Tensor,
    valid_N: torch.Tensor,
    position_index_N: torch.Tensor,
    block_index_N: torch.Tensor,
    num_positions: int,
) -> torch.Tensor:
    """Per-block ``1 + sum_j prod_{i<=j} accept_i`` (float64 [B]) for blocks with a supervised row."""
    _check_indices(position_index_N, block_index_N, accept_N.shape[0], num_positions)
    accept_BK, has_valid_B = _block_grid(accept_N, valid_N, position_index_N, block_index_N, num_positions)
    tau_B = 1.0 + torch.cumprod(accept_BK, dim=1).sum(dim=1)
    return tau_B[has_valid_B]


class AcceptanceMetrics:
    """Accumulates per-position agreement/acceptance and simulated tau over batches and ranks.

    Distributed use: ``t = m.state_tensor(device); dist.all_reduce(t); m.load_state_tensor(t)``.
    """

    def __init__(self, num_positions: int):
        if int(num_positions) != num_positions or num_positions < 1:
            raise ValueError(f"num_positions must be a positive integer, got {num_positions!r}")
        self.num_positions = int(num_positions)
        self.reset()

    def reset(self) -> None:
        K = self.num_positions
        self.rows_K = torch.zeros(K, dtype=torch.float64)
        self.agree_K = torch.zeros(K, dtype=torch.float64)
        self.accept_K = torch.zeros(K, dtype=torch.float64)
        self.tau_sum = torch.zeros((), dtype=torch.float64)
        self.tau_greedy_sum = torch.zeros((), dtype=torch.float64)
        self.num_blocks = torch.zeros((), dtype=torch.float64)

    def update(self, terms: DistributionTerms, position_index_N: torch.Tensor, block_index_N: torch.Tensor) -> None:
        K = self.num_positions
        _check_indices(position_index_N, block_index_N, terms.num_rows, K)
        valid_N = terms.valid_N
        accept_N = (1.0 - 0.5 * terms.term("tv").detach().double()).clamp(0.0, 1.0)
        agree_N = (terms.draft_argmax_N == terms.target_argmax_N).double()
        index_N = position_index_N.long()
        mask_N = valid_N.double()

        def sum_by_position(value_N: torch.Tensor) -> torch.Tensor:
            sums_K = torch.zeros(K, dtype=torch.float64, device=value_N.device)
            return sums_K.index_add_(0, index_N, value_N * mask_N).cpu()

        self.rows_K += sum_by_position(torch.ones_like(mask_N))
        self.agree_K += sum_by_position(agree_N)
        self.accept_K += sum_by_position(accept_N)
        tau_B = simulated_acceptance_length(accept_N, valid_N, position_index_N, block_index_N, K)
        tau_greedy_B = simulated_acceptance_length(agree_N, valid_N, position_index_N, block_index_N, K)
        self.tau_sum += tau_B.sum().cpu()
        self.tau_greedy_sum += tau_greedy_B.sum().cpu()
        self.num_blocks += float(tau_B.shape[0])

    @property
    def state_size(self) -> int:
        """Length of `state_tensor()`: three per-position sums and three totals."""
        return 3 * self.num_positions + 3

    def state_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Flat float64 state ``[rows_K, agree_K, accept_K, tau_sum, tau_greedy_sum, num_blocks]`` (sums)."""
        totals = torch.stack([self.tau_sum, self.tau_greedy_sum, self.num_blocks])
        state = torch.cat([self.rows_K, self.agree_K, self.accept_K, totals])
        return state if device is None else state.to(device)

    def load_state_tensor(self, state: torch.Tensor) -> None:
        """Replace the state with ``state`` (e.g. after an all-reduce of ``state_tensor()``)."""
        K = self.num_positions
        if state.shape != (self.state_size,):
            raise ValueError(f"state must be [{self.state_size}] for num_positions={K}; got {tuple(state.shape)}")
        state = state.detach().double().cpu()
        state = state.clone()
        self.rows_K, self.agree_K, self.accept_K = state[:K], state[K : 2 * K], state[2 * K : 3 * K]
        self.tau_sum, self.tau_greedy_sum, self.num_blocks = state[3 * K], state[3 * K + 1], state[3 * K + 2]

    def compute(self) -> dict[str, torch.Tensor | float]:
        """Per-position means ([K] float64, NaN where no rows) and block-averaged tau (NaN without blocks)."""
        nan_K = torch.full_like(self.rows_K, float("nan"))
        has_rows_K = self.rows_K > 0
        blocks = float(self.num_blocks)
        return {
            "top1_agreement": torch.where(has_rows_K, self.agree_K / self.rows_K.clamp(min=1), nan_K),
            "expected_acceptance": torch.where(has_rows_K, self.accept_K / self.rows_K.clamp(min=1), nan_K),
            "tau_sim": float(self.tau_sum) / blocks if blocks else float("nan"),
            "tau_greedy_sim": float(self.tau_greedy_sum) / blocks if blocks else float("nan"),
            "num_blocks": blocks,
        }


def acceptance_metrics(
    terms: DistributionTerms, position_index_N: torch.Tensor, block_index_N: torch.Tensor, num_positions: int
) -> dict[str, torch.Tensor | float]:
    """One-batch metrics (see ``AcceptanceMetrics.compute`` for the keys)."""
    accumulator = AcceptanceMetrics(num_positions)
    accumulator.update(terms, position_index_N, block_index_N)
    return accumulator.compute()
