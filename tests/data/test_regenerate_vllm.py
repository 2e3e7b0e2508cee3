"""`deepspec regenerate --backend vllm`: DeepSpec starts vLLM's real CPU server for the target, regenerates through
it and stops it; its greedy answers are the local backend's, token for token (float32, a target sharp enough that
no argmax is a near tie)."""

from __future__ import annotations

import json

import pytest

from deepspec.data.cli import main as regenerate_main
from deepspec.data.regenerate import LocalBackend, RegenerationSettings, regenerate_conversations
from deepspec.data.sources import load_jsonl

PROMPTS = [["Hello there", "And then?"], ["Write a poem about the sea"], ["What is 2 + 2?", "Why?"]]


@pytest.mark.slow
def test_regenerate_through_vllm_s_server_answers_as_the_local_backend(tmp_path, vllm_python, monkeypatch):
    from deepspec.benchmarks.interop_acceptance import sharp_qwen3_target
    from deepspec.targets.load import load_tokenizer

    monkeypatch.setenv("DEEPSPEC_VLLM_PYTHON", str(vllm_python))
    vocab = len(load_tokenizer("smollm2-135m"))
    target = sharp_qwen3_target(vocab_size=vocab, num_heads=2, num_kv_heads=1, head_dim=32)
    folder = tmp_path / "target"
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"c{k}", "turns": turns}) + "\n" for k, turns in enumerate(PROMPTS)))
    served = tmp_path / "served.jsonl"
    common = ["--greedy", "--max-new-tokens", "12", "--max-turns", "2", "--batch-size", "4"]
    assert regenerate_main(["--prompts", str(prompts), "--out", str(served), "--backend", "vllm", "--target",
                            str(folder), "--concurrency", "4", "--kv-cache-gib", "1", "--max-model-len", "512",
                            *common]) == 0

    local = tmp_path / "local.jsonl"
    conversations, _ = load_jsonl(prompts)
    regenerate_conversations(conversations, LocalBackend(target.model, target.tokenizer), local,
                             RegenerationSettings(max_new_tokens=12, batch_size=4, max_turns=2, show_progress=False))
    served_records = [json.loads(line) for line in served.read_text().splitlines()]
    local_records = [json.loads(line) for line in local.read_text().splitlines()]
    assert [r["id"] for r in served_records] == ["c0", "c1", "c2"]
    assert [r["conversations"] for r in served_records] == [r["conversations"] for r in local_records]
    assert sum(m["role"] == "assistant" for r in served_records for m in r["conversations"]) == 5
    meta = json.loads((tmp_path / "served.jsonl.meta.json").read_text())
    assert meta["backend"]["backend"] == "openai" and meta["backend"]["model"] == str(folder)
    assert "Application startup complete" in (tmp_path / "served.jsonl.vllm.log").read_text()
