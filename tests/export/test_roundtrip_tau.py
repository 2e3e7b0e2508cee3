"""Export -> re-read the layout -> the evaluation loop gives the same tau, round by round."""

import pytest

from deepspec.decoding.sampling import SamplingParams
from deepspec.evaluation.prompt_sets import Benchmark
from deepspec.evaluation.runner import EvalSettings, evaluate
from deepspec.export import export_drafter, load_exported

from .conftest import make_drafter

PROMPTS = [[{"role": "user", "content": "Write a haiku about caches."}],
           [{"role": "user", "content": "def add(a, b):"}]]


@pytest.mark.float_exact
@pytest.mark.parametrize("kind,fmt,family", [("dspark", "hf", "tiny_llama"), ("eagle3", "sglang", "tiny_llama"),
                                            ("eagle3", "vllm", "tiny_llama"), ("dflash", "sglang", "tiny_qwen3"),
                                            ("dspark", "vllm", "tiny_qwen3"), ("mtp", "vllm", "tiny_qwen3"),
                                            ("standalone", "hf", "tiny_llama"),
                                            ("standalone", "causal_lm", "tiny_llama")])
def test_exported_drafter_gives_the_same_tau(request, tmp_path, kind, fmt, family):
    target = request.getfixturevalue(family)
    drafter = make_drafter(kind, target, **({"num_draft_layers": 1} if kind in ("dflash", "dspark") else {}))
    opts = {"verifier": "deepspec-tests/tiny-random"} if fmt == "vllm" else {}
    out = export_drafter(drafter, tmp_path / fmt, fmt, target=target, **opts)
    reloaded = load_exported(out, target).eval()
    settings = EvalSettings(max_new_tokens=12, sampling=SamplingParams(temperature=1.0), seed=3)
    bench = [Benchmark(name="tiny", domain="chat", source="test", prompts=PROMPTS)]
    results = evaluate(target, {"original": (drafter, "mem"), "exported": (reloaded, str(out))}, bench, settings,
                       progress=False)
    original = results["drafters"]["original"]["benchmarks"]["tiny"]
    exported = results["drafters"]["exported"]["benchmarks"]["tiny"]
    assert original["num_rounds"] > 0
    assert exported["tau"] == original["tau"] and exported["num_rounds"] == original["num_rounds"]
