"""Export -> re-read the layout -> the evaluation loop gives the same tau, round by round."""

import pytest

from deepspec.decoding.sampling import SamplingParams
from deepspec.evaluation.benchmarks import Benchmark
from deepspec.evaluation.runner import EvalSettings, evaluate
from deepspec.export import export_drafter, load_exported

from .conftest import make_drafter

PROMPTS = [[{"role": "user", "content": "Write a haiku about caches."}],
           [{"role": "user", "content": "def add(a, b):"}]]


@pytest.mark.float_exact
@pytest.mark.parametrize("kind,fmt", [("dspark", "hf"), ("eagle3", "sglang"), ("eagle3", "vllm"), ("mtp", "nextn"),
                                      ("standalone", "hf"), ("standalone", "causal_lm")])
def test_exported_drafter_gives_the_same_tau(tiny_llama, tmp_path, kind, fmt):
    drafter = make_drafter(kind, tiny_llama)
    out = export_drafter(drafter, tmp_path / fmt, fmt, target=tiny_llama)
    reloaded = load_exported(out, tiny_llama).eval()
    settings = EvalSettings(max_new_tokens=12, sampling=SamplingParams(temperature=1.0), seed=3)
    bench = [Benchmark(name="tiny", domain="chat", source="test", prompts=PROMPTS)]
    results = evaluate(tiny_llama, {"original": (drafter, "mem"), "exported": (reloaded, str(out))}, bench, settings,
                       progress=False)
    original = results["drafters"]["original"]["benchmarks"]["tiny"]
    exported = results["drafters"]["exported"]["benchmarks"]["tiny"]
    assert original["num_rounds"] > 0
    assert exported["tau"] == original["tau"] and exported["num_rounds"] == original["num_rounds"]
