"""`deepspec bench standalone`: a tiny standalone drafter trained on a top-k cache, then measured on the cache's
held-out prompts."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_bench_standalone_smoke(tmp_path):
    """A tiny training run (standalone on a top-k cache) through train.py, then bench_speed on the cache's held-out
    chat prompts: the JSON has every number the comparison reports (DSpark runs take the same path)."""
    from deepspec.benchmarks.standalone import main
    from deepspec.cache import BuildJob, build_cache
    from deepspec.cache.config import CacheSchema
    from deepspec.data.sources import Conversation
    from deepspec.targets.load import make_tiny_target

    target = make_tiny_target("llama")
    convs = [Conversation(id=f"c{i}", messages=[{"role": "user", "content": f"Question {i}: " + "topic " * (i % 4 + 1)},
                                                {"role": "assistant", "content": "An answer " + "word " * (i % 5 + 2)}],
                          source="t", line=i) for i in range(12)]
    source = {"prompts": str(tmp_path / "data.jsonl"), "limit": None, "seed": 0, "val_fraction": 0.25,
              "test_fraction": 0.0}
    (tmp_path / "data.jsonl").write_text(
        "\n".join(json.dumps({"id": c.id, "conversations": c.messages}) for c in convs))
    from deepspec.cache.pipeline import load_and_split

    splits, source = load_and_split(source)
    build_cache(splits, target, BuildJob(CacheSchema(out_dir=str(tmp_path / "topk"), layer_ids=[], max_length=48,
                                                     storage_dtype="fp32", progress=False, content="top_k_logprobs",
                                                     top_k=8), source=source))
    out = tmp_path / "bench"
    assert main(["--target", "tiny-random-llama", "--out-dir", str(out), "--num-prompts", "1", "--max-new-tokens", "4",
                 "--temperatures", "0", "--benchmark", "chat",
                 "--run", f"sa:standalone:{tmp_path / 'topk'}:drafter.num_draft_layers=1",
                 "--train-overrides", "trainer.max_steps=2", "trainer.global_batch_size=2",
                 "trainer.micro_batch_size=2",
                 "calibration.enabled=false", "deepspeed=zero1"]) == 0
    report = json.loads((out / "bench_standalone.json").read_text())
    assert report["runs"]["sa"]["cache"]["content"] == "top_k_logprobs"
    assert report["runs"]["sa"]["cache"]["bytes_per_token"] == 4 + 1 + 8 * 8
    run = report["runs"]["sa"]
    assert run["steps"] == 2 and run["cpu_seconds"] > 0 and run["tokens_seen"] > 0 and run["validation"]["tau_sim"] >= 1
    assert report["speed"]["chat"]["drafters"]["sa"]["T=0"]["tau"] >= 1.0
    assert (out / "chat_heldout.jsonl").read_text().count("turns") == len(splits["validation"])
