"""The DSpark drafter kind."""

from __future__ import annotations

from collections.abc import Iterable

from deepspec.drafters.block import spec as block
from deepspec.drafters.draft_vocab import prepare_draft_vocabulary
from deepspec.drafters.dspark.bigram_init import init_markov_from_bigrams
from deepspec.drafters.dspark.config import DSparkConfig, DSparkLoss, DSparkParams
from deepspec.drafters.dspark.model import DSparkDrafter
from deepspec.drafters.dspark.objective import dspark_training_objective
from deepspec.drafters.spec import DrafterSpec


def prepare_dspark(drafter, samples: Iterable, tokenizer) -> None:
    """The draft vocabulary first (with `draft_vocab_size`), then the Markov head's bigram start over its rows."""
    samples = list(samples)  # read twice
    prepare_draft_vocabulary(drafter, samples, tokenizer)
    init_markov_from_bigrams(drafter, samples, tokenizer)


SPEC = DrafterSpec(
    kind="dspark",
    config_class=DSparkConfig,
    model_class=DSparkDrafter,
    params_class=DSparkParams,
    loss_class=DSparkLoss,
    make_batcher=block.make_block_batcher,
    objective=dspark_training_objective,
    proposer=block.block_proposer,
    batch_proposer=block.block_batch_proposer,
    capabilities=lambda config: block.block_capabilities(config, confidence_head=bool(config.confidence_head)),
    default_feature_layers=block.default_feature_layers,
    select_cache_layers=block.select_cache_layers,
    export_layouts={"hf": "deepspec", "sglang": "dspark", "vllm": "dspark"},
    prepare_for_training=prepare_dspark,
)
