"""`cache.engine=vllm` on DeepSpec's side (deepspec.cache.engine_source), with a stand-in worker
that speaks the vLLM worker's protocol through transformers (fake_feature_worker.py): the cache
it writes equals the transformers path's, and a worker that refuses, dies or is the wrong vLLM is
one line. vLLM itself: test_engine_vllm.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from deepspec.cache import BuildJob, build_cache
from deepspec.cache.config import CacheSchema, VllmCaptureSchema, resolve_cache_config
from deepspec.cache.engine_source import VllmCapture, vllm_layer_ids
from deepspec.cache.reader import CacheReader
from deepspec.targets.engine import EngineError
from deepspec.targets.head import load_target_head
from deepspec.targets.load import load_target, make_tiny_target

FAKE_WORKER = [sys.executable, str(Path(__file__).with_name("fake_feature_worker.py"))]
LAYERS = [2, 0]  # unsorted on purpose: vLLM returns its layers in increasing order


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def saved_target(request, tmp_path_factory) -> Path:
    target = make_tiny_target(request.param)
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    return folder


def build(folder: Path, out: Path, conversations, engine: VllmCapture | None):
    if engine is not None:
        target = engine.target
    else:
        target = load_target(str(folder), dtype="float32", device="cpu")
    job = BuildJob(CacheSchema(out_dir=str(out), layer_ids=LAYERS, max_length=None, progress=False,
                               storage_dtype="fp32", batch_size=3), engine=engine)
    build_cache({"train": conversations}, target, job)
    return CacheReader(out)


def fake_engine(folder: Path) -> VllmCapture:
    target = load_target_head(str(folder), dtype="float32", device="cpu")
    return VllmCapture(target, LAYERS, VllmCaptureSchema(), max_model_len=512,
                       command=FAKE_WORKER)


def test_vllm_layer_ids_are_deepspec_s_plus_one_and_the_last_layer_s_output_increasing():
    assert vllm_layer_ids([2, 0], num_layers=4) == [1, 3, 4]
    # The last layer's output is also the final norm's input: asked once.
    assert vllm_layer_ids([3], num_layers=4) == [4]
    assert vllm_layer_ids([], num_layers=30) == [30]


def test_the_engine_s_cache_equals_the_transformers_cache(saved_target, tmp_path,
                                                         conversations_factory):
    conversations = conversations_factory(7)
    with fake_engine(saved_target) as engine:
        served = build(saved_target, tmp_path / "engine", conversations, engine)
        assert engine.num_requests == 3  # 7 samples, batch_size=3
    local = build(saved_target, tmp_path / "local", conversations, None)
    assert [s["id"] for s in served.samples] == [s["id"] for s in local.samples]
    for i in range(len(local)):
        a, b = served[i], local[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        # One sample alone (the engine) against a right-padded batch (transformers): float32
        # rounding only.
        torch.testing.assert_close(a.features, b.features, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.final_hidden, b.final_hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.target_lse, b.target_lse, rtol=1e-5, atol=1e-5)


def test_a_worker_that_dies_is_an_error_naming_its_log_not_a_hang(tmp_path, monkeypatch,
                                                                  conversations_factory):
    folder = tmp_path / "target"
    target = make_tiny_target("llama")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    monkeypatch.setenv("FAKE_DIE_ON", "1")
    engine = fake_engine(folder)
    with pytest.raises(EngineError, match=r"vLLM's feature worker exited with 7 while computing "
                                          r"3 sample\(s\) \(log .*vllm.log\)"):
        with engine:
            build(folder, tmp_path / "cache", conversations_factory(7), engine)
    assert engine.log_path.is_file()  # kept after a failure, named in the error
    shutil.rmtree(engine.workdir)


def test_an_engine_that_cannot_capture_is_refused_with_its_own_reason(tmp_path, monkeypatch):
    folder = tmp_path / "target"
    target = make_tiny_target("gemma3")
    target.model.save_pretrained(folder)
    target.tokenizer.save_pretrained(folder)
    reason = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
    monkeypatch.setenv("FAKE_REFUSE", reason)
    engine = fake_engine(folder)
    with pytest.raises(EngineError) as refused:
        with engine:
            engine.start()
    assert str(refused.value).startswith(
        f"vLLM cannot capture the hidden states of {folder}: RuntimeError: {reason}")
    assert "Engine core initialization failed" not in str(refused.value)
    shutil.rmtree(engine.workdir)


def test_a_vllm_other_than_the_tested_one_is_refused_before_it_starts(tmp_path, monkeypatch):
    import deepspec.cache.engine_source as engine_source

    monkeypatch.setattr(engine_source, "vllm_python",
                        lambda given=None: Path("/opt/vllm/bin/python"))
    monkeypatch.setattr(engine_source, "installed_vllm_version", lambda python: "0.33.1")
    target = make_tiny_target("llama")
    with pytest.raises(EngineError, match=r"vLLM 0.33.1 \(/opt/vllm/bin/python\): "
                                          r"cache.engine=vllm is tested with vLLM 0.32.x only"):
        VllmCapture(target, [0], VllmCaptureSchema(), max_model_len=64)


def test_the_engine_is_a_checked_config_choice():
    job = resolve_cache_config({"cache": {"engine": "vllm"},
                                "vllm": {"tensor_parallel_size": 8}})
    assert (job.cache.engine, job.vllm.tensor_parallel_size) == ("vllm", 8)
    with pytest.raises(ValueError,
                       match=r"cache.engine='sglang' must be one of \['transformers', 'vllm'\]"):
        CacheSchema(engine="sglang")
    with pytest.raises(ValueError, match=r"vllm.tensor_parallel_size=0 must be >= 1"):
        VllmCaptureSchema(tensor_parallel_size=0)


def test_the_head_only_target_computes_the_full_target_s_norm_and_log_normaliser(
        saved_target):
    from deepspec.targets.features import decoder_stack, target_log_normalizer

    head = load_target_head(str(saved_target), dtype="float32", device="cpu")
    full = load_target(str(saved_target), dtype="float32", device="cpu")
    assert head.fingerprint() == full.fingerprint()
    assert next(decoder_stack(head.model).layers.parameters()).is_meta  # never loaded
    hidden = torch.randn(5, head.config.hidden_size)
    assert torch.equal(decoder_stack(head.model).norm(hidden),
                       decoder_stack(full.model).norm(hidden))
    assert torch.equal(target_log_normalizer(head.model, hidden),
                       target_log_normalizer(full.model, hidden))


def test_a_resume_with_the_other_engine_is_refused_naming_the_field(tmp_path,
                                                                    conversations_factory):
    from deepspec.utils.faults import FaultInjection, InjectedFault

    target = make_tiny_target("llama")
    options = CacheSchema(out_dir=str(tmp_path / "cache"), layer_ids=[0], max_length=None,
                          progress=False, batch_size=2, shard_size_mb=1e-4)
    splits = {"train": conversations_factory(6)}
    source = {"prompts": "conversations.jsonl"}
    with pytest.raises(InjectedFault):
        build_cache(splits, target, BuildJob(options, source=source,
                                             faults=FaultInjection(stop_after=1)))
    # What the cache job adds for cache.engine=vllm (deepspec.cache.pipeline).
    engine = {"engine": {"name": "vllm", "version": "0.32.0", "dtype": "float32"}}
    with pytest.raises(ValueError, match=r"source.engine: None vs now \{'name': 'vllm'"):
        build_cache(splits, target, BuildJob(options, source={**source, **engine}))
