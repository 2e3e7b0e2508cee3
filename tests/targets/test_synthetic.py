"""Random-weight targets of real shapes with a synthetic tokenizer: shapes, tokenizer, chat plumbing, save/load."""

import pytest
import torch

from deepspec.targets.synthetic import (
    SPECIAL_TOKENS,
    make_random_target,
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
