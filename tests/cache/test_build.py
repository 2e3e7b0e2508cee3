"""The build job (deepspec.cache.build): one object names the folder and the layers once; the build's bytes and
resume are in test_cache.py, test_integrity.py and test_cache_distributed.py."""

from __future__ import annotations

import inspect

import pytest

from deepspec.cache import BuildJob, build_cache, read_meta
from deepspec.cache.config import CacheSchema
from deepspec.data.sources import Conversation


def test_build_cache_takes_the_folder_and_layers_from_its_job_only(tiny_llama, tmp_path):
    assert list(inspect.signature(build_cache).parameters) == ["conversations_by_split", "target", "job"]
    job = BuildJob(CacheSchema(out_dir=str(tmp_path / "cache"), layer_ids=[2], max_length=None, progress=False))
    assert (job.out_dir, job.layer_ids) == (tmp_path / "cache", [2])
    convs = [Conversation(id=f"c{i}", source="t", line=i, messages=[{"role": "user", "content": "Hi " * (i + 1)},
                                                                   {"role": "assistant", "content": "Hello"}])
             for i in range(2)]
    build_cache({"train": convs}, tiny_llama, job)
    assert read_meta(tmp_path / "cache").layer_ids == [2]


def test_a_job_refuses_unresolved_layers_and_a_rank_outside_the_world():
    with pytest.raises(ValueError, match=r"cache.layer_ids=None: a build job takes the resolved layer ids"):
        BuildJob(CacheSchema())
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        BuildJob(CacheSchema(layer_ids=[0]), rank=2, world_size=2)
