"""bf16 autocast of the training forward (`trainer.autocast`): the loss stays close to fp32's, weights stay fp32."""

from __future__ import annotations

import pytest
import torch

from deepspec.cache.memory import capture_samples
from deepspec.drafters.block.batching import BlockBatchBuilder
from deepspec.drafters.build import build_drafter
from deepspec.training.engine import resolve_autocast
from deepspec.training.session import TrainingModule

LAYER_IDS = [0, 1, 2]


def test_bf16_autocast_loss_is_within_two_percent_of_fp32(tiny_llama):
    """The same DSpark and batch: the bf16-autocast loss within 2% (relative) of the fp32 one (bf16 keeps 8 bits of
    mantissa, ~0.4% per rounding; softmaxes and the loss reductions stay fp32 under autocast), gradients finite
    and in fp32, and the fp32 path untouched by the option."""
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=2, markov_rank=8, target_layer_ids=LAYER_IDS,
                            anchor_fusion="latest_context")
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(20, 1000, (32,), generator=g).tolist() for _ in range(4)]
    samples = capture_samples(tiny_llama, ids, LAYER_IDS, [[i >= 2 for i in range(32)] for _ in ids])
    batch = BlockBatchBuilder.for_drafter(drafter.config, 8, 0).collate(samples)
    losses, grads = {}, {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        module = TrainingModule(drafter, None, dtype)
        drafter.zero_grad()
        loss, _ = module(batch)
        loss.backward()
        losses[name] = float(loss.detach())
        grads[name] = [p.grad for p in drafter.parameters() if p.requires_grad and p.grad is not None]
    assert losses["bf16"] != losses["fp32"]  # autocast really changed the arithmetic
    assert abs(losses["bf16"] - losses["fp32"]) <= 0.02 * abs(losses["fp32"]), losses
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads["bf16"])


@pytest.mark.parametrize("mode,expected", [("none", None), ("bf16", torch.bfloat16)])
def test_autocast_modes(mode, expected):
    from deepspec.training.config import compose_train_config, resolve_config

    cfg = resolve_config(compose_train_config([f"trainer.autocast={mode}"]))
    assert resolve_autocast(cfg, torch.device("cpu"), "fp32") == expected
    cfg = resolve_config(compose_train_config(["trainer.autocast=auto"]))
    from deepspec.training.engine import cpu_has_bf16_matmul

    assert resolve_autocast(cfg, torch.device("cpu"), "fp32") == (torch.bfloat16 if cpu_has_bf16_matmul() else None)
    assert resolve_autocast(cfg, torch.device("cpu"), "bf16") is None  # bf16 weights: nothing to autocast
