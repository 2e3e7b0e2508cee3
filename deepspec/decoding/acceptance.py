"""Verification-side acceptance: the backend dispatcher over the PyTorch reference and the Triton kernels.

`accept_draft(..., backend)` is a pure function: "auto" picks Triton on CUDA tensors (or CPU tensors under
TRITON_INTERPRET=1) and the PyTorch reference otherwise, "torch" / "triton" force one. `Acceptance` is the
same step with its backend resolved once, for a decoding run: it says once which backend it uses when
"auto" falls back to the reference. The rule itself and its inputs/result live in acceptance_torch.py
(`AcceptanceNoise`, `AcceptResult`, `accept_draft_torch`), the kernels in acceptance_triton.py.

Shape legend: B = requests, K = max draft tokens per request, K1 = K + 1 target rows, V = vocab.
"""

from __future__ import annotations

import logging
import os

import torch

from deepspec.decoding.acceptance_torch import (  # noqa: F401  (re-exported: the acceptance API in one place)
    RESIDUAL_MASS_EPS,
    AcceptanceNoise,
    AcceptResult,
    accept_draft_torch,
    validate_inputs,
)
from deepspec.decoding.sampling import SamplingParams

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")


def _triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors when its interpreter was enabled at import."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return False
        return True
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        try:
            from deepspec.decoding import acceptance_triton
        except ImportError:
            return False
        return acceptance_triton.INTERPRETED
    return False


def resolve_backend(backend: str, device: torch.device) -> str:
    """"torch" or "triton" for `backend` on tensors of `device` (ValueError for an unknown or unusable one)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend == "auto":
        return "triton" if _triton_usable(device) else "torch"
    if backend == "triton" and not _triton_usable(device):
        raise ValueError(
            f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 set before import; got {device.type} tensors"
        )
    return backend


def accept_draft(
    draft_ids_BK: torch.Tensor,
    draft_probs_BKV: torch.Tensor | None,
    target_logits_BK1V: torch.Tensor,
    num_draft_B: torch.Tensor,
    params: SamplingParams,
    noise: AcceptanceNoise | None,
    backend: str = "auto",
) -> AcceptResult:
    """Accept a prefix of each request's drafts and emit one recovered or bonus token.

    draft_ids_BK: [B, K] int, drafted tokens (entries past num_draft_B[b] are ignored).
    draft_probs_BKV: [B, K, V] the *processed* draft distribution each token was drawn from, or
      None for a deterministic proposal (n-gram, greedy draft): p_d(x) = 1.
    target_logits_BK1V: [B, K+1, V] raw target logits; row j scores the token after
      prefix + draft[:j], row num_draft_B[b] is the bonus row. `params` is applied here.
    num_draft_B: [B] int in [0, K], per-request draft length (ragged verification).
    noise: AcceptanceNoise (unused, may be None, when params.is_greedy).
    backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "torch", "triton".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    validate_inputs(draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise)
    backend = resolve_backend(backend, target_logits_BK1V.device)
    if backend == "torch":
        return accept_draft_torch(draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise)
    from deepspec.decoding.acceptance_triton import accept_draft_triton

    return accept_draft_triton(draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise)


class Acceptance:
    """`accept_draft` with the backend resolved on the first call and kept (one per decoding run).

    When "auto" falls back to the PyTorch reference it says so once (INFO), not at every round.
    """

    def __init__(self, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
        self.backend = backend
        self.resolved: str | None = None

    def __call__(self, draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise) -> AcceptResult:
        if self.resolved is None:
            self.resolved = resolve_backend(self.backend, target_logits_BK1V.device)
            if self.backend == "auto" and self.resolved == "torch":
                logger.info("accept_draft: Triton unavailable for %s tensors; using the PyTorch reference",
                            target_logits_BK1V.device.type)
        return accept_draft(draft_ids_BK, draft_probs_BKV, target_logits_BK1V, num_draft_B, params, noise,
                            backend=self.resolved)
