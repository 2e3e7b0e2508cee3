"""`deepspec bench serve`: vLLM's CPU build decodes with DeepSpec's exports, losslessly, and accepts what DeepSpec's
loop accepts on the same prompts.

The slow test is the smallest real case: a tiny sharp Qwen3 target saved to a folder (head_dim 32: vLLM's CPU
attention has no kernel below 32), DFlash, EAGLE-3 and a standalone LM trained on the target's own greedy
continuations until they accept well above chance, and a DSpark that vLLM's CPU model runner refuses. The DFlash
has one layer: vLLM's CPU build normalises every DFlash layer's context keys with the first layer's k-norm
(docs/results.md), so a deeper one drafts differently there (still losslessly). It needs vLLM's own environment
(`scripts/bootstrap_vllm.sh`, which `scripts/bootstrap.sh` runs).
"""

from __future__ import annotations

import pytest

from deepspec.benchmarks import serve


# -- the comparison, without an engine ------------------------------------------------------------------------
def test_engine_steps_count_only_what_reached_the_output():
    # 1 prefill token, then steps of 3 + 1; the third step would add 4 but only 2 fit in 10 tokens, the fourth none.
    assert serve.emitted_per_step([3, 3, 3, 5], num_tokens=10) == [4, 4, 1]
    assert serve.emitted_per_step([0, 0], num_tokens=1) == []


def _engine(per_prompt_steps, num_tokens):
    return {"prompts": [{"token_ids": list(range(num_tokens)), "spec": {"per_step_accepted": steps}}
                        for steps in per_prompt_steps], "counters": {}}


def _ours(per_prompt_rounds, num_tokens):
    return [{"token_ids": list(range(num_tokens)), "accepted": rounds} for rounds in per_prompt_rounds]


def test_acceptance_comparison_counts_equal_steps_and_both_taus():
    # vLLM accepted 4 drafts in its last step, of which 1 fit before max_tokens: our loop verified that one only.
    report = serve.acceptance_comparison(_engine([[2, 0, 3, 4]], 10), _ours([[2, 1, 3]], 10))
    assert report["engine_mean_accepted_length"] == pytest.approx(1 + 9 / 4)  # vLLM's own figure
    assert report["engine_tau"] == pytest.approx((3 + 1 + 4 + 1) / 4)
    assert report["deepspec_tau"] == pytest.approx((3 + 2 + 4) / 3)
    assert (report["steps_compared"], report["steps_equal"]) == (3, 2)  # the second step differs
    assert report["deepspec_tokens_equal_engine"]


def test_engine_refusal_is_one_line_without_pydantic_noise():
    result = {"error_type": "ValidationError",
              "error": "1 validation error for VllmConfig\n  Value error, Model Runner V1 does not support: dspark "
                       "speculative decoding [type=value_error, input_value=ArgsKwargs((), {...})]\n    For further"}
    line = serve.engine_refusal(result)
    assert line == "ValidationError: 1 validation error for VllmConfig Value error, Model Runner V1 does not " \
                   "support: dspark speculative decoding"


def test_engine_refusal_names_registered_choices_without_their_reprs():
    result = {"error_type": "ValidationError", "error": "1 validation error for SpeculativeConfig\n  Value error, "
              "Expected one of: {'eagle3': <function update_eagle3 at 0x7f8d9ad2fec0>, 'dflash': <function "
              "update_dflash at 0x7f8d9ad50040>}. Please ensure [type=value_error]"}
    assert serve.engine_refusal(result).endswith("Value error, Expected one of: {eagle3, dflash}. Please ensure")


def test_a_missing_engine_environment_names_the_script_that_makes_it(tmp_path, monkeypatch):
    monkeypatch.delenv(serve.VLLM_PYTHON_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match="bootstrap_vllm.sh"):
        serve.vllm_python(str(tmp_path / "no-python"))


def test_a_drafter_with_no_layout_vllm_reads_is_named_with_deepspec_s_reason(tiny_llama, tmp_path):
    from deepspec.drafters.build import build_drafter

    target = tiny_llama  # a Llama-layered DSpark: vLLM's DSpark model is Qwen3-layered
    drafter = build_drafter("dspark", target)
    exported, refusals = serve.export_for_vllm("dspark", drafter, target, "unused", tmp_path)
    assert exported == []
    assert [(r["drafter"], r["layout"], r["by"]) for r in refusals] == [("dspark", "vllm", "deepspec export")]
    assert refusals[0]["reason"]


# -- the engine -------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_vllm_serves_our_exports_losslessly_and_accepts_what_our_loop_accepts(tmp_path, vllm_python):
    from deepspec.benchmarks import interop_acceptance as tiny
    from deepspec.drafters.build import build_drafter

    python = vllm_python
    target = tiny.sharp_qwen3_target(num_heads=2, num_kv_heads=1, head_dim=32)
    folder = tmp_path / "target"
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    vocab = target.model.config.vocab_size
    prompts = tiny.random_prompts(4, vocab)
    sequences = [p + c for p, c in zip(prompts, tiny.greedy_continuations(target, prompts, 40))]
    drafters = {
        "dflash": tiny.train_drafter("dflash", target, sequences, 250, block_size=7, num_draft_layers=1,
                                     init_from_target=True)[0],
        "eagle3": tiny.train_drafter("eagle3", target, sequences, 250, ttt_steps=4)[0],
        "standalone": tiny.train_drafter("standalone", target, sequences, 250, num_draft_layers=1,
                                         num_speculative_tokens=4)[0],
        "dspark": build_drafter("dspark", target, target_layer_ids=tiny.LAYER_IDS),  # refused by the engine
    }
    settings = serve.ServeSettings(max_new_tokens=32)
    report = serve.serve_and_compare(target, str(folder), drafters, prompts, [], settings, python, tmp_path / "runs")

    served = report["served"]
    assert set(served) == {"dflash vllm", "eagle3 vllm", "standalone causal_lm"}, report["refused"]
    for name, row in served.items():
        assert row["lossless"], (name, row)
        assert row["deepspec_tokens_equal_engine"], (name, row)
        # The same drafts, so the same tokens per step, step for step (the engine's steps cut at the output's end).
        assert row["steps_equal"] == row["steps_compared"] == row["deepspec_rounds"] == row["engine_steps"] > 0, \
            (name, row)
        assert row["relative_difference"] == 0, (name, row)
    assert served["dflash vllm"]["deepspec_tau"] >= 2.0, served["dflash vllm"]  # an untrained drafter: ~1.0
    assert report["vllm_ngram"]["lossless"]
    (dspark,) = [r for r in report["refused"] if r["drafter"] == "dspark"]
    assert dspark["by"] == "vllm" and "dspark" in dspark["reason"], dspark
