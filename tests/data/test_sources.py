"""Prompt sources (JSONL, truncated JSON arrays, bundled ShareGPT, HF datasets) and the id-hash split."""

import io
import json
import logging

import pytest

from deepspec.data.sources import (
    Conversation,
    LoadReport,
    iter_json_array,
    load_hf_dataset,
    load_json_array,
    load_jsonl,
    load_prompts,
    load_sharegpt_bundled,
)
from deepspec.data.split import split_conversations

GOOD_RECORDS = [
    {"id": "a", "conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "r"}]},
    {"turns": ["first", "second"]},
    {"id": 7, "messages": [{"role": "system", "content": "s"}, {"role": "User", "content": "u"},
                           {"from": "chatgpt", "value": "c"}, {"role": "model", "content": "m"}]},
]


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_load_jsonl_formats_and_role_normalisation(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in GOOD_RECORDS])
    convs, report = load_jsonl(path)
    assert report.num_loaded == 4 and report.num_skipped == 0 and report.problems == []
    assert [c.id for c in convs] == ["a", "p:2", "p:3", "7"]
    assert [c.line for c in convs] == [1, 2, 3, 4]
    assert convs[1].messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]
    assert convs[2].messages == [{"role": "user", "content": "first"}, {"role": "user", "content": "second"}]
    assert [m["role"] for m in convs[3].messages] == ["system", "user", "assistant", "assistant"]
    assert all(c.source == "p.jsonl" for c in convs)


def test_load_jsonl_reports_every_bad_line(tmp_path, caplog):
    lines = [
        json.dumps(GOOD_RECORDS[0]),
        "{not json",
        "[1, 2]",
        "",  # blank lines are ignored, not errors
        json.dumps({"conversations": []}),
        json.dumps({"conversations": [{"role": "user", "content": "  "}]}),
        json.dumps({"conversations": [{"role": "narrator", "content": "x"}]}),
        json.dumps({"conversations": [{"role": "user", "content": 5}]}),
        json.dumps({"body": "no conversation or text field"}),
        json.dumps({"turns": "not a list"}),
        json.dumps(GOOD_RECORDS[2]),
    ]
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with caplog.at_level(logging.WARNING):
        convs, report = load_jsonl(path)
    assert [c.line for c in convs] == [1, 11]
    assert (report.num_loaded, report.num_malformed, report.num_empty, report.num_unknown_role) == (2, 5, 2, 1)
    where = [p.split(": ")[0] for p in report.problems]
    assert where == [f"{path}:{n}" for n in (2, 3, 5, 6, 7, 8, 9, 10)]
    assert "unknown role 'narrator'" in report.problems[4]
    assert "skipped 8" in report.summary() and "bad.jsonl:2" in caplog.text


@pytest.mark.parametrize("key", ["conversations", "messages"])
def test_a_malformed_record_is_named_by_the_key_it_used(tmp_path, key):
    _, report = load_jsonl(write_lines(tmp_path / "p.jsonl", [json.dumps({key: "not a list"})]))
    assert report.problems == [f"{tmp_path / 'p.jsonl'}:1: '{key}' must be a list"]


def test_bad_bytes_and_a_cut_off_last_line_are_counted_with_path_line(tmp_path):
    path = tmp_path / "mixed.jsonl"
    good = json.dumps(GOOD_RECORDS[0]).encode()
    bad_byte = json.dumps({"turns": ["caf\u00e9"]}).encode().replace(b"\\u00e9", b"\xe9")  # latin-1, not UTF-8
    path.write_bytes(good + b"\n" + bad_byte + b"\n" + good + b"\n" + good[:20])  # killed mid-write
    convs, report = load_jsonl(path)
    assert [c.line for c in convs] == [1, 3]
    assert (report.num_malformed, report.num_truncated) == (1, 1)
    assert report.problems == [f"{path}:2: not valid UTF-8 (byte 0xe9 at column 16)",
                               f"{path}:4: the file ends inside this record (Unterminated string starting at)"]

    array = tmp_path / "mixed.json"
    array.write_bytes(b"[" + good + b", " + bad_byte + b", " + good + b"]")
    convs, report = load_json_array(array)
    assert len(convs) == 2 and report.problems == [f"{array}[1]: not valid UTF-8"]


def test_empty_prompt_file_is_refused_by_require_conversations(tmp_path):
    from deepspec.data.sources import require_conversations

    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    convs, report = load_jsonl(path)
    with pytest.raises(ValueError, match=rf"data.prompts='{path}': no usable conversation"):
        require_conversations(convs, report, "data.prompts")


def test_problem_list_is_capped_but_all_counted(tmp_path):
    path = write_lines(tmp_path / "many.jsonl", ["oops"] * 60)
    _, report = load_jsonl(path)
    assert report.num_malformed == 60 and len(report.problems) == 50
    assert "(10 more)" in report.summary()


