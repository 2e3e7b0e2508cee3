"""The main job's own pieces: held-out prompts are disjoint from training prompts, train overrides validate."""

import json
from dataclasses import replace

import pytest

from deepspec.data.sources import load_sharegpt_bundled
from deepspec.pipeline import PRESETS, Pipeline, held_out_prompts


def test_held_out_prompts_never_overlap_the_regenerated_ones(tmp_path):
    used, _ = load_sharegpt_bundled(limit=40)
    path = held_out_prompts(40, tmp_path / "heldout.jsonl", num=5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 5 and all(len(r["turns"]) == 1 for r in rows)
    assert not {r["id"] for r in rows} & {c.id for c in used}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
def test_train_overrides_compose_and_validate(tmp_path, preset, kind):
    from deepspec.training.config import compose_train_config, resolve_config

    pipe = Pipeline(tmp_path, PRESETS[preset], "smollm2-135m", [kind], seed=0)
    overrides = pipe.train_overrides(kind, tmp_path / "cache", tmp_path / "train" / kind)
    cfg = resolve_config(compose_train_config(overrides))
    assert cfg.drafter.kind == kind and cfg.trainer.max_steps == PRESETS[preset].train_steps
    assert cfg.trainer.global_batch_size == PRESETS[preset].batch


def test_the_stages_choices_come_from_the_specs(tmp_path):
    """Export formats per kind for the embedded Llama-family target, calibration for confidence heads only."""
    from deepspec.export import formats_for
    from deepspec.pipeline import default_capabilities

    assert {k: formats_for(k, "llama") for k in ("dspark", "dflash", "eagle3", "mtp")} == {
        "dspark": ["hf"], "dflash": ["hf"], "eagle3": ["hf", "sglang", "vllm"], "mtp": ["hf"]}
    assert formats_for("dflash", "qwen3") == ["hf", "sglang", "vllm"]  # DFlash engine layers are Qwen3-shaped
    assert formats_for("mtp", "qwen3") == ["hf", "vllm"]  # speculators' MTP is Qwen3-only; NextN is DeepSeek-V3's
    # Eagle3 engines' fc reads exactly 3 layers: a 5-layer Eagle3 (the default) exports to hf only
    assert formats_for("eagle3", "llama", num_feature_layers=5) == ["hf"]
    assert formats_for("eagle3", "llama", num_feature_layers=3) == ["hf", "sglang", "vllm"]
    assert [k for k in ("dspark", "dflash", "eagle3", "mtp") if default_capabilities(k).confidence_head] == ["dspark"]
    assert formats_for("dspark", "qwen3", reduced_vocab=True) == ["hf"]  # engines take the whole target head
    assert formats_for("eagle3", "llama", num_feature_layers=3, reduced_vocab=True) == ["hf", "sglang", "vllm"]
    pipe = Pipeline(tmp_path, PRESETS["quick"], "smollm2-135m", ["eagle3"], seed=0)
    assert "drafter.draft_vocab_size=8192" in pipe.train_overrides("eagle3", tmp_path, tmp_path)
    dspark = pipe.train_overrides("dspark", tmp_path, tmp_path)
    from deepspec.training.presets import kind_preset_overrides

    assert set(kind_preset_overrides("dspark")) <= set(dspark) and "drafter.draft_vocab_size=8192" in dspark
    assert formats_for("dspark", "qwen3", anchor_fusion=True) == ["hf"]  # no engine reads the anchor fusion
    full = Pipeline(tmp_path, replace(PRESETS["quick"], draft_vocab=None), "smollm2-135m", ["dspark"], seed=0)
    assert not any("draft_vocab_size" in o for o in full.train_overrides("dspark", tmp_path, tmp_path))
