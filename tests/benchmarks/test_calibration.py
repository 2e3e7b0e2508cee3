"""`deepspec bench calibration` on a tiny target: empirical labels by default, ECE before/after on held-out
rollouts (whole rollouts never split), one JSON object written and printed, the checkpoint left alone."""

from __future__ import annotations

import json

import torch

from deepspec.cache import BuildJob, build_cache
from deepspec.cache.config import CacheSchema
from deepspec.data.sources import Conversation
from deepspec.drafters.build import build_drafter

LAYERS = [0, 1, 2]


def test_bench_reports_heldout_rollouts_with_empirical_labels_by_default(tiny_llama, tmp_path, capsys):
    from deepspec.benchmarks.calibration import main

    convs = [Conversation(id=f"v{i}", messages=[{"role": "user", "content": "Tell me " + "abc " * (i + 2)},
                                                 {"role": "assistant", "content": "Sure " + "token " * (6 + i)}],
                          source="test", line=i) for i in range(6)]
    cache_dir = tmp_path / "cache"
    build_cache({"train": convs[:1], "validation": convs[1:], "test": []}, tiny_llama,
                BuildJob(CacheSchema(out_dir=str(cache_dir), layer_ids=LAYERS, max_length=64, batch_size=2,
                                     storage_dtype="fp32", shard_size_mb=1.0, progress=False)))
    torch.manual_seed(1)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=1, markov_rank=8, target_layer_ids=LAYERS,
                            block_size=4)
    with torch.no_grad():
        drafter.confidence.score.bias.fill_(2.0)  # overconfident: STS has something to fix
    drafter.save_pretrained(tmp_path / "drafter")
    before = (tmp_path / "drafter" / "config.json").read_text()
    out = tmp_path / "bench.json"
    assert main(["--drafter", str(tmp_path / "drafter"), "--cache", str(cache_dir), "--target", "tiny-random-llama",
                 "--min-samples", "5", "--max-new-tokens", "32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{\n"):]) == report
    assert report["labels"] == "empirical" and report["label_kind"] == "hard"
    assert report["num_groups"] == {"fit": 3, "heldout": 2}  # round(0.5 * 5) = 2 rollouts held out
    assert report["num_rows"]["fit"] + report["num_rows"]["heldout"] == report["num_rows"]["total"]
    assert len(report["ece_before"]) == len(report["ece_after"]) == 4
    assert (tmp_path / "drafter" / "config.json").read_text() == before
