"""DSpark and DFlash overfit a tiny cache from a tiny random target; a short run on SmolLM2 lowers the loss.

The tiny target has an untied LM head (a tied random one mostly predicts "repeat the last token") and
its final norm scaled up so its distributions are sharp; the cached sequence is its own greedy
continuation, so labels are what the target predicts. `init_from_target` copies the target's final
norm, which sets the drafter's output scale for the shared frozen LM head.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from deepspec.cache.memory import capture_samples
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.build import build_drafter
from deepspec.targets.load import LoadedTarget, load_tokenizer
from deepspec.training.objective import compute_training_loss

LAYER_IDS = [0, 1, 2]


@pytest.fixture(scope="module")
def sharp_target_and_samples():
    torch.manual_seed(1)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    target = LoadedTarget(model=model, tokenizer=load_tokenizer("smollm2-135m"), name="tiny-sharp-llama",
                          path="<memory>", revision="seed1")
    with torch.no_grad():
        model.model.norm.weight.mul_(150.0)
        ids = torch.tensor([[1, 300, 400]])
        for _ in range(17):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert len(set(ids[0].tolist())) > 10  # a non-degenerate continuation
    masks = [[i >= 2 for i in range(ids.shape[1])]]
    return target, capture_samples(target, [ids[0].tolist()], LAYER_IDS, masks)


def _train(drafter, batch, steps: int, lr: float = 1e-2):
    optimizer = torch.optim.Adam(drafter.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    first = last = None
    for _ in range(steps):
        result = compute_training_loss(drafter, batch)
        optimizer.zero_grad()
        result.loss.total.backward()
        optimizer.step()
        schedule.step()
        first = float(result.loss.total.detach()) if first is None else first
        last = result
    valid = last.terms.valid_N
    agreement = float((last.terms.draft_argmax_N == last.terms.target_argmax_N)[valid].float().mean())
    return first, float(last.loss.total.detach()), agreement


@pytest.mark.parametrize("kind,convention", [("dflash", "mask-predicts"), ("dflash", "anchor-predicts"),
                                             ("dspark", "anchor-predicts"), ("dspark", "mask-predicts")])
def test_overfit_tiny_cache(sharp_target_and_samples, kind, convention):
    target, samples = sharp_target_and_samples
    torch.manual_seed(0)
    drafter = build_drafter(kind, target, num_draft_layers=2, markov_rank=32, target_layer_ids=LAYER_IDS,
                            init_from_target=True, block_convention=convention).train()
    batch = BlockBatchBuilder.for_drafter(drafter.config, 64).collate(samples)
    first, last, agreement = _train(drafter, batch, steps=300)
    assert last < 0.1 * first, (first, last)
    assert agreement >= 0.95


@pytest.mark.slow
def test_short_run_on_smollm2_lowers_loss(smollm2):
    tokenizer = smollm2.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog because it wants to reach the river before dark.",
             "Speculative decoding drafts several tokens cheaply and lets the target verify them in one pass."]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    layer_ids = [1, 9, 17]
    samples = capture_samples(smollm2, ids, layer_ids)
    torch.manual_seed(0)
    drafter = build_drafter("dspark", smollm2, num_draft_layers=1, markov_rank=64, target_layer_ids=layer_ids,
                            init_from_target=True).train()
    batch = BlockBatchBuilder.for_drafter(drafter.config, 16).collate(samples)
    first, last, _ = _train(drafter, batch, steps=20, lr=1e-3)
    assert last < first
