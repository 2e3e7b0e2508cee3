"""Feature sources (deepspec.cache.source): every `data.features` mode opens a `FeatureSource`, and what needs no
target (the cache's index, the conversations) is read and refused before the target is asked for. The sources'
numbers (online = a cache of the same batches, hybrid's cache = a build's) are in
tests/training/test_online_features.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepspec.cache import CacheReader, FeatureSource, FeatureSourceConfig
from deepspec.cache.config import CacheDataSchema, CacheSchema
from deepspec.cache.hybrid import HybridFeatures
from deepspec.cache.online import OnlineFeatures


def write_conversations(path: Path, convs, extra_lines: tuple[str, ...] = ()) -> Path:
    lines = [json.dumps({"id": c.id, "conversations": c.messages}) for c in convs]
    path.write_text("\n".join([*lines, *extra_lines]) + "\n")
    return path


def online_config(prompts: Path, mode: str, cache_dir: Path | None = None) -> FeatureSourceConfig:
    return FeatureSourceConfig(mode=mode, cache_dir=str(cache_dir), batching="sample",
                               conversations=CacheDataSchema(prompts=str(prompts), val_fraction=0.2),
                               options=CacheSchema(max_length=64, storage_dtype="fp32"))


def test_every_mode_opens_a_feature_source(tiny_cache, tiny_llama, conversations_factory, tmp_path):
    prompts = write_conversations(tmp_path / "convs.jsonl", conversations_factory(12))
    offline = FeatureSourceConfig(mode="offline", cache_dir=str(tiny_cache)).prepare().open(tiny_llama, [0, 1, 2])
    online = online_config(prompts, "online").prepare().open(tiny_llama, [0, 1, 2])
    hybrid = online_config(prompts, "hybrid", tmp_path / "cache").prepare().open(tiny_llama, [0, 1, 2])
    assert not (tmp_path / "cache").exists()  # hybrid writes nothing before it computes a sample
    assert (type(offline), type(online), type(hybrid)) == (CacheReader, OnlineFeatures, HybridFeatures)
    for source in (offline, online, hybrid):
        assert isinstance(source, FeatureSource)
        assert len(source) == len(source.lengths()) > 0 and source.batch([0, 1])[1].length == source.lengths()[1]
    assert len(list((tmp_path / "cache" / ".online-stage").glob("p*.safetensors"))) == 2  # what it computed, staged


def test_what_needs_no_target_is_refused_before_it_loads(conversations_factory, tmp_path):
    with pytest.raises(ValueError, match=r"data.features='disk' must be one of \['offline', 'online', 'hybrid'\]"):
        FeatureSourceConfig(mode="disk").prepare()
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        FeatureSourceConfig(mode="offline", cache_dir=str(tmp_path / "none")).prepare()
    bad = write_conversations(tmp_path / "bad.jsonl", conversations_factory(4), extra_lines=('{"id": "x", "conv',))
    with pytest.raises(ValueError, match=r"bad\.jsonl'?: 1 malformed or truncated record\(s\)(.|\n)*bad\.jsonl:5"):
        online_config(bad, "online").prepare()
