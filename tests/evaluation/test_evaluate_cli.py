"""eval/evaluate.py end to end on a tiny random target saved to disk with tiny random drafter checkpoints."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from deepspec.benchmarks.speed import main as bench_speed
from deepspec.drafters.build import build_drafter

REPO = Path(__file__).resolve().parents[2]


def _cli():
    spec = importlib.util.spec_from_file_location("deepspec_eval_cli", REPO / "eval" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evaluate_cli_end_to_end(saved_eval_setup, capsys):
    root, target_dir, prompts = saved_eval_setup
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


def test_evaluate_cli_rejects_bad_input(saved_eval_setup):
    root, target_dir, prompts = saved_eval_setup
    cli = _cli()
    with pytest.raises(FileNotFoundError, match="not a saved drafter directory"):
        cli.main(["--target", str(target_dir), "--drafter", str(root / "missing"), "--benchmarks", str(prompts)])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        cli.main(["--target", str(target_dir), "--drafter", str(root / "dspark"),
                  "--benchmarks", str(root / "missing.jsonl")])
    with pytest.raises(ValueError, match="two drafters named"):
        cli.main(["--target", str(target_dir), "--drafter", f"a={root / 'dspark'}", f"a={root / 'eagle'}",
                  "--benchmarks", str(prompts)])


def test_standalone_drafters_saved_or_wrapped(saved_eval_setup):
    """A saved standalone drafter folder and `standalone:MODEL` (any causal LM folder with the target's tokenizer,
    e.g. a causal_lm export) in evaluate.py and `deepspec bench speed`; its confidences feed the threshold sweep."""
    from deepspec.targets.load import load_target
    from deepspec.targets.tiny import build_tiny_model

    root, target_dir, prompts = saved_eval_setup
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
    assert bench_speed(["--target", str(target_dir), "--drafter", f"wrapped=standalone:{root / 'small_lm'}",
                         "--benchmark", str(prompts), "--num-prompts", "1", "--max-new-tokens", "6",
                         "--temperatures", "0",
                         "--device", "cpu", "--out", str(root / "speed.json")]) == 0
    assert json.loads((root / "speed.json").read_text())["drafters"]["wrapped"]["T=0"]["tau"] >= 1.0


def test_prompt_lookup_or_the_drafter_in_bench_speed_and_evaluate(saved_eval_setup, tiny_llama):
    """A calibrated drafter carrying prompt lookup's acceptance gets a `NAME+lookup` row in bench speed (next to prompt
    lookup in DeepSpec's loop, with its tau), and evaluate --with-prompt-lookup reports the share of lookup rounds."""
    from deepspec.decoding.lookup import LookupAcceptance

    root, target_dir, prompts = saved_eval_setup
    torch.manual_seed(0)
    drafter = build_drafter("dspark", tiny_llama, num_draft_layers=1, markov_rank=16, block_size=4)
    drafter.config.prompt_lookup_acceptance = LookupAcceptance(3, 4, [[900] * 4] * 3, [[1000] * 4] * 3).to_dict()
    drafter.save_pretrained(root / "dspark_lookup")
    out = root / "speed_lookup.json"
    assert bench_speed(["--target", str(target_dir), "--drafter", f"d={root / 'dspark_lookup'}", str(root / "dspark"),
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
