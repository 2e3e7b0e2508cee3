"""The MTP drafter kind."""

from __future__ import annotations

from collections.abc import Sequence

from deepspec.drafters.chain.proposer import target_final_hidden
from deepspec.drafters.chain.spec import chain_proposers, make_chain_batcher
from deepspec.drafters.mtp.config import MTPConfig, MTPLoss, MTPParams
from deepspec.drafters.mtp.model import MTPDrafter
from deepspec.drafters.mtp.objective import mtp_training_objective
from deepspec.drafters.spec import Capabilities, DrafterSpec, layers_in_cache


def select_cache_layers(cache_layer_ids: Sequence[int], requested: Sequence[int] | None) -> list[int]:
    """MTP reads only the target's final hidden state: no feature layers unless explicitly asked."""
    return layers_in_cache([] if requested is None else requested, cache_layer_ids)


proposer, batch_proposer = chain_proposers(target_final_hidden, lambda config: config.num_mtp_modules)

SPEC = DrafterSpec(
    kind="mtp",
    config_class=MTPConfig,
    model_class=MTPDrafter,
    params_class=MTPParams,
    loss_class=MTPLoss,
    make_batcher=make_chain_batcher,
    objective=mtp_training_objective,
    proposer=proposer,
    batch_proposer=batch_proposer,
    capabilities=lambda config: Capabilities(num_positions=int(config.num_mtp_modules)),
    default_feature_layers=lambda num_layers: [],
    select_cache_layers=select_cache_layers,
    export_layouts={"hf": "deepspec", "vllm": "mtp", "nextn": "mtp"},
)
