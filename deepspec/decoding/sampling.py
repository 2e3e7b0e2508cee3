"""Sampling parameters and the logit filters (temperature, top-k, top-p) shared by draft and target.

Speculative decoding is lossless only if the draft probabilities `p_d` and the target probabilities
`p_t` are taken *after the same filtering*: the emitted law equals the filtered target law
`softmax(process_logits(target_logits))`. Both sides therefore call `process_logits` with the same
`SamplingParams`. Filtered entries become -inf (probability exactly 0), never a renormalised dense copy.

Shape legend: X = any number of leading rows (flattened batch/positions), V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepspec.data.sampling import SamplingParams  # the one class; decoding's callers import it from here

# What a drafter calls at each draft position: (logits_BV, draft position) -> (token_B, probs_BV the token was
# drawn from, or None when greedy). `draft_sampler` builds the one implementation.
DraftSampler = Callable[[torch.Tensor, int], tuple[torch.Tensor, "torch.Tensor | None"]]


def process_logits(logits_XV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p; removed entries are set to -inf. Returns float32.

    Greedy params return the logits unchanged (as float32): argmax is invariant to temperature
    and to top-k/top-p, which always keep the most likely token.
    Top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept,
    so the result does not depend on sort stability). Top-p keeps the smallest prefix of the
    sorted distribution whose mass reaches top_p (the most likely token is always kept).
    """
    if logits_XV.ndim < 1:
        raise ValueError(f"logits must have a vocabulary dimension, got shape {tuple(logits_XV.shape)}")
    logits_XV = logits_XV.float()
    if params.is_greedy:
        return logits_XV
    if params.temperature != 1.0:
        logits_XV = logits_XV / params.temperature
    vocab_size = logits_XV.shape[-1]
    neg_inf = torch.tensor(float("-inf"), dtype=logits_XV.dtype, device=logits_XV.device)
    if 0 < params.top_k < vocab_size:
        kth_largest_X1 = torch.topk(logits_XV, params.top_k, dim=-1).values[..., -1:]
        logits_XV = torch.where(logits_XV < kth_largest_X1, neg_inf, logits_XV)
    if params.top_p < 1.0:
        sorted_XV, order_XV = torch.sort(logits_XV, dim=-1, descending=True)
        sorted_probs_XV = torch.softmax(sorted_XV, dim=-1)
        # Mass strictly before each token; a token is kept while that mass is still < top_p.
        mass_before_XV = torch.cumsum(sorted_probs_XV, dim=-1) - sorted_probs_XV
        remove_sorted_XV = mass_before_XV >= params.top_p
        remove_sorted_XV[..., 0] = False
        remove_XV = torch.zeros_like(remove_sorted_XV).scatter_(-1, order_XV, remove_sorted_XV)
        logits_XV = torch.where(remove_XV, neg_inf, logits_XV)
    return logits_XV


def probs_from_logits(logits_XV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is sampled from under `params` (one-hot at the argmax if greedy)."""
    if params.is_greedy:
        argmax_X = logits_XV.argmax(dim=-1, keepdim=True)
        return torch.zeros_like(logits_XV, dtype=torch.float32).scatter_(-1, argmax_X, 1.0)
    return torch.softmax(process_logits(logits_XV, params), dim=-1)


def exponential_race(probs_XV: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One sample per row of `probs_XV` (any non-negative weights): argmax(p / E), E ~ Exp(1) i.i.d.

    An exact sample from p / sum(p) without normalising (the race vLLM's `random_sample` runs).
    """
    noise_XV = torch.empty_like(probs_XV).exponential_(generator=generator)
    # Exp(1) can round to exactly 0; clamp so p / E stays finite.
    return (probs_XV / noise_XV.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


def sample_from_logits(
    logits_XV: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token per row (int64, shape X): argmax if greedy, else an exponential-race sample."""
    if params.is_greedy:
        return logits_XV.argmax(dim=-1)
    return exponential_race(probs_from_logits(logits_XV, params), generator)


def draft_sampler(params: SamplingParams, generator: torch.Generator | None = None) -> DraftSampler:
    """The draft side's sampler: greedy -> (argmax, None); else (race sample, processed probs).

    The returned probabilities are the distribution the token was actually drawn from (after the same
    temperature/top-k/top-p filter the target side applies), which acceptance needs as p_d.
    """
    if params.is_greedy:
        def greedy(logits_BV: torch.Tensor, position: int) -> tuple[torch.Tensor, None]:
            return logits_BV.argmax(dim=-1), None

        return greedy

    def sample(logits_BV: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs_BV = probs_from_logits(logits_BV, params)
        return exponential_race(probs_BV, generator), probs_BV

    return sample
