"""A drafter's proposers for the decoding loops, built by its spec (no branching on kinds here).

`make_proposer(drafter, target_model=None, **opts)` gives the batch-1 `Proposer` (deepspec.decoding.loop),
`make_batch_proposer(drafter, target_model=None, **opts)` the batched `BatchProposer`
(deepspec.decoding.batched). `target_model` (optional) is attached as the drafter's frozen embedding/LM
head source if it has none yet. `autocast="bf16"` runs the drafter under bf16 autocast. Batch-1 options:
`num_draft_tokens` (drafts per round; block drafters: at most their block size, the block is truncated; chain
drafters: chain length, default their trained depth). Both loops: `with_prompt_lookup` (prompt lookup or the
drafter, chosen per round; deepspec.decoding.combined).
"""

from __future__ import annotations

import torch

from deepspec.drafters.spec import spec_of

AUTOCAST_DTYPES = {None: None, "none": None, "bf16": torch.bfloat16}


class AutocastProposer:
    """A proposer whose every call runs under autocast (bf16 matmuls in the drafter, e.g. on CPUs with AMX).
    Only the drafter is affected: the target verifies in its own dtype and the proposal carries the distribution its
    tokens were drawn from, so decoding stays lossless (greedy: token for token; tests/decoding)."""

    def __init__(self, inner, dtype: torch.dtype, device_type: str):
        self._inner, self._dtype, self._device_type = inner, dtype, device_type

    def __getattr__(self, name):
        value = getattr(self._inner, name)
        if not callable(value):
            return value

        def under_autocast(*args, **kwargs):
            with torch.autocast(self._device_type, dtype=self._dtype):
                return value(*args, **kwargs)

        return under_autocast


def _ready(drafter, target_model):
    spec = spec_of(drafter)
    if target_model is not None and getattr(drafter, "_target_parts", None) is None:
        drafter.attach_target(target_model)
    drafter.eval()
    return spec


def _with_autocast(proposer, drafter, autocast: str | None):
    if autocast not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast={autocast!r} must be one of {sorted(k for k in AUTOCAST_DTYPES if k)}")
    dtype = AUTOCAST_DTYPES[autocast]
    if dtype is None:
        return proposer
    return AutocastProposer(proposer, dtype, next(drafter.parameters()).device.type)


def make_proposer(drafter, target_model=None, autocast: str | None = None, with_prompt_lookup: bool = False,
                  **opts):
    """A per-request batch-1 `Proposer` for `drafter` (any registered kind); `autocast="bf16"`: the drafter's
    calls under bf16 autocast (`AutocastProposer`); `with_prompt_lookup`: each round prompt lookup's drafts or the
    drafter's, whichever is expected to keep more (deepspec.decoding.combined; needs a calibrated drafter)."""
    proposer = _with_autocast(_ready(drafter, target_model).proposer(drafter, **opts), drafter, autocast)
    if not with_prompt_lookup:
        return proposer
    from deepspec.decoding.combined import LookupOrDrafterProposer
    from deepspec.decoding.lookup import LookupAcceptance

    table = drafter.config.prompt_lookup_acceptance
    if table is None:
        raise ValueError(f"drafter {drafter.config.drafter_kind!r} has no prompt_lookup_acceptance in its config: "
                         "calibrate it first (`deepspec calibrate --drafter DIR --cache CACHE`)")
    return LookupOrDrafterProposer(proposer, LookupAcceptance.from_dict(table))


def make_batch_proposer(drafter, target_model=None, autocast: str | None = None, with_prompt_lookup: bool = False,
                        **opts):
    """A `BatchProposer` for `drafter`: all rows at once where the kind supports it, else one per request.
    `with_prompt_lookup`: the batch-1 combined proposer (`make_proposer`) once per request, the drafter called
    row by row (the choice and prompt lookup's history are per request)."""
    if with_prompt_lookup:
        from deepspec.decoding.proposers import PerRequestBatchProposer

        return PerRequestBatchProposer(lambda: make_proposer(drafter, target_model, autocast, True, **opts))
    return _with_autocast(_ready(drafter, target_model).batch_proposer(drafter, **opts), drafter, autocast)
