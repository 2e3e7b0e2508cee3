"""`convert_text_config`: a target's text config as another family's at the target's widths (`drafter.layer_family`).

One test per conversion the engines ask for (Llama <-> Qwen3), a Gemma 3 target converted, conversion into Gemma 3
refused with its reason, and the families whose converted config needs a setting of its own (Mistral's sliding
window, Qwen2's head_dim that its config does not declare).
"""

from __future__ import annotations

import pytest
import transformers

from deepspec.targets.family import conversion_refusal, convert_text_config, get_family

# What every conversion takes from the target, field by field.
WIDTHS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "initializer_range",
          "attention_dropout", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def llama3_like():
    """Llama-3-style widths: GQA, llama3 RoPE scaling, head_dim = hidden / heads, untied, eps 1e-5."""
    return transformers.LlamaConfig(
        vocab_size=1000, hidden_size=96, intermediate_size=200, num_hidden_layers=6, num_attention_heads=6,
        num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=7, eos_token_id=8, pad_token_id=None, initializer_range=0.015,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})


def qwen3_like():
    """Qwen3-4B-style widths: head_dim (32) times heads (8) is not the hidden size (96), tied, theta 1e6."""
    return transformers.Qwen3Config(
        vocab_size=1000, hidden_size=96, intermediate_size=160, num_hidden_layers=5, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=3, eos_token_id=4, pad_token_id=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def assert_widths_of(target, converted):
    for name in WIDTHS:
        assert getattr(converted, name) == getattr(target, name), name


def build_layer(config):
    """The family's decoder layer from the converted config (what the drafter builds)."""
    return get_family(config.model_type).decoder_layer_cls(config, 0)


def test_llama_target_to_qwen3_layers():
    target = llama3_like()
    converted = convert_text_config(target, "qwen3")
    assert type(converted) is transformers.Qwen3Config
    assert_widths_of(target, converted)
    assert converted.head_dim == 16  # Llama derives it (96 / 6); the conversion writes it
    assert converted.rope_parameters == target.rope_parameters  # llama3 scaling carried whole
    # Qwen3's own: SiLU MLP, no attention bias, q/k norms, every layer full attention (no sliding window)
    assert converted.hidden_act == "silu" and converted.attention_bias is False
    assert converted.use_sliding_window is False and set(converted.layer_types) == {"full_attention"}
    layer = build_layer(converted)
    assert type(layer).__name__ == "Qwen3DecoderLayer" and layer.self_attn.q_norm.weight.shape == (16,)
    assert layer.self_attn.k_proj.weight.shape == (2 * 16, 96) and layer.mlp.up_proj.weight.shape == (200, 96)


def test_qwen3_target_to_llama_layers():
    target = qwen3_like()
    converted = convert_text_config(target, "llama")
    assert type(converted) is transformers.LlamaConfig
    assert_widths_of(target, converted)
    assert converted.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}
    assert converted.hidden_act == "silu" and converted.attention_bias is False and converted.mlp_bias is False
    layer = build_layer(converted)
    attention = layer.self_attn
    assert type(layer).__name__ == "LlamaDecoderLayer" and not hasattr(attention, "q_norm")
    # head_dim 32 x 8 heads = 256 != hidden 96: the Llama layer keeps the target's head width
    assert attention.q_proj.weight.shape == (256, 96) and attention.o_proj.weight.shape == (96, 256)
    assert attention.k_proj.weight.shape == (128, 96) and attention.scaling == 32 ** -0.5


def test_gemma3_target_to_llama_layers_takes_its_full_attention_rope():
    target = transformers.Gemma3TextConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=16, max_position_embeddings=2048,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    assert set(target.rope_parameters) == {"full_attention", "sliding_attention"}
    converted = convert_text_config(target, "llama")
    assert_widths_of(target, converted)
    # draft layers attend fully: the global table, not the local one; the activation is Llama's, not Gemma's GELU
    assert converted.rope_parameters == target.rope_parameters["full_attention"]
    assert converted.rope_parameters["rope_theta"] != target.rope_parameters["sliding_attention"]["rope_theta"]
    assert converted.hidden_act == "silu" and target.hidden_activation == "gelu_pytorch_tanh"
    assert type(build_layer(converted)).__name__ == "LlamaDecoderLayer"


def test_conversion_into_gemma3_is_refused_with_its_reason():
    reason = conversion_refusal("llama", "gemma3_text")
    assert reason is not None and "query_pre_attn_scalar" in reason and "drafter.layer_family" in reason
    with pytest.raises(ValueError, match=r"layer_family='gemma3_text' for a llama target: Gemma 3 layers need "
                                         r"settings only a Gemma 3 config defines"):
        convert_text_config(llama3_like(), "gemma3_text")
    # a Gemma 3 target's own family is no conversion (also through the multimodal wrapper's model_type)
    assert conversion_refusal("gemma3", "gemma3_text") is None and conversion_refusal("gemma3_text", "llama") is None


def test_mistral_and_qwen2_conversions_set_what_their_configs_need():
    target = qwen3_like()
    mistral = convert_text_config(target, "mistral")
    assert_widths_of(target, mistral)
    assert mistral.sliding_window is None  # MistralConfig defaults to a 4,096 window; draft layers attend fully
    qwen2 = convert_text_config(target, "qwen2")
    assert_widths_of(target, qwen2)  # head_dim is not a Qwen2Config field; its attention reads it all the same
    layer = build_layer(qwen2)
    assert layer.self_attn.q_proj.weight.shape == (256, 96) and layer.self_attn.q_proj.bias is not None  # Qwen2's


def test_the_targets_own_family_is_its_config_unchanged():
    target = llama3_like()
    same = convert_text_config(target, "llama")
    assert same is not target and same.to_dict() == target.to_dict()
    with pytest.raises(ValueError, match="not supported by DeepSpec drafters; supported: gemma3_text, llama"):
        convert_text_config(target, "gpt2")
