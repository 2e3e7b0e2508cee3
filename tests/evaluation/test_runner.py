"""Runner statistics against hand-computed values, the offline threshold sweep, a live threshold run's
losslessness, and benchmark loading (JSONL, bundled HumanEval, HF save_to_disk folders, domains)."""

import itertools
import json
from pathlib import Path

import pytest
import torch

from deepspec.decoding.loop import autoregressive_generate, speculative_generate
from deepspec.decoding.policies import threshold_policy
from deepspec.decoding.proposal import RoundRecord
from deepspec.decoding.sampling import SamplingParams
from deepspec.decoding.scheduler import static_threshold_lengths
from deepspec.decoding.verifier import TargetVerifier
from deepspec.drafters.proposers import make_proposer
from deepspec.evaluation.prompt_sets import (
    HUMANEVAL_INSTRUCTION,
    Benchmark,
    domain_of,
    load_benchmark,
    parse_domain_overrides,
)
from deepspec.evaluation.runner import (
    EvalSettings,
    RecordingProposer,
    evaluate,
    position_statistics,
    simulate_threshold_sweep,
)


def _round(proposed, accepted):
    return RoundRecord(proposed=proposed, accepted=accepted, draft_s=0.0, verify_s=0.0, drafted=proposed)


def test_position_statistics_by_hand():
    rounds = [_round(3, 0), _round(3, 1), _round(3, 3), _round(2, 2)]
    stats = position_statistics(rounds)
    assert stats["verified_counts"] == [4, 4, 3]
    assert stats["reached_counts"] == [4, 3, 1]
    assert stats["accepted_counts"] == [3, 2, 1]
    assert stats["prefix_survival"] == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert stats["conditional_acceptance"] == pytest.approx([3 / 4, 2 / 3, 1.0])


def test_threshold_sweep_by_hand():
    rounds = [_round(3, 1), _round(3, 3)]
    confidences = [[0.9, 0.4, 0.8], [0.7, 0.6, 0.2]]
    sweep = simulate_threshold_sweep(rounds, confidences, [0.0, 0.5, 0.75, 0.95])
    # t=0: l=(3,3) acc=(1,3); t=0.5: l=(1,2) acc=(1,2); t=0.75: l=(1,0) acc=(1,0); t=0.95: l=(0,0).
    assert [s["verified_per_step"] for s in sweep] == [3.0, 1.5, 0.5, 0.0]
    assert [s["accepted_per_step"] for s in sweep] == [2.0, 1.5, 0.5, 0.0]
    assert [s["tokens_per_step"] for s in sweep] == [3.0, 2.5, 1.5, 1.0]
    assert [s["rejected_per_step"] for s in sweep] == [1.0, 0.0, 0.0, 0.0]
    assert [s["acceptance_rate"] for s in sweep] == [pytest.approx(2 / 3), 1.0, 1.0, None]
    with pytest.raises(ValueError, match="confidence vectors"):
        simulate_threshold_sweep(rounds, confidences[:1], [0.5])


def test_live_threshold_run_is_lossless(tiny_drafter, tiny_llama):
    prompt = [1, 5, 5, 5, 5, 5, 5, 5]
    reference = autoregressive_generate(TargetVerifier(tiny_llama.model, []), prompt, 20,
                                        SamplingParams(temperature=0.0)).token_ids
    drafter = tiny_drafter("dspark", tiny_llama, seed=0, block_size=5)
    verifier = TargetVerifier(tiny_llama.model, drafter.config.target_layer_ids)
    for threshold in (0.5, 1.0):
        proposer = RecordingProposer(make_proposer(drafter, tiny_llama.model))
        result = speculative_generate(verifier, proposer, prompt, 20, SamplingParams(temperature=0.0),
                                      length_policy=threshold_policy(threshold))
        assert result.token_ids == reference
        # Every round but the last (cut by max_new_tokens) verifies exactly the static threshold length.
        for r, conf in zip(result.rounds[:-1], proposer.confidences):
            assert r.proposed == static_threshold_lengths([conf], threshold)[0]
        if threshold == 1.0:
            assert all(r.proposed == 0 for r in result.rounds)


def _benchmark(tokenizer_free_prompts):
    return Benchmark(name="tinybench", domain="chat", source="<test>", prompts=tokenizer_free_prompts)


def test_evaluate_matches_manual_runs(tiny_drafter, tiny_llama):
    drafter = tiny_drafter("dspark", tiny_llama, seed=0)
    prompts = [[{"role": "user", "content": "Count to five."}], [{"role": "user", "content": "Say hi."}]]
    settings = EvalSettings(max_new_tokens=10, sampling=SamplingParams(temperature=1.0), seed=5)
    results = evaluate(tiny_llama, {"d": (drafter, "<memory>")}, [_benchmark(prompts)], settings, progress=False)
    summary = results["drafters"]["d"]["benchmarks"]["tinybench"]
    # The same runs by hand: per-prompt generator seeded with seed + index.
    from deepspec.data.chat import end_of_turn_token_ids, prompt_ids

    eos = sorted(end_of_turn_token_ids(tiny_llama.tokenizer))
    verifier = TargetVerifier(tiny_llama.model, drafter.config.target_layer_ids)
    rounds = []
    for index, messages in enumerate(prompts):
        res = speculative_generate(verifier, make_proposer(drafter, tiny_llama.model),
                                   prompt_ids(tiny_llama.tokenizer, messages), 10, settings.sampling,
                                   eos_token_ids=eos, generator=torch.Generator().manual_seed(5 + index))
        rounds.extend(res.rounds)
    assert summary["num_rounds"] == len(rounds)
    assert summary["tau"] == pytest.approx(sum(r.tau for r in rounds) / len(rounds))
    assert summary["num_prompts"] == 2 and summary["domain"] == "chat" and summary["policy"] == "fixed"
    sweep = summary["threshold_sweep"]
    assert [p["threshold"] for p in sweep] == list(settings.sweep_thresholds)
    assert sweep[0]["tokens_per_step"] == pytest.approx(summary["tau"])  # threshold 0 = fixed length
    assert all(a["verified_per_step"] >= b["verified_per_step"] for a, b in itertools.pairwise(sweep))
    assert len(summary["conditional_acceptance"]) == 4
    json.dumps(results)  # plain JSON (no NaN / tensors)


