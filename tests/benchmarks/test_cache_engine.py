"""`deepspec bench cache-engine`'s comparison of two caches (deepspec.benchmarks.cache_engine); the engine build
itself runs in tests/cache/test_engine_vllm.py."""

from __future__ import annotations

import pytest

from deepspec.benchmarks.cache_engine import compare_caches
from deepspec.cache import BuildJob, build_cache
from deepspec.cache.config import CacheSchema


def build(target, conversations, out):
    build_cache({"train": conversations}, target, BuildJob(CacheSchema(
        out_dir=str(out), layer_ids=[0, 1], max_length=None, storage_dtype="fp32", progress=False)))
    return out


def test_two_builds_of_the_same_samples_are_zero_apart_and_a_changed_one_is_measured(
        tiny_llama, conversations_factory, tmp_path):
    conversations = conversations_factory(4)
    first = build(tiny_llama, conversations, tmp_path / "a")
    second = build(tiny_llama, conversations, tmp_path / "b")
    same = compare_caches(first, second)
    assert same["same_token_ids_and_loss_masks"]
    assert set(same["max_abs_diff"]) == {"layer_0", "layer_1", "final_hidden", "target_lse"}
    assert all(v == 0.0 for v in same["max_abs_diff"].values())
    assert all(v > 0.0 for v in same["max_abs_value"].values())

    # Another target's features: every tensor moves (the log-normaliser of a random model barely), the tokens
    # do not.
    from deepspec.targets.load import make_tiny_target

    other = build(make_tiny_target("llama", seed=1), conversations, tmp_path / "c")
    apart = compare_caches(other, first)
    assert apart["same_token_ids_and_loss_masks"]
    assert all(v > 0.0 for v in apart["max_abs_diff"].values())
    assert all(apart["relative_l2"][name] > 1e-2 for name in ("layer_0", "layer_1", "final_hidden"))


def test_caches_of_other_samples_are_refused(tiny_llama, conversations_factory, tmp_path):
    conversations = conversations_factory(4)
    first = build(tiny_llama, conversations, tmp_path / "a")
    fewer = build(tiny_llama, conversations[:3], tmp_path / "b")
    with pytest.raises(ValueError, match="hold other samples"):
        compare_caches(first, fewer)
