"""eval/evaluate.py end to end on a tiny random target saved to disk with tiny random drafter checkpoints."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deepspec.drafters.build import build_drafter

REPO = Path(__file__).resolve().parents[2]


def _cli():
    spec = importlib.util.spec_from_file_location("deepspec_eval_cli", REPO / "eval" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def saved_setup(tiny_drafter, tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("eval_cli")
    target_dir = root / "target"
    tiny_llama.model.save_pretrained(target_dir)
    tiny_llama.tokenizer.save_pretrained(target_dir)
    tiny_drafter("dspark", tiny_llama, seed=0).save_pretrained(root / "dspark")
    build_drafter("eagle3", tiny_llama).save_pretrained(root / "eagle")
    prompts = root / "mt-bench.jsonl"
    prompts.write_text(json.dumps({"turns": ["Tell me a joke.", "Another one."]}) + "\n"
                       + json.dumps({"turns": ["Name three colours."]}) + "\n")
    return root, target_dir, prompts


def test_evaluate_cli_end_to_end(saved_setup, capsys):
    root, target_dir, prompts = saved_setup
    out = root / "out"
    code = _cli().main(["--target", str(target_dir), "--drafter", str(root / "dspark"), f"e3={root / 'eagle'}",
                        "--benchmarks", str(prompts), "--num-prompts", "2", "--max-new-tokens", "8",
                        "--device", "cpu", "--seed", "1", "--no-progress", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| Drafter | mt-bench (chat) | Chat avg | Macro |" in printed
    for name in ("table.md", "results.json", "results.csv", "positions.png", "threshold_sweep_dspark.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert not (out / "threshold_sweep_e3.png").exists()  # Eagle3 has no confidence head
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["temperature"] == 1.0 and results["settings"]["max_new_tokens"] == 8
    assert set(results["drafters"]) == {"dspark", "e3"}
    bench = results["drafters"]["dspark"]["benchmarks"]["mt-bench"]
    assert bench["num_prompts"] == 2 and bench["num_rounds"] >= 1 and 1.0 <= bench["tau"] <= 5.0
    assert (out / "table.md").read_text() in printed


def test_evaluate_cli_rejects_bad_input(saved_setup):
    root, target_dir, prompts = saved_setup
    cli = _cli()
    with pytest.raises(FileNotFoundError, match="not a saved drafter directory"):
        cli.main(["--target", str(target_dir), "--drafter", str(root / "missing"), "--benchmarks", str(prompts)])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        cli.main(["--target", str(target_dir), "--drafter", str(root / "dspark"),
                  "--benchmarks", str(root / "missing.jsonl")])
    with pytest.raises(ValueError, match="two drafters named"):
        cli.main(["--target", str(target_dir), "--drafter", f"a={root / 'dspark'}", f"a={root / 'eagle'}",
                  "--benchmarks", str(prompts)])


def test_bench_speed_cli_smoke(saved_setup):
    root, target_dir, prompts = saved_setup
    spec = importlib.util.spec_from_file_location("deepspec_bench_speed", REPO / "eval" / "bench_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = root / "speed.json"
    assert bench.main(["--target", str(target_dir), "--drafter", str(root / "dspark"), "--benchmark", str(prompts),
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
        bench.main(["--target", str(target_dir), "--benchmark", str(prompts), "--max-new-tokens", "1"])


def test_standalone_drafters_saved_or_wrapped(saved_setup):
    """A saved standalone drafter folder and `standalone:MODEL` (any causal LM folder with the target's tokenizer,
    e.g. a causal_lm export) in evaluate.py and bench_speed.py; its confidences feed the threshold sweep."""
    from deepspec.targets.load import load_target
    from deepspec.targets.tiny import build_tiny_model

    root, target_dir, prompts = saved_setup
    build_tiny_model("qwen3", vocab_size=49152, seed=4).save_pretrained(root / "small_lm")
    for item in target_dir.iterdir():  # the target's tokenizer files
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (root / "small_lm" / item.name).write_bytes(item.read_bytes())
    torch.manual_seed(0)
    build_drafter("standalone", load_target(str(target_dir), device="cpu"), num_draft_layers=1,
                  num_speculative_tokens=3).save_pretrained(root / "standalone")
    out = root / "out_standalone"
    assert _cli().main(["--target", str(target_dir), "--drafter", str(root / "standalone"),
                        f"wrapped=standalone:{root / 'small_lm'}", "--benchmarks", str(prompts), "--num-prompts", "1",
                        "--max-new-tokens", "8", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    for name in ("standalone", "wrapped"):
        entry = results["drafters"][name]
        assert entry["kind"] == "standalone" and entry["confidence_head"]
        assert entry["benchmarks"]["mt-bench"]["threshold_sweep"] and entry["benchmarks"]["mt-bench"]["num_rounds"] >= 1
    # A wrapped model read no cache: any template options render the prompts; a saved drafter's must match its data.
    options = ["--chat-template-kwargs", '{"enable_thinking": false}', "--benchmarks", str(prompts), "--num-prompts",
               "1", "--max-new-tokens", "4", "--device", "cpu", "--no-progress", "--out", str(root / "out_options")]
    assert _cli().main(["--target", str(target_dir), "--drafter", f"wrapped=standalone:{root / 'small_lm'}",
                        *options]) == 0
    with pytest.raises(ValueError, match="drafter 'standalone'.s training data"):
        _cli().main(["--target", str(target_dir), "--drafter", str(root / "standalone"), *options])
    spec = importlib.util.spec_from_file_location("deepspec_bench_speed", REPO / "eval" / "bench_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--target", str(target_dir), "--drafter", f"wrapped=standalone:{root / 'small_lm'}",
                       "--benchmark", str(prompts), "--num-prompts", "1", "--max-new-tokens", "6",
                       "--temperatures", "0",
                       "--device", "cpu", "--out", str(root / "speed.json")]) == 0
    assert json.loads((root / "speed.json").read_text())["drafters"]["wrapped"]["T=0"]["tau"] >= 1.0


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


def test_prompt_lookup_or_the_drafter_in_bench_speed_and_evaluate(saved_setup, tiny_llama):
    """A calibrated drafter carrying prompt lookup's acceptance gets a `NAME+lookup` row in bench speed (next to prompt
    lookup in DeepSpec's loop, with its tau), and evaluate --with-prompt-lookup reports the share of lookup rounds."""
    from deepspec.decoding.lookup import LookupAcceptance

    root, target_dir, prompts = saved_setup
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=1, markov_rank=16, block_size=4)
    drafter.config.prompt_lookup_acceptance = LookupAcceptance(3, 4, [[900] * 4] * 3, [[1000] * 4] * 3).to_dict()
    drafter.save_pretrained(root / "dspark_lookup")
    spec = importlib.util.spec_from_file_location("deepspec_bench_speed", REPO / "eval" / "bench_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = root / "speed_lookup.json"
    assert bench.main(["--target", str(target_dir), "--drafter", f"d={root / 'dspark_lookup'}", str(root / "dspark"),
                       "--benchmark", str(prompts), "--num-prompts", "1", "--max-new-tokens", "12", "--temperatures",
                       "0", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["drafters"]) == {"d", "d+lookup", "dspark"}  # the uncalibrated one gets no +lookup row
    lookup = report["baselines"]["T=0"]["prompt_lookup"]
    assert lookup["tau"] >= 1.0 and lookup["tokens_per_s"] > 0
    combined = report["drafters"]["d+lookup"]["T=0"]
    assert combined["tau"] >= 1.0 and 0.0 <= combined["lookup_round_share"] <= 1.0
    out_dir = root / "eval_lookup"
    assert _cli().main(["--target", str(target_dir), "--drafter", f"d={root / 'dspark_lookup'}", "--benchmarks",
                        str(prompts), "--num-prompts", "1", "--max-new-tokens", "8", "--temperature", "0",
                        "--with-prompt-lookup", "--device", "cpu", "--no-progress", "--out", str(out_dir)]) == 0
    results = json.loads((out_dir / "results.json").read_text())
    assert results["settings"]["with_prompt_lookup"] is True
    assert 0.0 <= results["drafters"]["d"]["benchmarks"]["mt-bench"]["lookup_round_share"] <= 1.0
