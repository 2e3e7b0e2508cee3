"""Choose how many draft tokens per request the target verifies (paper §3.2.2, Algorithm 1).

Shape legend: R = active requests, K = draft positions per request (gamma).

Three policies, one entry point (``VerificationPolicy.lengths``):
  * fixed      - verify the whole block.
  * threshold  - static: verify up to (excluding) the first position whose confidence is below
                 the threshold (conditional ``c_k`` by default, as in the paper's fig. 5 sweep;
                 ``cumulative=True`` uses the prefix survival ``prod_{i<=k} c_i`` instead).
  * scheduler  - Algorithm 1: admit (r, j) candidates in descending prefix survival
                 ``a_{r,j} = prod_{i<=j} c_{r,i}`` while the expected throughput
                 ``tau* x SPS(B)`` strictly increases, and STOP at the first non-improving
                 admission. The early stop is what keeps decoding lossless (paper appendix A):
                 whether x_{r,k} is admitted must not depend on quantities computed from x_{r,k}
                 itself (c_{r,k+1} reads x_{r,k} through the Markov feature).

``SPSTable`` is the profiled target speed: steps (forward passes) per second at verification
batch size B = sum_r (1 + l_r) tokens.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from deepspec.utils.io import atomic_write_json, read_json
from deepspec.utils.machine import cpu_model

SPS_TABLE_FORMAT_VERSION = 1
POLICY_MODES = ("fixed", "threshold", "scheduler")


# ---------------------------------------------------------------------------------------------
# Profiled steps-per-second table
# ---------------------------------------------------------------------------------------------


@dataclass
class SPSTable:
    """Steps per second of the target at profiled verification batch sizes (tokens per forward).

    ``sps(B)`` interpolates linearly between profiled points. Beyond the profiled range it is
    conservative: below the smallest B it returns SPS(B_min) (smaller batches are not slower),
    above the largest it assumes step time grows proportionally to B (SPS(B_max) * B_max / B),
    i.e. no further batching gain.
    """

    batch_sizes: list[int]
    steps_per_second: list[float]
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch_sizes = [int(b) for b in self.batch_sizes]
        self.steps_per_second = [float(s) for s in self.steps_per_second]
        if not self.batch_sizes:
            raise ValueError("SPSTable.batch_sizes: empty, profile at least one batch size")
        if len(self.batch_sizes) != len(self.steps_per_second):
            raise ValueError(
                f"SPSTable: {len(self.batch_sizes)} batch_sizes but {len(self.steps_per_second)} steps_per_second"
            )
        if self.batch_sizes[0] < 1 or any(b2 <= b1 for b1, b2 in zip(self.batch_sizes, self.batch_sizes[1:])):
            raise ValueError(f"SPSTable.batch_sizes must be strictly increasing and >= 1, got {self.batch_sizes}")
        if any(not (math.isfinite(s) and s > 0) for s in self.steps_per_second):
            raise ValueError(f"SPSTable.steps_per_second must be finite and > 0, got {self.steps_per_second}")

    def sps(self, batch_size: int | float) -> float:
        if batch_size <= 0:
            raise ValueError(f"SPSTable.sps: batch_size must be > 0, got {batch_size}")
        sizes, speeds = self.batch_sizes, self.steps_per_second
        if batch_size <= sizes[0]:
            return speeds[0]
        if batch_size >= sizes[-1]:
            return speeds[-1] * sizes[-1] / batch_size
        return float(np.interp(batch_size, sizes, speeds))

    __call__ = sps

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": SPS_TABLE_FORMAT_VERSION,
            "batch_sizes": self.batch_sizes,
            "steps_per_second": self.steps_per_second,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "SPSTable") -> "SPSTable":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object")
        if data.get("format_version") != SPS_TABLE_FORMAT_VERSION:
            found = data.get("format_version")
            raise ValueError(f"{source}: format_version {found!r}, expected {SPS_TABLE_FORMAT_VERSION}")
        for name in ("batch_sizes", "steps_per_second", "fingerprint"):
            if name not in data:
                raise ValueError(f"{source}: missing field {name!r}")
        try:
            return cls(data["batch_sizes"], data["steps_per_second"], dict(data["fingerprint"]))
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    def save(self, path: str | Path) -> None:
        atomic_write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> "SPSTable":
        return cls.from_json(read_json(path), source=str(path))


def environment_fingerprint(target_id: str, dtype: str, device: str = "cpu") -> dict[str, Any]:
    """Everything that changes the SPS curve: target, dtype, device name, torch version, host/CPU."""
    import torch

    device_name = cpu_model()
    if device.startswith("cuda") and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(torch.device(device))
    return {
        "target_id": str(target_id),
        "dtype": str(dtype),
        "device": device,
        "device_name": device_name,
        "torch_version": torch.__version__,
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def profile_sps(
    forward_fn: Callable[[int], None],
    batch_sizes: Sequence[int],
    warmup: int = 2,
    repeats: int = 5,
    fingerprint: dict[str, Any] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> SPSTable:
    """Time ``forward_fn(B)`` (one verification step over B tokens) and return 1 / median time.

    ``forward_fn`` must finish its work before returning (e.g. call ``torch.cuda.synchronize()``
    on GPU) so the wall clock measures the real step time.
    """
    sizes = sorted({int(b) for b in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"profile_sps: batch_sizes must be a non-empty list of ints >= 1, got {list(batch_sizes)}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"profile_sps: need warmup >= 0 and repeats >= 1, got warmup={warmup}, repeats={repeats}")
    speeds = []
    for batch_size in sizes:
        for _ in range(warmup):
            forward_fn(batch_size)
        times = []
        for _ in range(repeats):
            start = clock()
            forward_fn(batch_size)
            times.append(clock() - start)
        median = statistics.median(times)
        if median <= 0:
            raise ValueError(f"profile_sps: forward_fn({batch_size}) took {median} s; the clock cannot resolve it")
        speeds.append(1.0 / median)
    return SPSTable(sizes, speeds, dict(fingerprint or {}))


def load_or_profile(
    path: str | Path,
    fingerprint: dict[str, Any],
    forward_fn: Callable[[int], None],
    batch_sizes: Sequence[int],
    warmup: int = 2,
    repeats: int = 5,
) -> SPSTable:
    """Reuse the table at ``path`` if it was profiled with the same fingerprint and batch sizes;
    otherwise profile again and overwrite it. A malformed file raises ValueError (not silently
    replaced, so a user-edited table is never lost)."""
    path = Path(path)
    wanted_sizes = sorted({int(b) for b in batch_sizes})
    # Compare in JSON form: tuples become lists and keys strings once the table is saved.
    wanted_fingerprint = json.loads(json.dumps(fingerprint, default=str))
    if path.exists():
        table = SPSTable.load(path)
        if table.fingerprint == wanted_fingerprint and table.batch_sizes == wanted_sizes:
            return table
    table = profile_sps(forward_fn, wanted_sizes, warmup=warmup, repeats=repeats, fingerprint=wanted_fingerprint)
    table.save(path)
    return table


# ---------------------------------------------------------------------------------------------
# Verification lengths
# ---------------------------------------------------------------------------------------------


def _confidence_matrix(confidence_RK: Any) -> np.ndarray:
    if hasattr(confidence_RK, "detach"):
        confidence_RK = confidence_RK.detach().cpu().double().numpy()
    conf_RK = np.asarray(confidence_RK, dtype=np.float64)
    if conf_RK.ndim != 2:
        raise ValueError(f"confidence_RK must be 2-D [requests, positions], got shape {conf_RK.shape}")
    if not np.all(np.isfinite(conf_RK)) or conf_RK.size and (conf_RK.min() < 0.0 or conf_RK.max() > 1.0):
        raise ValueError("confidence_RK: conditional confidences must be finite and lie in [0, 1]")
    return conf_RK


def _max_lengths(max_lengths_R: Sequence[int] | None, num_requests: int, num_positions: int) -> np.ndarray:
    if max_lengths_R is None:
        return np.full(num_requests, num_positions, dtype=np.int64)
    limits_R = np.asarray([int(m) for m in max_lengths_R], dtype=np.int64)
    if limits_R.shape != (num_requests,):
        raise ValueError(f"max_lengths_R has {limits_R.size} entries for {num_requests} requests")
    if limits_R.size and (limits_R.min() < 0 or limits_R.max() > num_positions):
        raise ValueError(f"max_lengths_R must lie in [0, {num_positions}], got {limits_R.tolist()}")
    return limits_R


def _sps_fn(sps: SPSTable | Callable[[int], float]) -> Callable[[int], float]:
    return sps.sps if isinstance(sps, SPSTable) else sps


def _sorted_candidates(confidence_RK, max_lengths_R):
    """Prefix survivals and candidates (r, j) with a > 0, sorted by a descending.

    Ties keep row-major order (request r, then position j ascending) via a stable sort, so a
    position never precedes an earlier position of the same request (a_{r,j} <= a_{r,j-1}).
    """
    conf_RK = _confidence_matrix(confidence_RK)
    num_requests, num_positions = conf_RK.shape
    limits_R = _max_lengths(max_lengths_R, num_requests, num_positions)
    survival_RK = np.cumprod(conf_RK, axis=1)
    allowed_RK = np.arange(num_positions)[None, :] < limits_R[:, None]
    flat = np.flatnonzero((survival_RK > 0) & allowed_RK)
    order = np.argsort(-survival_RK.reshape(-1)[flat], kind="stable")
    candidates = [(int(i // num_positions), int(i % num_positions) + 1) for i in flat[order]]
    return survival_RK, candidates


def _greedy_admission(confidence_RK, sps, max_lengths_R, early_stop: bool) -> list[int]:
    sps_of = _sps_fn(sps)
    survival_RK, candidates = _sorted_candidates(confidence_RK, max_lengths_R)
    num_requests = survival_RK.shape[0]
    lengths = [0] * num_requests
    best_lengths = [0] * num_requests
    batch_size = num_requests
    expected_accepts = float(num_requests)  # each request yields at least its bonus/correction token
    best_throughput = expected_accepts * sps_of(batch_size)
    for request, position in candidates:
        lengths[request] = position
        batch_size += 1
        expected_accepts += survival_RK[request, position - 1]
        throughput = expected_accepts * sps_of(batch_size)
        if throughput > best_throughput:
            best_throughput = throughput
            best_lengths = list(lengths)
        elif early_stop:
            break  # never evaluate candidates whose survival depends on not-yet-admitted tokens
    return best_lengths


def schedule_prefix_lengths(
    confidence_RK: Any,
    sps: SPSTable | Callable[[int], float],
    max_lengths_R: Sequence[int] | None = None,
) -> list[int]:
    """Algorithm 1 of the paper (hardware-aware prefix scheduler with early stop).

    ``confidence_RK`` holds *conditional* confidences c_{r,k} (calibrated); ``max_lengths_R``
    caps request r's length (e.g. a shorter proposal). Starts from B = R, tau* = R,
    Theta_best = R * SPS(R); admits candidates in sorted order and stops at the first admission
    whose Theta = tau* x SPS(B) is not strictly larger than Theta_best. Returns l*_r per request.
    """
    return _greedy_admission(confidence_RK, sps, max_lengths_R, early_stop=True)


def retrospective_prefix_lengths(
    confidence_RK: Any,
    sps: SPSTable | Callable[[int], float],
    max_lengths_R: Sequence[int] | None = None,
) -> list[int]:
    """UNSAFE reference: Algorithm 1 WITHOUT the early stop (best prefix of the whole sorted list).

    With a Markov confidence head, c_{r,k+1} depends on the sampled x_{r,k}, so this search lets
    x_{r,k}'s realisation decide whether x_{r,k} is verified and biases the output distribution
    (paper appendix A). Kept only to demonstrate that bias in tests; do not use for decoding
    unless the confidences come from an earlier step (paper §5.2's asynchronous variant).
    Ties in Theta keep the earliest (shortest) prefix.
    """
    return _greedy_admission(confidence_RK, sps, max_lengths_R, early_stop=False)


def static_threshold_lengths(
    confidence_RK: Any,
    threshold: float,
    cumulative: bool = False,
    max_lengths_R: Sequence[int] | None = None,
) -> list[int]:
    """Static mode: l_r = number of leading positions whose confidence is >= ``threshold``.

    By default the per-position conditional c_k is compared (the paper truncates at the first
    position whose confidence falls below the threshold); ``cumulative=True`` compares the prefix
    survival prod_{i<=k} c_i. Threshold 0 is fixed-length verification.
    """
    if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 1.0):
        raise ValueError(f"threshold must be a number in [0, 1], got {threshold!r}")
    conf_RK = _confidence_matrix(confidence_RK)
    num_requests, num_positions = conf_RK.shape
    limits_R = _max_lengths(max_lengths_R, num_requests, num_positions)
    score_RK = np.cumprod(conf_RK, axis=1) if cumulative else conf_RK
    below_RK = score_RK < threshold
    # Index of the first position below the threshold, or K if none.
    first_below_R = np.where(below_RK.any(axis=1), below_RK.argmax(axis=1), num_positions)
    return [int(v) for v in np.minimum(first_below_R, limits_R)]


def fixed_lengths(num_requests: int, num_positions: int) -> list[int]:
    """Verify every draft position of every request."""
    if num_requests < 0 or num_positions < 0:
        raise ValueError(f"fixed_lengths: need non-negative sizes, got R={num_requests}, K={num_positions}")
    return [int(num_positions)] * int(num_requests)


@dataclass
class VerificationPolicy:
    """How the decoding loop picks verification lengths; ``lengths`` is the single entry point.

    mode: "fixed" | "threshold" | "scheduler". ``threshold``/``cumulative_threshold`` apply to
    "threshold"; "scheduler" needs an SPS table: passed to ``lengths(sps=...)`` or loaded once
    from ``sps_table_path``.
    """

    mode: str = "fixed"
    threshold: float = 0.5
    cumulative_threshold: bool = False
    sps_table_path: str | None = None
    _sps_table: SPSTable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.mode not in POLICY_MODES:
            raise ValueError(f"VerificationPolicy.mode must be one of {POLICY_MODES}, got {self.mode!r}")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(f"VerificationPolicy.threshold must lie in [0, 1], got {self.threshold}")

    def lengths(
        self,
        confidence_RK: Any,
        max_lengths_R: Sequence[int] | None = None,
        sps: SPSTable | Callable[[int], float] | None = None,
    ) -> list[int]:
        conf_RK = _confidence_matrix(confidence_RK)
        num_requests, num_positions = conf_RK.shape
        if self.mode == "fixed":
            return [int(v) for v in _max_lengths(max_lengths_R, num_requests, num_positions)]
        if self.mode == "threshold":
            return static_threshold_lengths(conf_RK, self.threshold, self.cumulative_threshold, max_lengths_R)
        if sps is None:
            if self._sps_table is None:
                if self.sps_table_path is None:
                    raise ValueError("VerificationPolicy(mode='scheduler') needs sps=... or sps_table_path")
                self._sps_table = SPSTable.load(self.sps_table_path)
            sps = self._sps_table
        return schedule_prefix_lengths(conf_RK, sps, max_lengths_R)
