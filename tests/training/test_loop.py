"""The loop trusts nothing it reads: corrupt shards, out-of-vocabulary token ids and non-finite losses or
gradients stop the run, naming the file, sample or step, before anything is logged or saved for that step."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepspec.cache.format import read_meta, write_index_and_meta
from deepspec.training.guards import NonFiniteTrainingError


def damaged_copy(tiny_cache, tmp_path, sample_index: int, edit) -> tuple:
    """A copy of the cache where `edit(tensors, rows)` changed the shard holding `sample_index`; index.json gets the
    new checksum (and meta.json the index's), so only the content check under test can catch it. Returns (cache,
    sample id)."""
    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    index = json.loads((cache / "index.json").read_text())
    entry = index["samples"][sample_index]
    shard = cache / entry["shard"]
    with safe_open(str(shard), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    edit(tensors, slice(entry["offset"], entry["offset"] + entry["length"]))
    save_file(tensors, str(shard), metadata=metadata)
    data = shard.read_bytes()
    index["shards"][entry["shard"]].update(sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data))
    write_index_and_meta(cache, index, read_meta(cache))
    return cache, entry["id"]


def first_train_sample(cache) -> int:
    return next(i for i, s in enumerate(json.loads((cache / "index.json").read_text())["samples"])
                if s["split"] == "train")


def test_flipped_shard_byte_stops_training_naming_the_shard(tt, tiny_cache, tmp_path):
    from deepspec.training import run

    cache = tmp_path / "cache"
    shutil.copytree(tiny_cache, cache)
    shard = sorted(cache.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # a payload byte: the file still parses, only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{shard}: sha256 [0-9a-f]+\.\.\. differs from {cache / 'index.json'}"):
        run(tt.compose(tt.train_overrides(cache, tmp_path / "run")))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_out_of_vocabulary_token_id_stops_training_naming_the_sample(tt, tiny_cache, tmp_path):
    from deepspec.training import run

    index = first_train_sample(tiny_cache)

    def corrupt_id(tensors, rows):
        tensors["input_ids"][rows.start + 3] = 268_438_967

    cache, sample_id = damaged_copy(tiny_cache, tmp_path, index, corrupt_id)
    with pytest.raises(ValueError, match=rf"sample {index} \(id '{sample_id}'\) token 3 has input id 268438967, "
                                         r"outside the target vocabulary \[0, \d+\)"):
        run(tt.compose(tt.train_overrides(cache, tmp_path / "run")))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_nan_feature_stops_training_naming_step_and_sample(tt, tiny_cache, tmp_path):
    from deepspec.training import run
    from deepspec.training.log import read_metrics

    index = first_train_sample(tiny_cache)

    def poison(tensors, rows):
        tensors["features"][rows.start + 1, 0] = float("nan")

    cache, sample_id = damaged_copy(tiny_cache, tmp_path, index, poison)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteTrainingError, match=rf"step (\d+) .*: non-finite loss on rank 0 micro step \d: "
                                                     rf"cache samples .*{index} \(id '{sample_id}'\)") as err:
        run(tt.compose(tt.train_overrides(cache, out)))
    bad_step = int(err.value.args[0].split()[1])
    logged = read_metrics(out, "train")
    assert [r["step"] for r in logged] == list(range(1, bad_step))  # the bad step is never logged
    assert all(r["loss"] is not None for r in logged)
    assert not (out / "checkpoints").exists()


def test_non_finite_gradient_with_finite_loss_stops_training(tt, tiny_cache, tmp_path, monkeypatch):
    import deepspec.training.session as session_module
    from deepspec.training import run

    compute = session_module.compute_training_loss
    calls = []

    def nan_gradient_from_step_2(drafter, batch, loss_cfg, with_metrics=False):
        result = compute(drafter, batch, loss_cfg, with_metrics=with_metrics)
        calls.append(1)
        if len(calls) > 2:  # 2 micro steps per optimizer step: step 1 is clean
            param = next(p for p in drafter.parameters() if p.requires_grad)
            # sqrt(|0|) = 0 keeps the loss finite; its derivative at 0 makes every gradient NaN.
            result.loss.total = result.loss.total + (param.sum() * 0).abs().sqrt()
        return result

    monkeypatch.setattr(session_module, "compute_training_loss", nan_gradient_from_step_2)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteTrainingError, match=r"step 2 .*: non-finite gradient norm \((nan|inf)\) with a "
                                                     r"finite loss; the step's cache samples: \d+ \(id 'conv\d+'\)"):
        run(tt.compose(tt.train_overrides(tiny_cache, out, "trainer.save_every=1")))
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000001"]


@pytest.mark.parametrize("engine", ["single-process", "zero2"])
@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_non_finite_step_never_reaches_the_weights(tt, tiny_cache, tmp_path, monkeypatch, engine, poison):
    """Step 2 gets a NaN loss, or a finite loss whose gradient is NaN: the run stops at step 2 and the weights are
    those step 1 left, whichever engine runs one process (the loss is checked before the update; a non-finite
    gradient norm skips it)."""
    import deepspec.training.session as session_module
    from deepspec.training.loop import train
    from deepspec.training.session import build_session

    compute = session_module.compute_training_loss
    calls, after_step_1 = [], {}

    def poisoned_from_step_2(drafter, batch, loss_cfg, with_metrics=False):
        result = compute(drafter, batch, loss_cfg, with_metrics=with_metrics)
        calls.append(1)
        if len(calls) > 2:  # 2 micro steps per optimizer step: step 1 is clean
            if not after_step_1:
                after_step_1.update({name: p.detach().clone() for name, p in drafter.named_parameters()})
            if poison == "loss":
                result.loss.total = result.loss.total * float("nan")
            else:  # sqrt(|0|) = 0 keeps the loss finite; its derivative at 0 makes every gradient NaN
                param = next(p for p in drafter.parameters() if p.requires_grad)
                result.loss.total = result.loss.total + (param.sum() * 0).abs().sqrt()
        return result

    monkeypatch.setattr(session_module, "compute_training_loss", poisoned_from_step_2)
    extra = [] if engine == "single-process" else ["deepspeed.single_process_engine=false"]
    session = build_session(tt.compose(tt.train_overrides(tiny_cache, tmp_path / "run", *extra)))
    try:
        with pytest.raises(NonFiniteTrainingError, match=r"step 2 .*: non-finite (loss|gradient norm)"):
            train(session)
        changed = [name for name, p in session.drafter.named_parameters() if not torch.equal(p, after_step_1[name])]
        assert after_step_1 and not changed
    finally:
        session.engine.destroy()
        session.lock.close()


def test_reader_checks_checksums_once_and_token_ids(tiny_cache, tmp_path, monkeypatch):
    import deepspec.cache.reader as reader_module
    from deepspec.cache import CacheReader

    hashed = []
    real_sha256 = reader_module.sha256_file
    monkeypatch.setattr(reader_module, "sha256_file", lambda path: hashed.append(path.name) or real_sha256(path))
    monkeypatch.setattr(reader_module, "_VERIFIED_SHARDS", set())
    reader = CacheReader(tiny_cache)
    for i in range(len(reader)):
        reader[i]
    again = CacheReader(tiny_cache)  # another reader in the same process: nothing hashed twice
    for i in range(len(again)):
        again.tokens(i)
    assert sorted(hashed) == sorted(reader.shards)

    index = first_train_sample(tiny_cache)
    cache, sample_id = damaged_copy(tiny_cache, tmp_path, index,
                                    lambda t, rows: t["input_ids"].__setitem__(rows.start, -7))
    damaged = CacheReader(cache, vocab_size=49152)
    with pytest.raises(ValueError, match=rf"sample {index} \(id '{sample_id}'\) token 0 has input id -7"):
        damaged.tokens(index)
    with pytest.raises(ValueError, match="has input id -7"):  # without a vocabulary: the cache's recorded one
        CacheReader(cache)[index]
