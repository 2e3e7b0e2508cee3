"""The standalone drafter kind: a separate causal LM (wrapped, or built and distilled from the cache)."""

from __future__ import annotations

from collections.abc import Sequence

from deepspec.cache.format import CONTENT_HIDDEN, CONTENT_TOP_K
from deepspec.drafters.chain.spec import make_chain_batcher
from deepspec.drafters.spec import Capabilities, DrafterSpec, layers_in_cache
from deepspec.drafters.standalone.config import StandaloneConfig, StandaloneLoss, StandaloneParams
from deepspec.drafters.standalone.model import StandaloneDrafter
from deepspec.drafters.standalone.objective import standalone_objective
from deepspec.drafters.standalone.proposer import standalone_batch_proposer, standalone_proposer


def select_cache_layers(cache_layer_ids: Sequence[int], requested: Sequence[int] | None) -> list[int]:
    """No feature layers: the drafter reads tokens only (and the target's next-token law to distil from)."""
    if requested:
        raise ValueError(f"drafter.target_layer_ids={list(requested)}: a standalone drafter reads no target features")
    return layers_in_cache([], cache_layer_ids)


SPEC = DrafterSpec(
    kind="standalone",
    config_class=StandaloneConfig,
    model_class=StandaloneDrafter,
    params_class=StandaloneParams,
    loss_class=StandaloneLoss,
    make_batcher=make_chain_batcher,  # packed sequences; no features are read (feature_layer_ids = [])
    objective=standalone_objective,
    proposer=standalone_proposer,
    batch_proposer=standalone_batch_proposer,
    # Its confidence is its own probability of the proposed token; STS labels come from real rollouts.
    capabilities=lambda config: Capabilities(num_positions=int(config.num_speculative_tokens), confidence_head=True,
                                             confidence_labels=("empirical",)),
    default_feature_layers=lambda num_layers: [],
    select_cache_layers=select_cache_layers,
    export_layouts={"hf": "deepspec", "causal_lm": "causal_lm"},
    cache_contents=(CONTENT_HIDDEN, CONTENT_TOP_K),
)
