"""What the block-drafter specs (DFlash, DSpark) share: layer choice, capabilities, proposers, batcher."""

from __future__ import annotations

from collections.abc import Sequence

from deepspec.decoding.proposers import SingleRowProposer
from deepspec.drafters.block.batching import BlockBatcher
from deepspec.drafters.block.proposer import BlockDrafterBatchProposer
from deepspec.drafters.spec import Capabilities, layers_in_cache
from deepspec.targets.layers import DEFAULT_NUM_FEATURE_LAYERS, spread_layer_ids

NUM_FEATURE_LAYERS = DEFAULT_NUM_FEATURE_LAYERS  # the paper's 5 points from 1 to L-3 (36 -> [1, 9, 17, 25, 33])


def default_feature_layers(num_target_layers: int) -> list[int]:
    return spread_layer_ids(num_target_layers, NUM_FEATURE_LAYERS)


def select_cache_layers(cache_layer_ids: Sequence[int], requested: Sequence[int] | None) -> list[int]:
    """Every cached layer, in the cache's order: the block context fuses all of them."""
    ids = layers_in_cache(list(cache_layer_ids) if requested is None else requested, cache_layer_ids)
    if not ids:
        raise ValueError("a block drafter reads at least one target feature layer, but the cache stores none "
                         "(build one with cache.layer_ids set, or the default spread)")
    if ids != [int(i) for i in cache_layer_ids]:
        raise ValueError(f"drafter.target_layer_ids={ids} must equal the cache's layer ids {list(cache_layer_ids)} "
                         f"for a block drafter (the block context uses every cached layer)")
    return ids


def block_capabilities(config, confidence_head: bool = False) -> Capabilities:
    # A reduced vocabulary computes the target's probabilities of its tokens from the log-normaliser.
    return Capabilities(num_positions=int(config.num_drafts), confidence_head=confidence_head, draft_vocab=True,
                        block_convention=config.block_convention,
                        needs_target_lse=config.draft_vocab_size is not None)


def make_block_batcher(config, settings) -> BlockBatcher:
    return BlockBatcher(config, settings)


def block_proposer(drafter, num_draft_tokens: int | None = None) -> SingleRowProposer:
    """The batch-1 proposer: the batched one with one row."""
    batch = BlockDrafterBatchProposer(drafter, num_draft_tokens)
    return SingleRowProposer(batch, batch.max_tokens)


def block_batch_proposer(drafter, num_draft_tokens: int | None = None) -> BlockDrafterBatchProposer:
    return BlockDrafterBatchProposer(drafter, num_draft_tokens)
