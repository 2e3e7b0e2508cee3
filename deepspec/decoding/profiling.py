"""Profiling the target for the prefix scheduler: the steps-per-second table SPS(B) of batched verification.

`profile_target_sps` times one verification forward of B tokens spread over R rows (as the batched loop
spreads them, `split_tokens_over_rows`) on top of a KV cache of `context_len` tokens per row, and stores the
table with the environment fingerprint (`deepspec.decoding.scheduler.load_or_profile` reuses it while nothing
that changes the curve differs).

Shape legend: R = rows, L = slots per row, H = hidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from deepspec.decoding.batch_cache import BatchedTargetCache, prefill_requests
from deepspec.decoding.loop import synchronize
from deepspec.decoding.scheduler import SPSTable, environment_fingerprint, load_or_profile
from deepspec.decoding.verifier import target_logits
from deepspec.targets.family import text_config


def split_tokens_over_rows(num_tokens: int, num_rows: int) -> list[int]:
    """How the batched loop spreads B verified tokens over R rows: every row >= 1, as even as possible."""
    if num_tokens < num_rows:
        raise ValueError(f"cannot spread {num_tokens} tokens over {num_rows} rows (each row verifies >= 1)")
    base, extra = divmod(num_tokens, num_rows)
    return [base + (1 if r < extra else 0) for r in range(num_rows)]


def make_verification_forward_fn(model: PreTrainedModel, num_rows: int, context_len: int, seed: int = 0):
    """`forward_fn(B)` for `profile_sps`: one verification forward of B tokens over `num_rows` rows
    (padded to the longest row, as the loop does) on top of a KV cache of `context_len` tokens per row."""
    device = next(model.parameters()).device
    vocab = text_config(model.config).vocab_size
    generator = torch.Generator(device="cpu").manual_seed(seed)
    context_RS = torch.randint(0, vocab, (num_rows, context_len), generator=generator).to(device)
    target = BatchedTargetCache(model)
    target.add_rows(prefill_requests(model, list(context_RS), []), list(range(num_rows)))

    @torch.no_grad()
    def forward_fn(num_tokens: int) -> None:
        per_row = split_tokens_over_rows(num_tokens, num_rows)
        length = max(per_row)
        ids_RL = torch.randint(0, vocab, (num_rows, length), generator=generator).to(device)
        real_RL = torch.arange(length, device=device)[None] < torch.tensor(per_row, device=device)[:, None]
        hidden_RLH, _ = target.forward(ids_RL, real_RL, [])
        target_logits(model, hidden_RLH)  # the LM head is part of every verification step
        synchronize(device)
        target.drop_last(length)  # every call sees the same context length

    return forward_fn


def profile_target_sps(model: PreTrainedModel, target_id: str, out_dir: str | Path, num_rows: int, max_block: int,
                       context_len: int = 256, batch_sizes: Sequence[int] | None = None, repeats: int = 5,
                       warmup: int = 2) -> SPSTable:
    """Profile (or reuse) the target's SPS(B) table for `num_rows` concurrent requests.

    Stored as `sps_R{num_rows}_ctx{context_len}.json` under `out_dir` with the environment
    fingerprint (+ rows, context length); `load_or_profile` re-profiles when anything differs.
    Default batch sizes: R .. R * (1 + max_block), about 8 points.
    """
    if num_rows < 1 or max_block < 0:
        raise ValueError(f"profile_target_sps: need num_rows >= 1 and max_block >= 0, got {num_rows}, {max_block}")
    device = next(model.parameters()).device
    largest = num_rows * (1 + max_block)
    if batch_sizes is None:
        step = max(1, math.ceil((largest - num_rows) / 7))
        batch_sizes = sorted(set(range(num_rows, largest + 1, step)) | {largest})
    fingerprint = environment_fingerprint(target_id, str(next(model.parameters()).dtype), str(device))
    fingerprint.update({"num_rows": num_rows, "context_len": context_len})
    path = Path(out_dir) / f"sps_R{num_rows}_ctx{context_len}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    forward_fn = _LazyForward(lambda: make_verification_forward_fn(model, num_rows, context_len))
    return load_or_profile(path, fingerprint, forward_fn, batch_sizes, warmup=warmup, repeats=repeats)


class _LazyForward:
    """Builds the profiling context only if `load_or_profile` actually has to profile."""

    def __init__(self, build: Callable[[], Callable[[int], None]]):
        self._build, self._fn = build, None

    def __call__(self, num_tokens: int) -> None:
        if self._fn is None:
            self._fn = self._build()
        self._fn(num_tokens)
