"""Random-weight targets of real shapes with a synthetic tokenizer: shapes, tokenizer, chat plumbing, save/load."""

import pytest
import torch

from deepspec.targets.synthetic import (
    SPECIAL_TOKENS,
    make_random_target,
    make_standin_target,
    shaped_config,
    synthetic_tokenizer,
    write_random_target,
)


def _num_params(config) -> tuple[int, int]:
    """(all, non-embedding) parameter counts, counted on the meta device (nothing allocated)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


@pytest.mark.parametrize("shape,published_total,published_non_embedding", [
    ("qwen3-0.6b", 0.6e9, 0.44e9),  # Qwen3-0.6B model card: 0.6B parameters, 0.44B non-embedding
    ("llama-3.2-1b", 1.24e9, None),  # Llama 3.2 1B: 1.24B parameters (tied embeddings)
])
def test_real_shapes_have_the_published_parameter_counts(shape, published_total, published_non_embedding):
    config = shaped_config(shape)
    total, non_embedding = _num_params(config)
    assert abs(total - published_total) / published_total < 0.02, total
    if published_non_embedding:
        assert abs(non_embedding - published_non_embedding) / published_non_embedding < 0.02, non_embedding
    assert config.tie_word_embeddings


@pytest.mark.parametrize("shape,total,non_embedding,tied", [
    ("qwen3-4b", 4.0e9, 3.6e9, True),  # Qwen3-4B model card: 4.0B parameters, 3.6B non-embedding
    ("qwen3-8b", 8.2e9, 6.95e9, False),  # Qwen3-8B: 8.2B, 6.95B non-embedding (embedding and head excluded)
    ("qwen3-14b", 14.8e9, 13.2e9, False),  # Qwen3-14B: 14.8B, 13.2B
    ("llama-3.1-8b", 8.03e9, None, False),  # Llama 3.1 8B: 8.03B
    ("gemma-3-12b", 11.77e9, None, True),  # Gemma 3 12B's text model (its 12.2B include a 0.4B vision tower)
])
def test_paper_targets_have_the_published_parameter_counts(shape, total, non_embedding, tied):
    import transformers

    config = shaped_config(shape)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel() * (1 if tied else 2)
    assert abs(count - total) / total < 0.01, count
    if non_embedding:
        assert abs(count - embedding - non_embedding) / non_embedding < 0.01, count - embedding
    assert config.tie_word_embeddings == tied


def test_packaged_target_configs_name_their_published_shape():
    from deepspec.targets.config import target_settings

    for name, layers in (("qwen3-4b", 36), ("qwen3-8b", 36), ("qwen3-14b", 40), ("llama3.1-8b", 32), ("gemma3", 48)):
        settings = target_settings(name)
        assert shaped_config(settings.shape).num_hidden_layers == settings.num_hidden_layers == layers, name


def test_a_standin_target_holds_memory_for_its_materialised_layers_only():
    from deepspec.targets.features import decoder_layers

    config = shaped_config("tiny-qwen3")
    full = make_standin_target(config, name="full", seed=1)
    part = make_standin_target(config, name="part", seed=1, materialised_layers=1)
    layers = decoder_layers(part.model)
    assert part.num_layers == len(layers) == 4
    assert part.fingerprint()["config_hash"] == full.fingerprint()["config_hash"]
    assert [next(layer.parameters()).device.type for layer in layers] == ["cpu", "meta", "meta", "meta"]
    assert part.model.get_output_embeddings().weight is part.model.get_input_embeddings().weight  # still tied
    stored = sum(p.numel() for p in part.model.parameters() if p.device.type != "meta")
    one_layer = sum(p.numel() for p in layers[1].parameters())
    assert stored == sum(p.numel() for p in full.model.parameters()) - 3 * one_layer
    with pytest.raises(ValueError, match="materialised_layers=5 must lie in"):
        make_standin_target(config, name="x", materialised_layers=5)


def test_unknown_shape_is_named():
    with pytest.raises(ValueError, match="not one of"):
        shaped_config("qwen3-235b")


def test_tokenizer_is_byte_level_with_specials_in_the_last_rows():
    tokenizer = synthetic_tokenizer(600)
    assert len(tokenizer) == 600
    text = "Grüße, 世界! tab\tnewline\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # one token per UTF-8 byte, id = byte value
    assert tokenizer.decode(ids) == text
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(596, 600))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert all(isinstance(tokenizer.decode([i]), str) for i in range(600))  # every id decodes
    with pytest.raises(ValueError, match="must be >= 260"):
        synthetic_tokenizer(259)


def test_chat_template_gives_prefix_consistent_masks():
    from deepspec.data.chat import end_of_turn_token_ids, prompt_ids, render_conversation

    tokenizer = synthetic_tokenizer(512)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]
    sample = render_conversation(tokenizer, messages)
    assert sample.num_assistant_tokens == len("hello there") + 1 + len("ok") + 1  # answers and their <|im_end|>
    prompt = prompt_ids(tokenizer, messages[:3])
    assert sample.input_ids[:len(prompt)] == prompt
    assert end_of_turn_token_ids(tokenizer) == frozenset({tokenizer.eos_token_id})


def test_written_target_loads_as_a_local_folder_with_the_same_outputs(tmp_path):
    from deepspec.targets.load import load_target

    in_memory = make_random_target("tiny-llama", seed=3)
    path = write_random_target("tiny-llama", tmp_path / "target", dtype=torch.float32, seed=3)
    path = write_random_target("tiny-llama", tmp_path / "target", dtype=torch.float32, seed=3)  # replaced whole
    loaded = load_target(str(path), dtype="float32", device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]  # no temporary folder left
    ids = torch.tensor([[1, 2, 3, 300, 511]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, in_memory.model(ids).logits)
    assert loaded.tokenizer.chat_template == in_memory.tokenizer.chat_template
    assert loaded.fingerprint()["tokenizer_hash"] == in_memory.fingerprint()["tokenizer_hash"]
    assert loaded.model.config.eos_token_id == loaded.tokenizer.eos_token_id
