"""Staged samples (deepspec.cache.stage): written with their sha256, read back checked byte for byte; damage is
named, never trusted, never fatal; a finished cache's stage is removed with a report."""

from __future__ import annotations

import logging

import pytest
import torch

from deepspec.cache.stage import SampleStage, _parse, remove_stage


def sample(length: int = 40, width: int = 32) -> tuple[dict[str, torch.Tensor], float, float]:
    generator = torch.Generator().manual_seed(length)
    tensors = {"input_ids": torch.arange(length, dtype=torch.int32), "loss_mask": torch.ones(length, dtype=torch.uint8),
               "features": torch.randn(length, 3 * width, generator=generator).bfloat16(),
               "final_hidden": torch.randn(length, width, generator=generator).bfloat16(),
               "target_lse": torch.randn(length, generator=generator)}
    return tensors, 0.25, 1.5


def assert_same(got, want) -> None:
    assert got[1:] == want[1:] and got[0].keys() == want[0].keys()
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])


def test_a_staged_sample_reads_back_as_written(tmp_path):
    stage = SampleStage(tmp_path)
    stage.prepare({"storage_dtype": "bf16"})
    staged = sample()
    stage.write(7, staged)
    assert_same(stage.read(7, staged[0]["input_ids"]), staged)
    assert stage.read(8, staged[0]["input_ids"]) is None  # not staged: computed
    assert stage.read_settings() == {"storage_dtype": "bf16"}


@pytest.mark.parametrize("how", ["truncate", "flip-data", "flip-header", "other-tokens"])
def test_a_damaged_staged_sample_is_named_deleted_and_reported_missing(tmp_path, caplog, how):
    stage = SampleStage(tmp_path)
    stage.prepare({})
    staged = sample()
    stage.write(3, staged)
    path = stage.path(3)
    data = bytearray(path.read_bytes())
    ids = staged[0]["input_ids"]
    if how == "truncate":
        data = data[:len(data) // 2]
    elif how == "flip-data":
        data[-100] ^= 0x01
    elif how == "flip-header":
        data[20] ^= 0x20
    else:
        ids = ids + 1
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert stage.read(3, ids, "conv3") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"{path}: damaged staged sample 'conv3' (") and "\n" not in lines[0]
    assert not path.exists() and stage.num_damaged == 1


def regions(payload: bytes) -> dict[str, int]:
    """One byte offset in each part of a staged file: the header's JSON, a space that pads it, the fp8 sums' text
    in the record, the tensor data, and 7 bytes before the end (the last tensor's data: there is no trailing pad)."""
    header_end = 8 + int.from_bytes(payload[:8], "little")
    assert payload[header_end - 1:header_end] == b" "  # the header is padded (to a multiple of 8 bytes)
    return {"header": 10, "header padding": header_end - 1, "record": payload.index(b"0.25"),
            "tensor data": header_end + 100, "last bytes": len(payload) - 7}


def test_every_byte_of_a_staged_file_is_checked(tmp_path):
    """Each byte flipped in turn (in the header: to every byte that keeps it ASCII, e.g. a padding space to a tab
    that JSON reads alike; elsewhere three flips): every damaged file is refused, the intact one read."""
    stage = SampleStage(tmp_path)
    staged = sample(5, width=4)
    stage.write(0, staged)
    payload = stage.path(0).read_bytes()
    header_end = 8 + int.from_bytes(payload[:8], "little")
    ids = staged[0]["input_ids"]
    assert _parse(payload, ids)[0] is None
    unnoticed = []
    for at in range(len(payload)):
        values = (range(0x09, 0x7F) if 8 <= at < header_end else (payload[at] ^ 0x01, payload[at] ^ 0x80,
                                                                    payload[at] ^ 0xFF))
        for value in values:
            if value != payload[at] and _parse(payload[:at] + bytes([value]) + payload[at + 1:], ids)[0] is None:
                unnoticed.append((at, payload[at], value))
    assert unnoticed == []


@pytest.mark.parametrize("region", ["header", "header padding", "record", "tensor data", "last bytes"])
def test_a_flipped_byte_in_each_part_of_a_staged_file_is_named(tmp_path, caplog, region):
    stage = SampleStage(tmp_path)
    staged = sample(41)
    stage.write(2, staged)
    path = stage.path(2)
    data = bytearray(path.read_bytes())
    at = regions(bytes(data))[region]
    # a padding space becomes a tab (still JSON whitespace), the sums' "0.25" becomes " .25" (still 0.25)
    data[at] = {"header padding": 0x09, "record": 0x20}.get(region, data[at] ^ 0xFF)
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert stage.read(2, staged[0]["input_ids"], "conv2") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"{path}: damaged staged sample 'conv2' (") and "\n" not in lines[0]
    assert not path.exists() and stage.num_damaged == 1


def test_a_stage_with_a_damaged_record_is_never_read_and_discarded_at_the_first_write(tmp_path, caplog):
    stage = SampleStage(tmp_path)
    stage.prepare({"a": 1})
    staged = sample()
    stage.write(1, staged)
    stage.settings_path.write_text("{not json")
    later = SampleStage(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert later.read_settings() is None
    assert "damaged stage record" in caplog.text and stage.path(1).exists()  # reading changed nothing
    assert later.read(1, staged[0]["input_ids"]) is None  # its samples are not trusted
    later.prepare({"a": 2})
    assert not later.path(1).exists() and later.read_settings() == {"a": 2}


def test_remove_stage_reports_what_it_held(tmp_path):
    stage = SampleStage(tmp_path)
    stage.prepare({})
    for position in range(3):
        stage.write(position, sample(10 + position))
    report = remove_stage(tmp_path, "a reason")
    assert report.startswith(f"removed {stage.dir} (3 staged sample(s), 4 file(s), ") and report.endswith(": a reason")
    assert not stage.dir.exists() and remove_stage(tmp_path, "again") is None
