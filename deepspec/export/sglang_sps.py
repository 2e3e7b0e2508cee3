"""SGLang's DSpark verification cost table (`--speculative-dspark-sps-table-path`) from DeepSpec's SPS profiles.

SGLang 0.5.23 reads an `SpsCostTable` JSON object (`srt/speculative/dspark_components/dspark_sps.py:14-47`):
`sample_batch_tokens` (strictly increasing), `sample_steps_per_sec` (as many) and `max_batch_tokens` (at least the
last probe). Its scheduler prices a verification step of B tokens in all, every running request's anchor plus its
admitted drafts (`dspark_planner.py:894`), at the largest probe <= B, the first below and the last beyond
(`_lookup_sps_tensor`, `:908-914`). That B is DeepSpec's (deepspec.decoding.scheduler.SPSTable). SGLang's own
profiler fills the table from full-block steps of R running requests, B = R x (gamma + 1)
(`benchmark/dspark_sps_profiler.py:84-95`); `full_block_points` takes the same point from each of DeepSpec's
per-R tables (`deepspec.decoding.profiling.profile_target_sps`), which time transformers' forward, not SGLang's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from deepspec.decoding.scheduler import SPSTable
from deepspec.utils.io import atomic_write_json


def full_block_points(tables_by_rows: Mapping[int, SPSTable], num_drafts: int) -> list[tuple[int, float]]:
    """(B, steps per second) of a step that verifies R full blocks, B = R x (1 + num_drafts), for every table of R
    rows, by increasing B."""
    points = []
    for rows, table in sorted(tables_by_rows.items()):
        tokens = rows * (1 + num_drafts)
        if tokens not in table.batch_sizes:
            raise ValueError(f"the SPS table of R={rows} has no point at its full blocks, R x (1 + {num_drafts}) = "
                             f"{tokens} tokens; it was profiled at {table.batch_sizes}")
        points.append((tokens, table.steps_per_second[table.batch_sizes.index(tokens)]))
    return points


def sglang_sps_table(points: Sequence[tuple[int, float]]) -> dict:
    """SGLang's `SpsCostTable` fields of (B, steps per second) points, refused where SGLang would refuse them."""
    tokens = [int(b) for b, _ in points]
    if not tokens or tokens != sorted(set(tokens)) or tokens[0] < 1:
        raise ValueError(f"SGLang's SPS table needs distinct batch sizes >= 1, got {tokens}")
    return {"sample_batch_tokens": tokens, "sample_steps_per_sec": [float(s) for _, s in points],
            "max_batch_tokens": tokens[-1]}


def write_sglang_sps_table(path: str | Path, tables_by_rows: Mapping[int, SPSTable], num_drafts: int) -> dict:
    """Write the full-block points of `tables_by_rows` as SGLang's table at `path` (temp file + rename)."""
    table = sglang_sps_table(full_block_points(tables_by_rows, num_drafts))
    atomic_write_json(path, table)
    return table
