"""Tables from a hand-made results dict: Markdown layout, domain/macro averages, CSV and JSON contents."""

import csv
import io
import json

import pytest

from deepspec.evaluation.tables import (
    render_csv,
    render_markdown,
    table_data,
    write_tables,
)


def _results():
    benches = [
        {"name": "mt-bench", "domain": "chat", "num_prompts": 2},
        {"name": "gsm8k", "domain": "math", "num_prompts": 3},
        {"name": "humaneval", "domain": "code", "num_prompts": 4},
        {"name": "math500", "domain": "math", "num_prompts": 3},
    ]
    return {
        "settings": {"target": "tiny", "benchmarks": benches, "max_new_tokens": 64, "temperature": 1.0,
                     "top_k": 0, "top_p": 1.0, "seed": 0, "threshold": None, "verify_length": None},
        "drafters": {
            "dspark": {"kind": "dspark", "benchmarks": {
                "mt-bench": {"tau": 2.0, "num_prompts": 2, "num_rounds": 10},
                "gsm8k": {"tau": 4.0, "num_prompts": 3, "num_rounds": 11},
                "humaneval": {"tau": 3.5, "num_prompts": 4, "num_rounds": 12},
                "math500": {"tau": 5.0, "num_prompts": 3, "num_rounds": 13}}},
            "dflash": {"kind": "dflash", "benchmarks": {
                "mt-bench": {"tau": 1.5, "num_prompts": 2, "num_rounds": 10},
                "gsm8k": {"tau": 3.0, "num_prompts": 3, "num_rounds": 9},
                "humaneval": {"tau": 2.5, "num_prompts": 4, "num_rounds": 8}}},  # math500 missing
        },
    }


def test_table_data_orders_columns_and_averages():
    columns, rows = table_data(_results())
    assert columns == ["gsm8k", "math500", "humaneval", "mt-bench", "avg:math", "avg:code", "avg:chat", "avg:macro"]
    dspark, dflash = rows
    assert dspark["avg:math"] == pytest.approx(4.5)
    assert dspark["avg:code"] == pytest.approx(3.5)
    assert dspark["avg:chat"] == pytest.approx(2.0)
    assert dspark["avg:macro"] == pytest.approx((4.5 + 3.5 + 2.0) / 3)
    assert dflash["math500"] is None and dflash["avg:math"] is None and dflash["avg:macro"] is None
    assert dflash["avg:code"] == pytest.approx(2.5)


def test_markdown_rendering():
    text = render_markdown(_results())
    lines = text.strip().splitlines()
    assert "Target `tiny`" in lines[0] and "temperature 1.0" in lines[0] and "max new tokens 64" in lines[0]
    assert "gsm8k 3, math500 3, humaneval 4, mt-bench 2" in lines[0]
    assert lines[2] == ("| Drafter | gsm8k (math) | math500 (math) | humaneval (code) | mt-bench (chat) | Math avg "
                        "| Code avg | Chat avg | Macro |")
    assert lines[3] == "|:---|---:|---:|---:|---:|---:|---:|---:|---:|"
    assert lines[4] == "| dspark | 4.00 | 5.00 | 3.50 | 2.00 | 4.50 | 3.50 | 2.00 | 3.33 |"
    assert lines[5] == "| dflash | 3.00 | – | 2.50 | 1.50 | – | 2.50 | 1.50 | – |"


def test_csv_and_json(tmp_path):
    rows = list(csv.DictReader(io.StringIO(render_csv(_results()))))
    assert len(rows) == 2 * 8
    gsm = next(r for r in rows if r["drafter"] == "dspark" and r["benchmark"] == "gsm8k")
    assert gsm == {"drafter": "dspark", "kind": "dspark", "benchmark": "gsm8k", "domain": "math", "tau": "4",
                   "num_prompts": "3", "num_rounds": "11", "max_new_tokens": "64", "temperature": "1.0",
                   "top_k": "0", "top_p": "1.0"}
    macro = next(r for r in rows if r["drafter"] == "dspark" and r["benchmark"] == "avg:macro")
    assert float(macro["tau"]) == pytest.approx(10 / 3, rel=1e-5)
    assert next(r for r in rows if r["drafter"] == "dflash" and r["benchmark"] == "math500")["tau"] == ""
    paths = write_tables(_results(), tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert saved["drafters"]["dspark"]["benchmarks"]["gsm8k"]["tau"] == 4.0
    assert saved["table"]["rows"][0]["avg:math"] == pytest.approx(4.5)
    assert paths["markdown"].read_text() == render_markdown(_results())


def test_bad_results_are_rejected():
    bad = _results()
    bad["settings"]["benchmarks"][0]["domain"] = "poetry"
    with pytest.raises(ValueError, match="domain"):
        table_data(bad)
    empty = _results()
    empty["drafters"] = {}
    with pytest.raises(ValueError, match="drafters"):
        table_data(empty)
