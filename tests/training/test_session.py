"""Session assembly refuses what it must not trust: a cache index that points outside the cache folder."""

from __future__ import annotations

import json
import shutil

import pytest


def test_training_refuses_a_cache_index_pointing_outside(tt, tiny_cache, tmp_path):
    from deepspec.training import run

    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    index_path = cache / "index.json"
    index = json.loads(index_path.read_text())
    real = sorted(index["shards"])[0]
    outside = tmp_path / "outside.safetensors"
    shutil.move(cache / real, outside)  # a valid shard with the recorded checksum, but outside the cache
    index["shards"][str(outside)] = index["shards"].pop(real)
    for sample in index["samples"]:
        if sample["shard"] == real:
            sample["shard"] = str(outside)
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{index_path}: shards: shard name '{outside}' is not a shard file name"):
        run(tt.compose(tt.train_overrides(cache, tmp_path / "run")))
    assert not (tmp_path / "run" / "checkpoints").exists()
