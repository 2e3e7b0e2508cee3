"""`deepspec decontaminate`: training conversations that share a word 13-gram (or a whole short turn) with any
benchmark user turn are dropped, counted and named; the rest are written in order, readable by regenerate."""

from __future__ import annotations

import json

from deepspec.data.sources import Conversation, load_jsonl
from deepspec.evaluation.contamination import BenchmarkIndex, decontaminate, main

LONG = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?")


def conv(cid: str, *turns: str) -> Conversation:
    return Conversation(id=cid, messages=[{"role": "user", "content": t} for t in turns], source="p.jsonl", line=1)


def test_a_copied_window_is_caught_whatever_the_case_punctuation_or_markup():
    index = BenchmarkIndex(n=13)
    index.add(LONG, "gsm8k 'q1'")
    index.add("Compose a haiku", "mt-bench 'short'")
    copied = "Please help: **NATALIA sold clips to 48 of her friends in April,\nand then she sold half as many** ok"
    assert index.match(copied) == "gsm8k 'q1'"
    assert index.match("natalia sold clips to 48 of her friends in april and then") is None  # 12 words only
    assert index.match("Could you compose a haiku about rain?") == "mt-bench 'short'"
    assert index.match("a haiku, composed") is None


def test_every_user_turn_is_checked_and_the_dropped_are_named():
    index = BenchmarkIndex(n=13)
    index.add(LONG, "gsm8k 'q1'")
    result = decontaminate([conv("a", "hello"), conv("b", "hi", LONG), conv("c", "bye")], index)
    assert [c.id for c in result.kept] == ["a", "c"]
    assert result.dropped == [("'b' (p.jsonl:1)", "gsm8k 'q1'")]
    assert "kept 2 of 3 conversations; 1 overlap" in result.summary() and "'b' (p.jsonl:1) ~ gsm8k" in result.summary()


def test_the_command_writes_the_kept_conversations_for_regenerate(tmp_path, capsys):
    bench = tmp_path / "gsm8k.jsonl"
    bench.write_text(json.dumps({"turns": [LONG]}) + "\n")
    prompts = tmp_path / "train.jsonl"
    records = [{"id": "x", "conversations": [{"from": "human", "value": "Tell me a joke"}]},
               {"id": "y", "conversations": [{"from": "human", "value": "Solve: " + LONG}]},
               {"id": "z", "conversations": [{"from": "human", "value": "Name a colour"}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "clean.jsonl"
    assert main(["--prompts", str(prompts), "--benchmarks", str(bench), "--out", str(out), "--limit", "1"]) == 0
    assert "kept 2 of 3 conversations; 1 overlap" in capsys.readouterr().out
    kept, report = load_jsonl(out)
    assert [c.id for c in kept] == ["x"] and kept[0].messages == [{"role": "user", "content": "Tell me a joke"}]
