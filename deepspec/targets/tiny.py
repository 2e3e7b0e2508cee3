"""Tiny random targets for smoke runs and tests: `tiny-random-{llama,qwen3,gemma3}`.

A few-layer random model of a real family paired with the embedded SmolLM2 tokenizer (real chat
template, vocab 49,152), so every stage runs end to end in seconds. Not for quality, only plumbing.
"""

from __future__ import annotations

import torch

TINY_RANDOM_PREFIX = "tiny-random-"
TINY_FAMILIES = ("llama", "qwen3", "gemma3")


def tiny_config(family: str, vocab_size: int):
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
    raise ValueError(f"target.name={TINY_RANDOM_PREFIX}{family}: tiny random targets are "
                     f"{[TINY_RANDOM_PREFIX + f for f in TINY_FAMILIES]}")


def is_tiny_target(name: str) -> bool:
    return name.startswith(TINY_RANDOM_PREFIX)


def build_tiny_model(family: str, vocab_size: int, seed: int = 0):
    """A tiny random causal LM of `family` (float32, frozen); `deepspec.targets.load.make_tiny_target` pairs it
    with the embedded tokenizer."""
    import transformers

    config = tiny_config(family, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model
