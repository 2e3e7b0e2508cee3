"""Eagle3 and MTP each overfit a tiny cache from a tiny random target (loss falls > 90%, top-1 agreement ~1).

The tiny random target's embedding (tied LM head) is scaled up so its next-token distributions are
peaked, like a trained model's; with std-0.02 weights they are almost uniform and a soft-CE loss
could not fall far below the target entropy (log 49152).
"""

from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch

from deepspec.cache.reader import CachedSample
from deepspec.drafters.build import build_drafter
from deepspec.drafters.chain.batching import collate_autoregressive
from deepspec.drafters.draft_vocab import build_draft_vocab
from deepspec.drafters.mtp.config import MTPLoss
from deepspec.targets.features import capture_features
from deepspec.training.objective import compute_training_loss


def peaked_target(tiny_llama):
    target = dataclasses.replace(tiny_llama, model=copy.deepcopy(tiny_llama.model))
    with torch.no_grad():
        target.model.get_input_embeddings().weight.mul_(30.0)
    return target


def cached_sample(target, layer_ids, length=24, prompt_len=3):
    ids_1T = torch.randint(20, 1000, (1, length), generator=torch.Generator().manual_seed(0))
    feats = capture_features(target.model, ids_1T, None, layer_ids)
    mask = torch.ones(length, dtype=torch.bool)
    mask[:prompt_len] = False
    return CachedSample("s0", ids_1T[0], mask, feats.features_BTF[0], feats.final_hidden_BTH[0])


def overfit(drafter, batch, num_steps: int, lr: float = 3e-3, loss=None):
    optimizer = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=lr)
    start = time.perf_counter()
    first = None
    for _ in range(num_steps):
        result = compute_training_loss(drafter, batch, loss)
        first = float(result.loss.total.detach()) if first is None else first
        optimizer.zero_grad()
        result.loss.total.backward()
        optimizer.step()
    with torch.no_grad():
        final = compute_training_loss(drafter.eval(), batch, loss)
    agreement = (final.terms.draft_argmax_N == final.terms.target_argmax_N).float().mean().item()
    return first, float(final.loss.total), agreement, time.perf_counter() - start, final


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_overfits_tiny_cache(kind, tiny_llama):
    target = peaked_target(tiny_llama)
    torch.manual_seed(0)
    loss = None  # the kind's default loss
    if kind == "eagle3":
        layer_ids = [0, 1, 2]
        sample = cached_sample(target, layer_ids)
        drafter = build_drafter("eagle3", target, target_layer_ids=layer_ids, ttt_steps=3, draft_vocab_size=1024)
        d2t, t2d = build_draft_vocab([sample], 1024, vocab_size=drafter.config.target_vocab_size, always_keep=[0, 1, 2])
        drafter.set_draft_vocab(d2t, t2d)
        num_steps = 100
    else:
        layer_ids = []
        sample = cached_sample(target, layer_ids)
        drafter = build_drafter("mtp", target, target_layer_ids=[], num_mtp_modules=2)
        loss = MTPLoss(use_target_kl=True)
        num_steps = 30
    batch = collate_autoregressive([sample], cache_layer_ids=layer_ids, feature_layer_ids=layer_ids,
                                   max_tokens_per_row=sample.length)
    first, last, agreement, seconds, final = overfit(drafter.train(), batch, num_steps, loss=loss)
    print(f"{kind}: loss {first:.3f} -> {last:.4f}, top-1 agreement {agreement:.3f}, "
          f"{num_steps} steps in {seconds:.1f}s")
    assert last < 0.1 * first
    assert agreement >= 0.95
    num_positions = 3 if kind == "eagle3" else 2
    assert sorted(set(final.position_index_N.tolist())) == list(range(num_positions))  # every step/module trained
