"""`deepspec cache cache.engine=vllm` with vLLM's real CPU build: the tiny Qwen3 target (head
size 32, the smallest vLLM's CPU attention takes) computed by vLLM gives the cache of the
transformers path, token ids and loss masks exactly and every feature within float32 rounding
(the bound: deepspec/cache/ENGINE.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from deepspec.cache import read_meta
from deepspec.cache.pipeline import run_cache_job
from deepspec.cache.reader import verify_cache

# float32 on CPU, measured: 1e-7 of the largest value on the tiny target; the bound leaves room for
# other kernels.
FP32_RELATIVE_BOUND = 1e-5


def job(*overrides: str) -> dict:
    from deepspec.cache.config import compose_cache_config

    cfg = compose_cache_config(list(overrides))
    kept = [k for k in cfg if k != "hydra"]
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, kept), resolve=True)


def save_tiny_qwen3(folder: Path) -> None:
    import transformers

    from deepspec.targets.load import load_tokenizer
    from deepspec.targets.tiny import tiny_config

    tokenizer = load_tokenizer("smollm2-135m")
    config = tiny_config("qwen3", vocab_size=len(tokenizer))
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 2, 1, 32
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.slow
def test_vllm_builds_the_transformers_cache_of_the_tiny_qwen3_target(tmp_path, vllm_python,
                                                                    monkeypatch, capsys):
    from deepspec.benchmarks.cache_engine import compare_caches

    monkeypatch.setenv("DEEPSPEC_VLLM_PYTHON", str(vllm_python))
    folder = tmp_path / "target"
    save_tiny_qwen3(folder)
    prompts = tmp_path / "answers.jsonl"
    records = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "why " * (i + 1)},
                                                 {"from": "gpt", "value": "yes " * (5 * i + 2)}]}
               for i in range(9)]
    prompts.write_text("".join(json.dumps(record) + "\n" for record in records))
    common = [f"target.name={folder}", "target.dtype=float32", "target.num_hidden_layers=4",
              f"data.prompts={prompts}", "data.val_fraction=0.2", "cache.layer_ids=[2,0]",
              "cache.storage_dtype=fp32", "cache.batch_size=4", "cache.max_length=256",
              "cache.shard_size_mb=0.01", "cache.progress=false"]
    engine = ["cache.engine=vllm", "vllm.kv_cache_gib=1"]
    assert run_cache_job(job(*common, f"cache.out_dir={tmp_path / 'vllm'}", *engine)) == 0
    assert "vLLM 0.32.0 computed the hidden states (3 requests" in capsys.readouterr().out
    assert run_cache_job(job(*common, f"cache.out_dir={tmp_path / 'local'}")) == 0

    assert verify_cache(tmp_path / "vllm") == []
    meta = read_meta(tmp_path / "vllm")
    assert meta.source["engine"] == {"name": "vllm", "version": "0.32.0", "dtype": "float32",
                                     "layer_ids": [1, 3, 4],
                                     "layer_id_convention": "input_of_layer"}
    assert meta.layer_ids == [2, 0] and meta.layer_id_convention == "output_of_layer"
    compared = compare_caches(tmp_path / "vllm", tmp_path / "local")
    assert compared["same_token_ids_and_loss_masks"]
    assert max(compared["max_abs_diff_relative"].values()) < FP32_RELATIVE_BOUND, compared
