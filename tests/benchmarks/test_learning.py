"""The learning benchmark end to end on the tiny cache: one JSON object with floors and a curve per kind, the
PNG, and the equal budget (the same steps, batch and anchors for every kind)."""

from __future__ import annotations

import json

import pytest

from deepspec.benchmarks.learning import LearningSettings, main, train_overrides
from deepspec.training.config import compose_train_config, resolve_config


def test_every_kind_gets_the_same_budget(tmp_path):
    settings = LearningSettings(cache_dir="c", out_dir=str(tmp_path), steps=7, batch=3, anchors_per_seq=5)
    budget = {"trainer.max_steps=7", "trainer.global_batch_size=3", "data.max_anchors_per_seq=5", "data.cache_dir=c",
              "data.val_anchors_per_seq=5"}  # validation: the training anchors unless --val-anchors says otherwise
    for kind in ("dspark", "dflash", "eagle3"):
        overrides = train_overrides(settings, kind, "tiny-random-llama", tmp_path / kind)
        assert budget <= set(overrides) and f"drafter={kind}" in overrides
    assert "experiment=cpu" in train_overrides(settings, "dspark", "t", tmp_path)  # the quickstart's preset
    paper = train_overrides(settings, "dspark:paper", "t", tmp_path)
    assert "experiment=paper" in paper and "debug=benchmark" in paper  # a benchmark's run, applied over the preset
    composed = resolve_config(compose_train_config(train_overrides(settings, "dspark:paper", "smollm2-135m", tmp_path)))
    assert composed.logger.wandb is False and composed.logger.jsonl  # the budget and the logger win over the preset
    assert (composed.trainer.max_steps, composed.trainer.global_batch_size, composed.trainer.val_every) == (7, 3, 50)
    with pytest.raises(ValueError, match="unknown experiment 'fast'"):
        train_overrides(settings, "dspark:fast", "t", tmp_path)
    dense = LearningSettings(cache_dir="c", out_dir=str(tmp_path), anchors_per_seq=5, val_anchors_per_seq=64)
    assert {"data.max_anchors_per_seq=5", "data.val_anchors_per_seq=64"} <= set(train_overrides(dense, "dspark", "t",
                                                                                                  tmp_path))


@pytest.mark.slow
def test_bench_learning_writes_json_curves_and_floors(tiny_cache, tmp_path, capsys):
    out = tmp_path / "bench"
    main(["--cache", str(tiny_cache), "--out", str(out), "--kinds", "dspark", "eagle3", "--steps", "2",
          "--eval-every", "1", "--batch", "2", "--anchors", "3", "--val-anchors", "5", "--decode-prompts", "2",
          "--decode-max-new-tokens", "6"])
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # one JSON object on stdout
    result = json.loads((out / "learning.json").read_text())
    assert (out / "learning.png").stat().st_size > 0
    assert set(result["floors"]) == {"bigram", "prompt_lookup"} == set(printed["floors"])
    for floor in result["floors"].values():
        assert 1.0 <= floor["decoded_tau"]["T0"] and 1.0 <= floor["decoded_tau"]["T1"]
        assert len(floor["validation"]["top1_agreement"]) == 7
    for kind in ("dspark", "eagle3"):
        curve = result["drafters"][kind]["curve"]
        assert [p["step"] for p in curve] == [0, 1, 2]  # step 0: validated before the first step
        assert not curve[0].get("train_cpu_s") and not curve[0].get("tokens_seen")
        assert curve[-1]["train_cpu_s"] > curve[1]["train_cpu_s"] > 0
        assert curve[-1]["tokens_seen"] > curve[1]["tokens_seen"]
        assert 1.0 <= curve[-1]["tau_decoded_T0"] and "tau_gap_T1" in curve[-1]
        assert printed["drafters"][kind]["step"] == 2
    ablation = result["drafters"]["dspark"]["ablation"]  # a block drafter's input ablations; none for a chain
    assert ablation["blocks"] > 0 and 0.0 <= ablation["slot0_random_anchor"] <= 1.0
    # The floors, the curves and the ablation score the same blocks: five validation anchors per sequence.
    assert ablation["blocks"] == result["floors"]["bigram"]["validation"]["num_blocks"]
    assert result["drafters"]["eagle3"]["ablation"] is None
    # What the quickstart prints: the drafter's last validation slot 0 next to its cache's bigram floor.
    from deepspec.benchmarks.learning import drafter_against_floors

    checkpoint = sorted((out / "dspark" / "checkpoints").glob("step-*"))[-1]
    row = drafter_against_floors(tiny_cache, out / "dspark", checkpoint, anchors_per_seq=5)
    assert row["drafter_slot0"] == curve_slot0(result, "dspark")
    assert row["bigram_slot0"] == result["floors"]["bigram"]["validation"]["top1_agreement"][0]
    assert row["ablation"]["blocks"] == ablation["blocks"]


def curve_slot0(result: dict, kind: str) -> float:
    return result["drafters"][kind]["curve"][-1]["top1_agreement"][0]
