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


FIRST_RUN = """
import sys, time
from deepspec.training.config import compose_train_config
import deepspec.training.checkpoint as checkpoint
from deepspec.training import run
real_save = checkpoint.save_checkpoint
def save_then_hang(*args, **kwargs):  # a slow first run: hangs right after its first checkpoint
    path = real_save(*args, **kwargs)
    print("saved", flush=True)
    time.sleep(600)
checkpoint.save_checkpoint = save_then_hang
cfg = compose_train_config(sys.argv[2:], config_dir=sys.argv[1])
run(cfg)
"""


def test_second_run_into_one_out_dir_is_refused_naming_the_holder(tt, tiny_cache, tmp_path):
    import subprocess
    import sys

    from deepspec.training import run
    from deepspec.utils.locks import LockHeldError

    out = tmp_path / "run"
    overrides = tt.train_overrides(tiny_cache, out, "trainer.save_every=1")
    first = subprocess.Popen([sys.executable, "-c", FIRST_RUN, str(tt.CONF_DIR), *overrides], env=tt.subprocess_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert "saved\n" in iter(first.stdout.readline, "")
        files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        with pytest.raises(LockHeldError, match=rf"{out / '.lock-train-r0'}: rank 0 of the training run in {out} "
                                                rf"is being written by another run: pid {first.pid} on "):
            run(tt.compose(overrides))
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    finally:
        first.kill()
        first.wait(timeout=30)


def test_an_empty_validation_split_is_warned_about(tt, tiny_cache, caplog):
    import logging

    from deepspec.cache.reader import CacheReader
    from deepspec.training.config import resolve_config
    from deepspec.training.data import TrainingData

    cfg = resolve_config(tt.compose(tt.train_overrides(tiny_cache, None, "data.val_split=test")))  # no test samples
    with caplog.at_level(logging.WARNING, logger="deepspec.training.data"):
        t = cfg.trainer
        data = TrainingData(cfg.data, CacheReader(tiny_cache), [0, 1, 2], [0, 1, 2], seed=t.seed,
                            global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                            val_max_samples=t.val_max_samples)
    assert data.val_ids == []
    assert f"data.cache_dir='{tiny_cache}' has no 'test' samples (data.val_split)" in caplog.text
