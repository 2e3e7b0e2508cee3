"""SGLang's DSpark SPS table from DeepSpec's profiles: one full-block point per concurrency, in the fields and with
the invariants of SGLang 0.5.23's `SpsCostTable` (srt/speculative/dspark_components/dspark_sps.py:14-36)."""

from __future__ import annotations

import json

import pytest

from deepspec.decoding.scheduler import SPSTable
from deepspec.export.sglang_sps import full_block_points, sglang_sps_table, write_sglang_sps_table


def check_like_sglang(table: dict) -> None:
    """SpsCostTable.__post_init__'s checks, and nothing but its three fields."""
    assert set(table) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    tokens, speeds = table["sample_batch_tokens"], table["sample_steps_per_sec"]
    assert tokens and tokens == sorted(set(tokens)) and len(tokens) == len(speeds)
    assert table["max_batch_tokens"] >= tokens[-1]
    assert all(isinstance(b, int) for b in tokens) and all(isinstance(s, float) for s in speeds)


def test_the_full_block_point_of_each_concurrency_in_sglang_s_fields(tmp_path):
    tables = {4: SPSTable([4, 16, 32], [90.0, 80.0, 60.0]), 1: SPSTable([1, 4, 8], [100.0, 99.0, 97.0])}
    assert full_block_points(tables, num_drafts=7) == [(8, 97.0), (32, 60.0)]
    table = write_sglang_sps_table(tmp_path / "sps.json", tables, num_drafts=7)
    assert json.loads((tmp_path / "sps.json").read_text()) == table == {
        "sample_batch_tokens": [8, 32], "sample_steps_per_sec": [97.0, 60.0], "max_batch_tokens": 32}
    check_like_sglang(table)
    with pytest.raises(ValueError, match=r"the SPS table of R=1 has no point at its full blocks, R x \(1 \+ 5\) = 6"):
        full_block_points(tables, num_drafts=5)
    with pytest.raises(ValueError, match="distinct batch sizes"):
        sglang_sps_table([(8, 1.0), (8, 2.0)])

