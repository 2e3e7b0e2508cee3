"""`deepspec bench speed` on a tiny target saved to disk: tokens per second of the drafter and of its baselines,
and each speedup against the baseline its name says."""

from __future__ import annotations

import json

import pytest

from deepspec.benchmarks.speed import main


def test_bench_speed_cli_smoke(saved_eval_setup):
    root, target_dir, prompts = saved_eval_setup
    out = root / "speed.json"
    assert main(["--target", str(target_dir), "--drafter", str(root / "dspark"), "--benchmark", str(prompts),
                 "--num-prompts", "1", "--max-new-tokens", "6", "--temperatures", "0", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["baselines"]) == {"T=0", "T=1"}
    for key in ("T=0", "T=1"):
        base = report["baselines"][key]
        assert base["ar_loop"]["tokens_per_s"] > 0 and base["ar_loop"]["step_ms"] > 0
        assert "tokens_per_s" in base["hf_generate"] or "error" in base["hf_generate"]
        entry = report["drafters"]["dspark"][key]
        for field in ("tau", "tokens_per_s", "speedup_vs_ar", "speedup_vs_prompt_lookup", "draft_ms_per_round",
                      "verify_ms_per_round", "ceiling_speedup"):
            assert entry[field] is not None and entry[field] > 0, field
        assert 1.0 <= entry["tau"] <= 5.0
        # each speedup is against the baseline its name says: our loop's prompt lookup, and transformers'
        assert entry["speedup_vs_prompt_lookup"] == pytest.approx(
            entry["tokens_per_s"] / base["prompt_lookup"]["tokens_per_s"])
        if "tokens_per_s" in base["hf_prompt_lookup"]:
            assert entry["speedup_vs_hf_prompt_lookup"] == pytest.approx(
                entry["tokens_per_s"] / base["hf_prompt_lookup"]["tokens_per_s"])
        assert entry["ceiling_speedup"] == pytest.approx(
            entry["tau"] / (entry["verify_cost_ratio"] + entry["draft_cost_ratio"]))
    with pytest.raises(ValueError, match="max-new-tokens"):
        main(["--target", str(target_dir), "--benchmark", str(prompts), "--max-new-tokens", "1"])
