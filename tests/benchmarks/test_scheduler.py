"""`deepspec bench scheduler`: the SPS tables it profiles, and the DSpark SPS table for SGLang written from them."""

from __future__ import annotations

import json

from deepspec.decoding.scheduler import SPSTable


def test_bench_scheduler_writes_the_table_from_the_tables_it_profiled(tmp_path):
    from deepspec.benchmarks.scheduler import main

    out, table_path = tmp_path / "bench.json", tmp_path / "sglang" / "sps.json"
    main(["--tiny", "--concurrency", "1,2", "--max-new-tokens", "2", "--requests-per-slot", "1", "--profile-repeats",
          "1", "--out", str(out), "--sglang-sps-table", str(table_path)])
    report = json.loads(out.read_text())
    block = report["num_drafts"]
    table = json.loads(table_path.read_text())
    assert set(table) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}  # SGLang's fields
    assert table["sample_batch_tokens"] == [1 + block, 2 * (1 + block)]
    profiled = [SPSTable.load(tmp_path / "sps" / f"sps_R{rows}_ctx128.json") for rows in (1, 2)]
    assert table["sample_steps_per_sec"] == [t.steps_per_second[-1] for t in profiled]
    assert report["sglang_sps_table"]["path"] == str(table_path)
