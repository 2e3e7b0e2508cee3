"""The DFlash drafter kind."""

from __future__ import annotations

from deepspec.drafters.block import spec as block
from deepspec.drafters.dflash.config import DFlashConfig, DFlashLoss, DFlashParams
from deepspec.drafters.dflash.model import DFlashDrafter
from deepspec.drafters.dflash.objective import dflash_training_objective
from deepspec.drafters.draft_vocab import prepare_draft_vocabulary
from deepspec.drafters.spec import DrafterSpec

SPEC = DrafterSpec(
    kind="dflash",
    config_class=DFlashConfig,
    model_class=DFlashDrafter,
    params_class=DFlashParams,
    loss_class=DFlashLoss,
    make_batcher=block.make_block_batcher,
    objective=dflash_training_objective,
    proposer=block.block_proposer,
    batch_proposer=block.block_batch_proposer,
    capabilities=block.block_capabilities,
    default_feature_layers=block.default_feature_layers,
    select_cache_layers=block.select_cache_layers,
    export_layouts={"hf": "deepspec", "sglang": "dflash", "vllm": "dflash"},
    prepare_for_training=prepare_draft_vocabulary,
)
