"""A new drafter kind is one folder + its conf/drafter/<kind>.yaml + its test: this file is all three.

It defines a toy chain drafter entirely here (nothing under deepspec/ knows it), registers its spec with
`register_drafter_spec`, composes `drafter=toy` from its own YAML (tests/drafters/toy_conf, added to Hydra's
search path), trains it two steps with the real training loop (DeepSpeed, the cache, checkpoints) and decodes
with the reloaded checkpoint: greedy output equals the target's own greedy decoding, in the batch-1 and the
batched loop. docs/ADDING_A_DRAFTER.md walks through the same steps.

The toy: from the target's final hidden state h_t at row t, `x[t+2] ~ softmax(LMHead(norm(W h_t)))` (one
linear map W, the frozen shared LM head); further drafts re-apply W to its own output.

Shape legend: B = batch, T = tokens, N = new rows, H = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import pytest
import torch
from torch import nn

from deepspec.decoding.proposal import DraftProposal
from deepspec.drafters.base import DrafterConfig, DrafterModel
from deepspec.drafters.chain.batching import AutoregressiveBatch
from deepspec.drafters.chain.objective import check_chain_batch, merge_step_terms, step_terms
from deepspec.drafters.chain.proposer import target_final_hidden
from deepspec.drafters.chain.spec import chain_proposers, make_chain_batcher
from deepspec.drafters.params import DrafterParams, LossParams
from deepspec.drafters.spec import (
    Capabilities,
    DrafterSpec,
    layers_in_cache,
    register_drafter_spec,
    unregister_drafter_spec,
)
from deepspec.losses.objectives import StepResult, mtp_objective

CONF = Path(__file__).resolve().parent / "toy_conf"


# -- the kind's config, params and loss ------------------------------------------------------------
class ToyConfig(DrafterConfig):
    model_type = "deepspec_toy"
    drafter_kind = "toy"

    def __init__(self, num_draft_tokens: int = 2, **kwargs):
        self.num_draft_tokens = int(num_draft_tokens)
        super().__init__(**kwargs)
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} must be >= 1")


@dataclass
class ToyParams(DrafterParams):
    kind: str = "toy"
    target_layer_ids: Optional[List[int]] = field(default_factory=list)  # reads the final hidden state only
    num_draft_tokens: int = 2


@dataclass
class ToyLoss(LossParams):
    weight: float = 1.0


# -- the model ---------------------------------------------------------------------------------------
@dataclass
class ToyState:
    num_rows: int = 0


class ToyDrafter(DrafterModel):
    config_class = ToyConfig

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm = config.family.make_norm(hidden, 1e-6)
        self.post_init()

    def step(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_XH.to(self.proj.weight.dtype))

    def logits(self, hidden_XH: torch.Tensor) -> torch.Tensor:
        return self.target_parts.logits(self.norm(hidden_XH))

    def new_decode_state(self) -> ToyState:
        return ToyState()

    @torch.no_grad()
    def propose(self, state: ToyState, final_hidden_BNH, next_token_ids_BN, sampler, num_draft=None) -> DraftProposal:
        state.num_rows += final_hidden_BNH.shape[1]
        hidden_BH = self.step(final_hidden_BNH[:, -1])
        tokens, probs = [], []
        for k in range(num_draft or self.config.num_draft_tokens):
            token_B, probs_BV = sampler(self.logits(hidden_BH), k)
            tokens.append(token_B)
            probs.append(probs_BV)
            hidden_BH = self.step(hidden_BH)
        return DraftProposal(torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1))


def toy_objective(drafter, batch: AutoregressiveBatch, loss: ToyLoss, with_metrics: bool = False) -> StepResult:
    check_chain_batch(drafter, batch)
    hidden_BTH = drafter.step(batch.final_hidden_BTH)
    head_VH = drafter.target_parts.lm_head_weight
    terms, rows_N = step_terms(batch, drafter.norm(hidden_BTH), head_VH, head_VH, 2, None, None, loss.terms_options())
    merged, position_index_N, block_index_N = merge_step_terms([terms], [rows_N])
    return StepResult(mtp_objective([terms], module_weight=loss.weight), merged, position_index_N, block_index_N)


proposer, batch_proposer = chain_proposers(target_final_hidden, lambda config: config.num_draft_tokens)

TOY_SPEC = DrafterSpec(
    kind="toy", config_class=ToyConfig, model_class=ToyDrafter, params_class=ToyParams, loss_class=ToyLoss,
    make_batcher=make_chain_batcher, objective=toy_objective, proposer=proposer, batch_proposer=batch_proposer,
    capabilities=lambda config: Capabilities(num_positions=1),
    default_feature_layers=lambda num_layers: [],
    select_cache_layers=lambda cached, requested: layers_in_cache([] if requested is None else requested, cached),
    export_layouts={"hf": "deepspec"},
)


# -- the test ------------------------------------------------------------------------------------------
@pytest.fixture
def toy_kind():
    from deepspec.training.config import register_configs

    register_drafter_spec(TOY_SPEC)
    register_configs()  # the new kind's params/loss dataclasses join Hydra's ConfigStore
    yield TOY_SPEC
    unregister_drafter_spec("toy")


@pytest.fixture(scope="module")
def cache(tiny_llama, tmp_path_factory):
    from deepspec.cache import BuildJob, build_cache
    from deepspec.cache.config import CacheSchema
    from deepspec.data.sources import Conversation

    convs = [Conversation(id=f"c{i}", messages=[{"role": "user", "content": "Tell me " + "more " * (i % 4 + 1)},
                                               {"role": "assistant",
                                                "content": "Here it is " + "again " * (i % 5 + 2)}],
                          source="test", line=i) for i in range(10)]
    out = tmp_path_factory.mktemp("toy_cache")
    build_cache({"train": convs[:8], "validation": convs[8:]}, tiny_llama,
                BuildJob(CacheSchema(out_dir=str(out), layer_ids=[0, 1, 2], max_length=48, batch_size=4,
                                     storage_dtype="fp32", progress=False)))
    return out


def test_a_kind_registered_from_tests_trains_and_decodes_losslessly(toy_kind, cache, tiny_llama, tmp_path):
    from deepspec.decoding.batched import BatchRequest, ServingSettings, batched_speculative_generate
    from deepspec.decoding.loop import autoregressive_generate, speculative_generate
    from deepspec.decoding.sampling import SamplingParams
    from deepspec.decoding.verifier import TargetVerifier
    from deepspec.drafters.build import load_drafter
    from deepspec.drafters.proposers import make_batch_proposer, make_proposer
    from deepspec.training import run
    from deepspec.training.config import compose_train_config, resolve_config
    from deepspec.training.log import read_metrics

    overrides = [f"hydra.searchpath=[file://{CONF}]", "target=tiny-random-llama", "drafter=toy",
                 "drafter.num_draft_tokens=3", f"data.cache_dir={cache}", f"trainer.out_dir={tmp_path}",
                 "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                 "trainer.log_every=1", "trainer.val_every=100", "trainer.save_every=100", "trainer.progress_bar=false",
                 "data.max_tokens_per_row=64", "optim.lr=1e-2", "optim.warmup_fraction=0.0", "logger=jsonl"]
    cfg = compose_train_config(overrides)
    assert isinstance(resolve_config(cfg).drafter, ToyParams)  # the kind's own typed params
    with pytest.raises(ValueError, match="bogus_key"):
        resolve_config(compose_train_config([*overrides, "+drafter.bogus_key=3"]))

    summary = run(cfg)
    assert summary["step"] == 2 and len(read_metrics(tmp_path, "train")) == 2
    assert summary["validation"]["num_samples"] == 2  # validated with the kind's objective and metrics
    drafter = load_drafter(Path(summary["checkpoint"]) / "drafter", tiny_llama).eval()
    assert isinstance(drafter, ToyDrafter) and drafter.config.num_draft_tokens == 3
    assert not torch.equal(drafter.proj.weight, ToyDrafter(drafter.config).proj.weight)  # it was trained

    prompts = [[1, 5, 77, 912, 33], [7, 8, 9, 10, 11, 12], [99, 3, 4]]
    greedy = SamplingParams(temperature=0.0)
    for prompt in prompts:
        reference = autoregressive_generate(TargetVerifier(tiny_llama.model, []), prompt, 12, greedy).token_ids
        result = speculative_generate(TargetVerifier(tiny_llama.model, []), make_proposer(drafter), prompt, 12, greedy)
        assert result.token_ids == reference and all(r.proposed <= 3 for r in result.rounds)
    batched = batched_speculative_generate(tiny_llama.model, make_batch_proposer(drafter),
                                           [BatchRequest(p, 12) for p in prompts], greedy,
                                           settings=ServingSettings(max_concurrency=2))
    for prompt, request in zip(prompts, batched.requests):
        assert request.token_ids == autoregressive_generate(TargetVerifier(tiny_llama.model, []), prompt, 12,
                                                            greedy).token_ids
