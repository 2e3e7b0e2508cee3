"""A drafter's proposers for the decoding loops, built by its spec (no branching on kinds here).

`make_proposer(drafter, target_model=None, **opts)` gives the batch-1 `Proposer` (deepspec.decoding.loop),
`make_batch_proposer(drafter, target_model=None, **opts)` the batched `BatchProposer`
(deepspec.decoding.batched). `target_model` (optional) is attached as the drafter's frozen embedding/LM
head source if it has none yet. Batch-1 option: `num_draft_tokens` (drafts per round; block drafters: at
most their block size, the block is truncated; chain drafters: chain length, default their trained depth).
"""

from __future__ import annotations

from deepspec.drafters.spec import spec_of


def _ready(drafter, target_model):
    spec = spec_of(drafter)
    if target_model is not None and getattr(drafter, "_target_parts", None) is None:
        drafter.attach_target(target_model)
    drafter.eval()
    return spec


def make_proposer(drafter, target_model=None, **opts):
    """A per-request batch-1 `Proposer` for `drafter` (any registered kind)."""
    return _ready(drafter, target_model).proposer(drafter, **opts)


def make_batch_proposer(drafter, target_model=None, **opts):
    """A `BatchProposer` for `drafter`: all rows at once where the kind supports it, else one per request."""
    return _ready(drafter, target_model).batch_proposer(drafter, **opts)
