"""Calibration data collection: analytic labels equal an independent inference-path recomputation;
empirical labels are hard prefix survivals of real rollouts with raw (uncalibrated) logits.

Shape legend: G = block size, V = vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from deepspec.cache import BuildJob, CacheReader, build_cache
from deepspec.cache.config import CacheSchema
from deepspec.calibration.collect import (
    collect_analytic,
    collect_empirical,
    require_confidence_head,
    validation_prompts,
)
from deepspec.data.sources import Conversation
from deepspec.drafters.build import build_drafter

LAYERS = [0, 1, 2]


def conversations(n: int, offset: int = 0) -> list[Conversation]:
    return [Conversation(id=f"c{offset + i}", messages=[
        {"role": "user", "content": "Question number " + "abc " * (i + 1)},
        {"role": "assistant", "content": "Answer " + "word " * (5 + 2 * i)}], source="test", line=i)
        for i in range(n)]


@pytest.fixture(scope="module")
def setup(tiny_llama, tiny_drafter, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    splits = {"train": conversations(2), "validation": conversations(3, offset=10), "test": []}
    build_cache(splits, tiny_llama, BuildJob(CacheSchema(out_dir=str(cache_dir), layer_ids=LAYERS, max_length=64,
                                                         batch_size=2, storage_dtype="fp32", shard_size_mb=1.0,
                                                         progress=False)))
    drafter = tiny_drafter("dspark", tiny_llama, target_layer_ids=LAYERS).eval()
    with torch.no_grad():  # a sharper Markov bias and confidence so labels and logits vary
        drafter.sequential.out.weight.normal_(0, 2.0)
        drafter.confidence.score.weight.normal_(0, 0.5)
    return tiny_llama, drafter, CacheReader(cache_dir)


def test_analytic_labels_match_inference_path(setup):
    _, drafter, cache = setup
    collected = collect_analytic(drafter, cache, max_anchors_per_seq=1000)
    g = drafter.config.block_size
    head_VH = drafter.target_parts.lm_head_weight
    rows, groups = [], []
    with torch.no_grad():
        for sequence, index in enumerate(cache.split("validation")):
            sample = cache[index]
            mask = sample.loss_mask
            for anchor in torch.nonzero(mask[:-1] & mask[1:]).flatten().tolist():
                context = drafter.extend_context(drafter.new_decode_state(), sample.features[None, :anchor],
                                                 torch.arange(anchor)[None])
                hidden_GH = drafter.draft_hidden(context, sample.input_ids[[anchor]], torch.tensor([anchor]))[0]
                logits, survival, valid, alive, prefix_ok = [], [], [], 1.0, True
                for j in range(g):
                    prev = sample.input_ids[[min(anchor + j, sample.length - 1)]]
                    draft_V = drafter.base_logits(hidden_GH[j:j + 1])[0] + \
                        drafter.sequential.prev_embed(prev)[0] @ drafter.sequential.out.weight.T
                    target_V = sample.final_hidden[min(anchor + j, sample.length - 1)] @ head_VH.T
                    tv = (torch.softmax(draft_V, -1) - torch.softmax(target_V, -1)).abs().sum()
                    alive *= float(1 - tv / 2)
                    label_pos = anchor + j + 1
                    prefix_ok = prefix_ok and label_pos < sample.length and bool(mask[label_pos])
                    logits.append(float(drafter.confidence(hidden_GH[j:j + 1], drafter.sequential.prev_embed(prev))[0]))
                    survival.append(alive)
                    valid.append(prefix_ok)
                rows.append((logits, survival, valid))
                groups.append(sequence)
    assert collected.confidence_logits_NK.shape == (len(rows), g)
    expected_logits = torch.tensor([r[0] for r in rows])
    expected_survival = torch.tensor([r[1] for r in rows])
    expected_valid = torch.tensor([r[2] for r in rows])
    assert torch.equal(collected.valid_NK, expected_valid)
    torch.testing.assert_close(collected.confidence_logits_NK, expected_logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(collected.survival_NK, expected_survival, rtol=0, atol=1e-4)
    assert not expected_valid.all() and expected_valid[:, 0].all()  # some blocks end early
    assert collected.labels == "analytic" and collected.label_kind == "analytic"
    assert collected.num_samples_K == expected_valid.sum(0).tolist()
    assert collected.group_N.tolist() == groups  # each block's validation sequence, for held-out splits


@pytest.mark.float_exact
def test_empirical_labels_are_hard_prefix_survival_with_raw_logits(setup):
    target, drafter, cache = setup
    prompts = validation_prompts(cache)
    assert len(prompts) == 3 and all(len(p) > 3 for p in prompts)
    first = collect_empirical(drafter, target.model, prompts, max_new_tokens=10, max_concurrency=2, seed=3)
    assert first.label_kind == "hard" and first.info["num_prompts"] == 3
    survival, valid = first.survival_NK, first.valid_NK
    assert set(survival.unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(valid, torch.cumprod(valid.long(), 1).bool())  # a prefix
    assert (survival[:, 1:] <= survival[:, :-1]).all() and not survival[~valid].any()
    assert not valid.all()  # the last rounds of a request verify fewer positions
    # Temperatures change only the calibrated confidences, never the tokens or the recorded raw logits.
    drafter.config.calibration_temperatures = [2.0] * drafter.config.block_size
    try:
        second = collect_empirical(drafter, target.model, prompts, max_new_tokens=10, max_concurrency=2, seed=3)
    finally:
        drafter.config.calibration_temperatures = None
    assert torch.equal(first.confidence_logits_NK, second.confidence_logits_NK)
    assert torch.equal(first.survival_NK, second.survival_NK)


def test_holdout_split_keeps_whole_rollouts_apart(setup):
    """Each row carries its rollout; a held-out split never puts rounds of one rollout on both sides."""
    target, drafter, cache = setup
    collected = collect_empirical(drafter, target.model, validation_prompts(cache), max_new_tokens=10,
                                  max_concurrency=2, seed=3)
    assert set(collected.group_N.tolist()) == {0, 1, 2}
    fit, held = collected.split(0.5, seed=1)
    fit_groups, held_groups = set(fit.group_N.tolist()), set(held.group_N.tolist())
    assert fit_groups and held_groups and not fit_groups & held_groups and len(held_groups) == 2  # round(1.5) = 2
    assert fit.valid_NK.shape[0] + held.valid_NK.shape[0] == collected.valid_NK.shape[0]
    rows_of = {g: collected.confidence_logits_NK[collected.group_N == g] for g in (0, 1, 2)}
    for part in (fit, held):
        for g in set(part.group_N.tolist()):
            assert torch.equal(part.confidence_logits_NK[part.group_N == g], rows_of[g])
    assert collected.split(0.0) == (collected, None)
    with pytest.raises(ValueError, match="holdout=1.0"):
        collected.split(1.0)
    with pytest.raises(ValueError, match="at least 2"):
        collected.rows(torch.nonzero(collected.group_N == 0).flatten()).split(0.5)


def test_no_confidence_head_fails_before_compute(tiny_llama):
    dflash = build_drafter("dflash", tiny_llama, num_draft_layers=1, target_layer_ids=LAYERS, block_size=4)
    with pytest.raises(ValueError, match="no confidence head"):
        require_confidence_head(dflash)
    with pytest.raises(ValueError, match="no confidence head"):
        collect_analytic(dflash, cache=None)  # the cache is never touched
    with pytest.raises(ValueError, match="no confidence head"):
        collect_empirical(dflash, tiny_llama.model, prompts=[])


def test_empty_validation_split_is_named(tiny_llama, tiny_drafter, tmp_path):
    build_cache({"train": conversations(2), "validation": [], "test": []}, tiny_llama,
                BuildJob(CacheSchema(out_dir=str(tmp_path), layer_ids=LAYERS, max_length=64, batch_size=2,
                                     storage_dtype="fp32", shard_size_mb=1.0, progress=False)))
    drafter = tiny_drafter("dspark", tiny_llama, target_layer_ids=LAYERS)
    with pytest.raises(ValueError, match="validation split is empty"):
        collect_analytic(drafter, CacheReader(tmp_path))


def test_cache_with_extra_layers_feeds_only_the_drafters_layers(setup, tiny_drafter):
    """A drafter reading layers [0, 2] of a cache holding [0, 1, 2] equals a [0, 1, 2] drafter whose
    fusion weights ignore layer 1."""
    target, _, cache = setup
    narrow = tiny_drafter("dspark", target, seed=5, target_layer_ids=[0, 2]).eval()
    wide = tiny_drafter("dspark", target, seed=6, target_layer_ids=LAYERS).eval()
    state = dict(narrow.state_dict())
    hidden = target.config.hidden_size
    proj = state["backbone.fusion.proj.weight"]
    state["backbone.fusion.proj.weight"] = torch.cat([proj[:, :hidden], torch.zeros_like(proj[:, :hidden]),
                                                      proj[:, hidden:]], dim=1)
    wide.load_state_dict(state)
    a = collect_analytic(narrow, cache, max_anchors_per_seq=8)
    b = collect_analytic(wide, cache, max_anchors_per_seq=8)
    torch.testing.assert_close(a.confidence_logits_NK, b.confidence_logits_NK, rtol=0, atol=1e-5)
    torch.testing.assert_close(a.survival_NK, b.survival_NK, rtol=0, atol=1e-5)
