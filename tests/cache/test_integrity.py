"""The records that say where a cache's bytes are and what they mean (index.json, meta.json, a partial index, the
stage's settings.json): a flipped byte that still parses is named and refused (or, for the stage, its samples
computed again), never used. The shards and staged samples themselves: tests/cache/test_cache.py, test_stage.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from deepspec.cache import BuildJob, CacheReader, build_cache, merge_cache, verify_cache
from deepspec.cache.config import CacheSchema
from deepspec.cache.format import partial_index_name
from deepspec.cache.stage import SampleStage
from deepspec.data.sources import Conversation

LAYERS = [0, 1, 2]


def conversations(n: int = 10) -> dict[str, list[Conversation]]:
    convs = [Conversation(id=f"conv{i}", source="test", line=i,
                          messages=[{"role": "user", "content": "Question " + "x " * (2 * i + 1)},
                                    {"role": "assistant", "content": "Answer " + "word " * (3 * i + 2)}])
             for i in range(n)]
    return {"train": convs[:8], "validation": convs[8:]}


def build(target, out_dir: Path, **kwargs):
    options = dict(max_length=64, batch_size=1, storage_dtype="bf16", shard_size_mb=0.01, progress=False)
    return build_cache(conversations(), target,
                       BuildJob(CacheSchema(out_dir=str(out_dir), layer_ids=LAYERS, **{**options, **kwargs})))


@pytest.fixture(scope="module")
def finished(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "cache"
    build(tiny_llama, out)
    return out


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


# --- the stage's record ------------------------------------------------------------------------------------
def staged_sample(length: int = 37) -> tuple[dict[str, torch.Tensor], float, float]:
    generator = torch.Generator().manual_seed(length)
    tensors = {"input_ids": torch.arange(length, dtype=torch.int32), "loss_mask": torch.ones(length, dtype=torch.uint8),
               "features": torch.randn(length, 96, generator=generator).bfloat16(),
               "final_hidden": torch.randn(length, 32, generator=generator).bfloat16(),
               "target_lse": torch.randn(length, generator=generator)}
    return tensors, 0.25, 1.5


def test_a_flipped_byte_in_the_stage_record_discards_the_stage(tmp_path, caplog):
    """settings.json of the stage decides which staged samples are trusted: a flipped value in it (one that still
    parses, and a field a run would compare) is damage, named, and its samples are computed again."""
    stage = SampleStage(tmp_path)
    stage.prepare({"storage_dtype": "bf16"})
    staged = staged_sample()
    stage.write(3, staged)
    text = stage.settings_path.read_text()
    assert '"bf16"' in text
    stage.settings_path.write_text(text.replace('"bf16"', '"bf17"'))  # '6' -> '7': one flipped bit
    later = SampleStage(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert later.read_settings() is None
    assert f"{stage.settings_path}: damaged stage record" in caplog.text
    assert later.read(3, staged[0]["input_ids"]) is None
    later.prepare({"storage_dtype": "bf16"})
    assert not later.path(3).exists() and later.read_settings() == {"storage_dtype": "bf16"}


# --- a finished cache --------------------------------------------------------------------------------------
def damaged_copy(finished: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(finished, cache)
    return cache


def read_every_sample(cache: Path) -> None:
    reader = CacheReader(cache)
    for i in range(len(reader)):
        reader[i]


def index_digit(text: str, field: str) -> int:
    """The offset of the last digit of sample 1's `field` in index.json."""
    start = text.index(f'"{field}": ', text.index('"id": "conv1"')) + len(f'"{field}": ')
    end = start
    while text[end].isdigit():
        end += 1
    return end - 1


@pytest.mark.parametrize("field", ["offset", "length", "position", "num_loss_tokens"])
def test_a_flipped_digit_in_the_index_is_refused(finished, tmp_path, field):
    """index.json says which rows of which shard are a sample: a flipped digit would hand training another sample's
    rows (the shards' checksums all still pass). It is refused, naming index.json, before any sample is read."""
    cache = damaged_copy(finished, tmp_path)
    index_path = cache / "index.json"
    flip(index_path, index_digit(index_path.read_text(), field))
    with pytest.raises(ValueError, match=rf"{index_path}: sha256 .* differs from the one {cache / 'meta.json'} "
                                         r"records"):
        CacheReader(cache)
    assert any(p.startswith(f"{index_path}: sha256") for p in verify_cache(cache))


@pytest.mark.parametrize("what", ["layer_ids", "vocab_size"])
def test_a_flipped_value_in_meta_json_is_refused(finished, tmp_path, what):
    """meta.json's layer ids are the layers the drafter is told it was trained on (and exported with); its vocab
    size bounds the id check. A flipped digit is refused, naming meta.json."""
    cache = damaged_copy(finished, tmp_path)
    meta_path = cache / "meta.json"
    text = meta_path.read_text()
    start = text.index(f'"{what}": ')
    flip(meta_path, text.index("2", start) if what == "layer_ids" else start + len(f'"{what}": '))  # layer 2 -> 3
    with pytest.raises(ValueError, match=rf"{meta_path}: damaged"):
        CacheReader(cache)
    assert any(p.startswith(f"{meta_path}: damaged") for p in verify_cache(cache))


def test_a_flipped_byte_in_a_partial_index_is_refused_by_resume_and_merge(tiny_llama, finished, tmp_path):
    """index-r0.json lists the finished shards of a build and where each sample lies in them: the merge makes
    index.json from it and a resumed build keeps what it lists. A flipped digit there is refused by both, naming
    the file, and nothing is deleted."""
    cache = damaged_copy(finished, tmp_path)
    partial_path = cache / partial_index_name(0)
    text = partial_path.read_text()
    flip(partial_path, index_digit(text, "offset"))
    before = {p.name: p.read_bytes() for p in cache.iterdir() if not p.name.startswith(".lock")}
    with pytest.raises(ValueError, match=rf"{partial_path}: damaged"):
        merge_cache(cache)
    with pytest.raises(ValueError, match=rf"{partial_path}: damaged"):
        build(tiny_llama, cache)
    assert {p.name: p.read_bytes() for p in cache.iterdir() if not p.name.startswith(".lock")} == before


def test_a_cache_written_before_the_records_were_sealed_still_reads(finished, tmp_path):
    """Caches and partial builds from before meta.json recorded the index's digest (and the records their own) are
    read as before."""
    from deepspec.cache.format import RECORD_SEAL

    cache = damaged_copy(finished, tmp_path)
    for name in ("meta.json", partial_index_name(0)):
        record = json.loads((cache / name).read_text())
        record.pop(RECORD_SEAL)
        record.pop("index_sha256", None)
        (cache / name).write_text(json.dumps(record, indent=1))
    assert verify_cache(cache) == []
    reader, reference = CacheReader(cache), CacheReader(finished)
    assert all(torch.equal(reader[i].features, reference[i].features) for i in range(len(reader)))
    merge_cache(cache)
    assert json.loads((cache / "meta.json").read_text())["index_sha256"]  # the merge records it again