def test_evaluate_refuses_template_options_other_than_the_drafters_training_data(tiny_drafter, tiny_llama):
    """A drafter trained on data rendered without options (its config) is not evaluated on prompts rendered in
    Qwen3 non-thinking mode (and the reverse); the field is named before anything runs."""
    drafter = tiny_drafter("dflash", tiny_llama, seed=0)
    prompts = [[{"role": "user", "content": "Hi."}]]
    non_thinking = EvalSettings(max_new_tokens=2, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(ValueError, match=r"target.chat_template_kwargs \(--chat-template-kwargs\)=\{'enable_thinking': "
                                         r"False\} but drafter 'd'.s training data \(its config.json\) was rendered "
                                         r"with chat_template_kwargs=\{\}"):
        evaluate(tiny_llama, {"d": (drafter, "<memory>")}, [_benchmark(prompts)], non_thinking, progress=False)
    drafter.config.chat_template_kwargs = {"enable_thinking": False}
    results = evaluate(tiny_llama, {"d": (drafter, "<memory>")}, [_benchmark(prompts)], non_thinking, progress=False)
    assert results["settings"]["chat_template_kwargs"] == {"enable_thinking": False}
    with pytest.raises(ValueError, match="rendered with chat_template_kwargs=\\{'enable_thinking': False\\}"):
        evaluate(tiny_llama, {"d": (drafter, "<memory>")}, [_benchmark(prompts)], EvalSettings(max_new_tokens=2),
                 progress=False)


def test_evaluate_live_threshold_disables_sweep_and_skips_drafters_without_head(tiny_drafter, tiny_llama):
    dspark = tiny_drafter("dspark", tiny_llama, seed=0)
    dflash = tiny_drafter("dflash", tiny_llama)
    prompts = [[{"role": "user", "content": "Hi."}]]
    settings = EvalSettings(max_new_tokens=6, sampling=SamplingParams(temperature=0.0), threshold=0.6)
    results = evaluate(tiny_llama, {"s": (dspark, "a"), "f": (dflash, "b")}, [_benchmark(prompts)], settings,
                       progress=False)
    s = results["drafters"]["s"]["benchmarks"]["tinybench"]
    f = results["drafters"]["f"]["benchmarks"]["tinybench"]
    assert s["policy"] == "threshold" and s["threshold_sweep"] is None
    assert f["policy"] == "fixed" and f["threshold_sweep"] is None
    with pytest.raises(ValueError, match="max_new_tokens"):
        EvalSettings(max_new_tokens=0)


def test_load_benchmarks(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"turns": ["q1", "follow-up"]}) + "\n\n" + json.dumps({"turns": ["q2"]}) + "\n"
                    + json.dumps({"turns": ["q3"]}) + "\n")
    bench = load_benchmark(str(path), limit=2)
    assert bench.name == "gsm8k" and bench.domain == "math"
    assert bench.prompts == [[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]]
    renamed = load_benchmark(f"mine={path}", domains={"mine": "code"})
    assert renamed.name == "mine" and renamed.domain == "code" and len(renamed.prompts) == 3
    he = load_benchmark("humaneval", limit=3)
    assert he.name == "humaneval" and he.domain == "code" and len(he.prompts) == 3
    # The first problems of the published humaneval.jsonl benchmark file, shipped with the tests: the bundled
    # problems must be wrapped exactly as there, or tau would not be comparable with tables made from that file.
    reference = Path(__file__).resolve().parents[1] / "assets" / "humaneval_first3.jsonl"
    expected = [json.loads(line)["turns"][0] for line in reference.read_text(encoding="utf-8").splitlines()]
    assert [prompt[0]["content"] for prompt in he.prompts] == expected
    assert HUMANEVAL_INSTRUCTION.startswith("Write a solution")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="num_prompts"):
        load_benchmark(str(path), limit=0)
    assert domain_of("mt-bench") == "chat" and domain_of("livecodebench_v5") == "code" and domain_of("xyz") == "other"
    assert parse_domain_overrides(["a=math"]) == {"a": "math"}
    with pytest.raises(ValueError, match="--domain"):
        parse_domain_overrides(["a=poetry"])


def test_a_benchmark_file_is_reported_once(tmp_path, caplog):
    path = tmp_path / "story.jsonl"
    path.write_text(json.dumps({"turns": ["q1"]}) + "\n" + json.dumps({"prompt": "Once"}) + "\n")
    with caplog.at_level("INFO", logger="deepspec.data.sources"):
        load_benchmark(str(path))
    assert [r.getMessage() for r in caplog.records if "loaded" in r.getMessage()] == [
        f"{path}: loaded 2, skipped 0 (malformed 0, empty 0, unknown role 0, truncated 0); duplicate ids 0; "
        "leading answers dropped 0"]


def test_load_hf_benchmark_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"question": ["What is 2+2?", "What is 3+3?"]}).save_to_disk(str(tmp_path / "ds"))
    bench = load_benchmark(f"hf:{tmp_path / 'ds'}", limit=1)
    assert bench.prompts == [[{"role": "user", "content": "What is 2+2?"}]]
    assert bench.name == "ds"
