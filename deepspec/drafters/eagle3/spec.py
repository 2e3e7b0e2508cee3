"""The Eagle3 drafter kind."""

from __future__ import annotations

from collections.abc import Sequence

from deepspec.drafters.chain.proposer import target_features
from deepspec.drafters.chain.spec import chain_proposers, make_chain_batcher
from deepspec.drafters.draft_vocab import prepare_draft_vocabulary
from deepspec.drafters.eagle3.config import Eagle3Config, Eagle3Loss, Eagle3Params
from deepspec.drafters.eagle3.model import Eagle3Drafter
from deepspec.drafters.eagle3.objective import eagle3_training_objective
from deepspec.drafters.spec import Capabilities, DrafterSpec, layers_in_cache
from deepspec.targets.layers import DEFAULT_NUM_FEATURE_LAYERS, spread_layer_ids


def select_cache_layers(cache_layer_ids: Sequence[int], requested: Sequence[int] | None) -> list[int]:
    """Explicit ids (`drafter.target_layer_ids`, or low/mid/high with `drafter.feature_layers=low_mid_high`),
    else every cached layer: the paper gives every drafter the same feature layers."""
    cached = list(cache_layer_ids)
    return layers_in_cache(cached if requested is None else requested, cached)


proposer, batch_proposer = chain_proposers(target_features, lambda config: config.ttt_steps)

SPEC = DrafterSpec(
    kind="eagle3",
    config_class=Eagle3Config,
    model_class=Eagle3Drafter,
    params_class=Eagle3Params,
    loss_class=Eagle3Loss,
    make_batcher=make_chain_batcher,
    objective=eagle3_training_objective,
    proposer=proposer,
    batch_proposer=batch_proposer,
    capabilities=lambda config: Capabilities(num_positions=int(config.ttt_steps), draft_vocab=True),
    default_feature_layers=lambda num_layers: spread_layer_ids(num_layers, DEFAULT_NUM_FEATURE_LAYERS),
    select_cache_layers=select_cache_layers,
    export_layouts={"hf": "deepspec", "sglang": "eagle3", "vllm": "eagle3"},
    prepare_for_training=prepare_draft_vocabulary,
)
