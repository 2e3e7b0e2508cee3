"""`deepspec bench regenerate`'s measurement and comparison (deepspec.benchmarks.regenerate), against a local
OpenAI-compatible server; the real vLLM server runs in tests/data/test_regenerate_vllm.py."""

from __future__ import annotations

import json

from deepspec.benchmarks.regenerate import answers, timed_regeneration
from deepspec.data.openai_backend import OpenAIChatBackend
from deepspec.data.sources import Conversation


def test_the_timed_regeneration_counts_the_server_s_tokens_and_the_answers_are_read_per_conversation(
        chat_server, tmp_path):
    def respond(handler, body):
        words = body["messages"][-1]["content"].split()
        handler.reply(200, {"choices": [{"message": {"role": "assistant", "content": " ".join(reversed(words))},
                                         "finish_reason": "length" if len(words) > 2 else "stop"}],
                            "usage": {"completion_tokens": len(words)}})

    server = chat_server(respond)
    backend = OpenAIChatBackend(server.url + "/v1", "tgt", concurrency=2)
    prompts = ["one two three", "four five", "six"]
    conversations = [Conversation(id=f"c{i}", messages=[{"role": "user", "content": p}], source="p.jsonl", line=i)
                     for i, p in enumerate(prompts)]
    calls = iter([10.0, 12.5])  # another process's CPU-seconds before and after
    result = timed_regeneration(conversations, backend, tmp_path / "out.jsonl", max_new_tokens=8, batch_size=3,
                                extra_cpu=lambda: next(calls))
    assert (result["tokens"], result["turns"]) == (6, 3)
    assert result["finish_reasons"] == {"length": 1, "stop": 2}
    assert result["cpu_s"] >= 2.5 and result["tokens_per_cpu_s"] <= 6 / 2.5
    assert result["tokens_per_s"] > 0 and result["wall_s"] >= 0
    assert answers(tmp_path / "out.jsonl") == {"c0": ["three two one"], "c1": ["five four"], "c2": ["six"]}
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["id"] == "c0"