def test_truncated_json_array_keeps_complete_elements(tmp_path):
    text = json.dumps([GOOD_RECORDS[0], GOOD_RECORDS[1], GOOD_RECORDS[3], GOOD_RECORDS[2]], indent=2)
    cut = text[:text.index('"second"')]  # file ends inside the 4th element
    report = LoadReport()
    # A tiny chunk size exercises the sliding buffer across element boundaries.
    elements = list(iter_json_array(io.StringIO(cut), "mem", report, chunk_chars=7))
    assert [e for _, e in elements] == [GOOD_RECORDS[0], GOOD_RECORDS[1], GOOD_RECORDS[3]]
    assert report.num_truncated == 1 and "mem[3]: file ends inside this element" in report.problems[0]

    whole = list(iter_json_array(io.StringIO(text), "mem", LoadReport(), chunk_chars=5))
    assert [e for _, e in whole] == [GOOD_RECORDS[0], GOOD_RECORDS[1], GOOD_RECORDS[3], GOOD_RECORDS[2]]

    (tmp_path / "cut.json").write_text(cut)
    convs, file_report = load_json_array(tmp_path / "cut.json")
    assert [c.id for c in convs] == ["a", "cut.json:1", "7"] and file_report.num_truncated == 1
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="expected a JSON array"):
        load_json_array(tmp_path / "obj.json")


def test_bundled_sharegpt_recovers_complete_conversations():
    convs, report = load_sharegpt_bundled()
    # 17,671 complete records before the cut; 6,358 chunks start with an answer (dropped, counted);
    # 274 have no non-empty user/assistant message left.
    assert report.num_loaded == 17397 and report.num_empty == 274 and report.num_truncated == 1
    assert report.num_leading_answers_dropped == 6358
    assert report.num_malformed == 0 and report.num_unknown_role == 0
    assert convs[0].id == "QWJhYvA_0" and convs[0].source == "sharegpt"
    assert convs[0].messages[0]["role"] == "user" and convs[0].messages[1]["role"] == "assistant"
    assert {m["role"] for c in convs for m in c.messages} == {"user", "assistant", "system"}
    few, few_report = load_sharegpt_bundled(limit=5)
    assert [c.id for c in few] == [c.id for c in convs[:5]] and few_report.num_truncated == 0


def test_hf_dataset_from_disk_and_json_builder(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "x", "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]},
            {"id": "y", "messages": [{"role": "user", "content": "bye"}]}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    convs, report = load_hf_dataset(str(tmp_path / "ds"))
    assert [c.id for c in convs] == ["x", "y"] and report.num_loaded == 2
    assert convs[0].messages[1] == {"role": "assistant", "content": "hi"}

    write_lines(tmp_path / "d.jsonl", [json.dumps({"turns": ["a", "b"]}), json.dumps({"turns": ["c"]})])
    convs, _ = load_hf_dataset("json", data_files=str(tmp_path / "d.jsonl"), field="turns")
    assert [c.messages[-1]["content"] for c in convs] == ["b", "c"] and convs[0].id.startswith("hf:json:train:")
    with pytest.raises(ValueError, match="no field 'chat'"):
        load_hf_dataset(str(tmp_path / "ds"), field="chat")


def test_load_prompts_dispatch(tmp_path):
    jsonl = write_lines(tmp_path / "a.jsonl", [json.dumps(r) for r in GOOD_RECORDS])
    (tmp_path / "b.json").write_text(json.dumps(GOOD_RECORDS))
    assert [c.id for c in load_prompts(str(jsonl), limit=2)[0]] == ["a", "a:2"]
    assert len(load_prompts(str(tmp_path / "b.json"))[0]) == 4
    assert len(load_prompts("sharegpt", limit=3)[0]) == 3
    with pytest.raises(ValueError, match="prompt source 'data.csv'"):
        load_prompts("data.csv")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="hf:<dataset name>"):
        load_prompts("hf:")


def make_convs(n, offset=0):
    return [Conversation(id=f"c{k}", messages=[{"role": "user", "content": str(k)}], source="t", line=k)
            for k in range(offset, offset + n)]


def test_split_is_deterministic_stable_and_complete():
    convs = make_convs(2000)
    splits = split_conversations(convs, seed=3, val_fraction=0.1, test_fraction=0.05)
    ids = {name: [c.id for c in part] for name, part in splits.items()}
    assert sorted(i for part in ids.values() for i in part) == sorted(c.id for c in convs)  # disjoint and complete
    assert 140 <= len(ids["validation"]) <= 260 and 60 <= len(ids["test"]) <= 140
    assert ids == {k: [c.id for c in v] for k, v in split_conversations(convs, 3, 0.1, 0.05).items()}
    # Adding conversations (and reordering) never moves an existing one to another split.
    grown = split_conversations(make_convs(500, offset=2000) + convs[::-1], seed=3, val_fraction=0.1,
                                test_fraction=0.05)
    for name, part_ids in ids.items():
        assert set(part_ids) <= {c.id for c in grown[name]}
    other_seed = split_conversations(convs, seed=4, val_fraction=0.1, test_fraction=0.05)
    assert [c.id for c in other_seed["validation"]] != ids["validation"]
    with pytest.raises(ValueError, match="val_fraction"):
        split_conversations(convs, 0, val_fraction=-0.1, test_fraction=0.0)
    with pytest.raises(ValueError, match="leaves no training data"):
        split_conversations(convs, 0, val_fraction=0.5, test_fraction=0.5)


def test_leading_answer_of_a_sharegpt_chunk_is_dropped_and_counted(tmp_path):
    import json

    from deepspec.data.sources import load_jsonl

    path = tmp_path / "chunks.jsonl"
    rows = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "tail of an answer"},
                                      {"from": "human", "value": "next question"},
                                      {"from": "gpt", "value": "next answer"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only an answer"}]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    convs, report = load_jsonl(path)
    assert [c.id for c in convs] == ["a"]
    assert [m["role"] for m in convs[0].messages] == ["user", "assistant"]
    assert report.num_leading_answers_dropped == 2 and report.num_empty == 1
