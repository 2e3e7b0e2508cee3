"""Golden loss traces: three AdamW steps of every drafter kind on a tiny target give the stored losses.

A refactor that keeps the numerics keeps these traces (STYLE: numerics as invariants). They were written on
the project's CPU machine in float32 with one thread (`python tests/training/test_golden_losses.py` rewrites
tests/assets/golden_loss_traces.json); another CPU can differ in the last bits (other vector paths), so the
comparison allows a relative 1e-5, far below what any change to a loss, a batch or an initialisation moves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

ASSET = Path(__file__).resolve().parents[1] / "assets" / "golden_loss_traces.json"
IDS = [[1, 5, 77, 912, 33, 4001, 17, 300, 42, 9, 8, 7, 6, 5, 4, 3, 2000, 1500],
       [7, 8, 9, 10, 11, 12, 13, 14, 15, 99, 3, 4, 1000, 20, 30, 40]]
# name -> (kind, drafter overrides, loss overrides)
CASES = {
    "dspark": ("dspark", {"num_draft_layers": 1, "markov_rank": 8, "block_size": 4, "target_layer_ids": [0, 1, 2]}, {}),
    # DFlash's default convention (mask-predicts, as the DFlash engines read); the anchor-predicts trace is the one
    # DFlash had before its default changed (unchanged numbers: that convention's numerics did not move).
    "dflash_tv": ("dflash", {"num_draft_layers": 1, "block_size": 4, "target_layer_ids": [0, 1, 2]},
                  {"tv_weight": 0.5}),
    "dflash_tv_anchor": ("dflash", {"num_draft_layers": 1, "block_size": 4, "target_layer_ids": [0, 1, 2],
                                    "block_convention": "anchor-predicts"}, {"tv_weight": 0.5}),
    "eagle3_vocab": ("eagle3", {"ttt_steps": 2, "draft_vocab_size": 512, "target_layer_ids": [0, 2]}, {}),
    "mtp_kl": ("mtp", {"num_mtp_modules": 2, "target_layer_ids": []}, {"use_target_kl": True}),
}


def loss_trace(target, name: str, steps: int = 3) -> list[float]:
    from deepspec.cache.memory import capture_samples
    from deepspec.drafters.build import build_drafter
    from deepspec.drafters.draft_vocab import build_draft_vocab
    from deepspec.drafters.spec import BatchSettings, get_drafter_spec
    from deepspec.training.objective import compute_training_loss

    kind, overrides, loss_overrides = CASES[name]
    spec = get_drafter_spec(kind)
    layer_ids = overrides["target_layer_ids"]
    samples = capture_samples(target, IDS, layer_ids)
    torch.manual_seed(0)
    drafter = build_drafter(kind, target, **overrides).train()
    if overrides.get("draft_vocab_size"):
        d2t, t2d = build_draft_vocab(samples, overrides["draft_vocab_size"],
                                     vocab_size=drafter.config.target_vocab_size, always_keep=[0, 1, 2])
        drafter.set_draft_vocab(d2t, t2d)
    settings = BatchSettings(cache_layer_ids=layer_ids, feature_layer_ids=layer_ids, max_anchors_per_seq=6,
                             max_tokens_per_row=40)
    batch = spec.make_batcher(drafter.config, settings).collate(samples, 0)
    loss_cfg = spec.loss_class(**loss_overrides)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    trace = []
    for _ in range(steps):
        total = compute_training_loss(drafter, batch, loss_cfg).loss.total
        total.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trace.append(float(total.detach()))
    return trace


@pytest.mark.parametrize("name", sorted(CASES))
def test_loss_trace_matches_the_golden_one(tiny_llama, name):
    golden = json.loads(ASSET.read_text())[name]
    trace = loss_trace(tiny_llama, name)
    assert len(trace) == len(golden)
    for step, (value, expected) in enumerate(zip(trace, golden)):
        assert math.isclose(value, expected, rel_tol=1e-5), f"{name} step {step}: {value!r} != golden {expected!r}"
    assert trace[-1] < trace[0]  # the trace is a training run, not a constant


if __name__ == "__main__":  # rewrite the asset (only when a change is meant to move the numbers)
    from deepspec.targets.load import make_tiny_target

    torch.set_num_threads(1)
    target = make_tiny_target("llama")
    ASSET.write_text(json.dumps({name: loss_trace(target, name) for name in sorted(CASES)}, indent=1) + "\n")
    print(f"wrote {ASSET}")
