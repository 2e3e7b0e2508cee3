"""Shared fixtures: tiny random targets of several families (with the real SmolLM2 tokenizer), float32."""

from __future__ import annotations

import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)


def _tiny_config(family: str, vocab_size: int):
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
                                             layer_types=["sliding_attention", "sliding_attention",
                                                          "full_attention", "sliding_attention"], **common)
    raise ValueError(family)


TINY_FAMILIES = ("llama", "qwen3", "gemma3")


def make_tiny_target(family: str, seed: int = 0):
    """A tiny random causal LM of `family` paired with the embedded SmolLM2 tokenizer (vocab 49152)."""
    import transformers

    from deepspec.targets.load import LoadedTarget, load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    torch.manual_seed(seed)
    config = _tiny_config(family, vocab_size=len(tokenizer))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=f"tiny-random-{family}", path="<memory>",
                        revision=f"seed{seed}")


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_target("llama")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3():
    return make_tiny_target("gemma3")


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_target(request):
    return make_tiny_target(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target in float32 (converted once into the DeepSpec cache)."""
    from deepspec.targets.load import load_target

    return load_target("smollm2-135m", dtype="float32", device="cpu")
