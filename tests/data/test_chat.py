"""Chat rendering and assistant loss masks on the SmolLM2, Qwen-style and Llama-3-style templates."""

import logging

import pytest

from deepspec.data.chat import RenderedSample, count_and_warn, end_of_turn_token_ids, prompt_ids, render_conversation
from deepspec.targets.load import load_tokenizer

QWEN_CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{%- if system_message %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# Rewrites earlier turns (drops all but the last assistant answer): cannot be masked by prefix rendering.
LAST_ANSWER_ONLY = (
    "{%- for message in messages %}"
    "{%- if message.role != 'assistant' or loop.last %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 equals 4."},
    {"role": "user", "content": "And times three?\nExplain."},
    {"role": "assistant", "content": "Four times three is 12.\n\nDone"},
]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    return load_tokenizer("smollm2-135m")


def masked_runs(tokenizer, sample: RenderedSample) -> list[str]:
    """Decoded text of each contiguous run of mask-1 tokens."""
    runs, current = [], []
    for token, flag in zip(sample.input_ids, sample.loss_mask):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


def assert_prompt_prefixes(tokenizer, messages, sample, system_prompt=None):
    """The generation prompt before each assistant turn is the exact token prefix of the sample."""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = prompt_ids(tokenizer, messages[:i], system_prompt=system_prompt)
            assert sample.input_ids[:len(prompt)] == prompt
            assert sample.loss_mask[len(prompt) - 1] == 0 and sample.loss_mask[len(prompt)] == 1


def test_smollm2_mask_is_answers_plus_im_end(smollm_tokenizer):
    sample = render_conversation(smollm_tokenizer, CONVERSATION)
    assert masked_runs(smollm_tokenizer, sample) == [
        "2+2 equals 4.<|im_end|>", "Four times three is 12.\n\nDone<|im_end|>"]
    assert sample.num_assistant_tokens == sum(sample.loss_mask) > 0
    assert len(sample.input_ids) == len(sample.loss_mask)
    text = smollm_tokenizer.decode(sample.input_ids, skip_special_tokens=False)
    # The template's own default system prompt is part of every rendering (nothing else is injected).
    assert text == smollm_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert "You are a helpful AI assistant named SmolLM" in text
    assert_prompt_prefixes(smollm_tokenizer, CONVERSATION, sample)
    assert end_of_turn_token_ids(smollm_tokenizer) == {smollm_tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_configured_system_prompt_replaces_existing(smollm_tokenizer):
    messages = [{"role": "system", "content": "old"}] + CONVERSATION
    sample = render_conversation(smollm_tokenizer, messages, system_prompt="Be brief.")
    text = smollm_tokenizer.decode(sample.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?")
    assert "old" not in text and "SmolLM" not in text
    assert_prompt_prefixes(smollm_tokenizer, messages, sample, system_prompt="Be brief.")
    assert masked_runs(smollm_tokenizer, sample)[0] == "2+2 equals 4.<|im_end|>"


def test_qwen_chatml_template_with_system_prompt(smollm_tokenizer):
    tokenizer = load_tokenizer("smollm2-135m")  # own copy: the template is changed
    tokenizer.chat_template = QWEN_CHATML
    messages = [{"role": "system", "content": "You are terse."}] + CONVERSATION
    sample = render_conversation(tokenizer, messages)
    text = tokenizer.decode(sample.input_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert masked_runs(tokenizer, sample) == ["2+2 equals 4.<|im_end|>", "Four times three is 12.\n\nDone<|im_end|>"]
    assert_prompt_prefixes(tokenizer, messages, sample)
    default = render_conversation(tokenizer, CONVERSATION)
    assert "You are Qwen" in tokenizer.decode(default.input_ids)


NON_THINKING = {"enable_thinking": False}


def test_template_options_reach_prompts_and_masks_alike(qwen3_style_tokenizer):
    """Qwen3 non-thinking mode: the empty think block belongs to the prompt (never to the loss), in the generation
    prompt and in the rendered sample alike; without the option neither has it."""
    tokenizer = qwen3_style_tokenizer
    sample = render_conversation(tokenizer, CONVERSATION, chat_template_kwargs=NON_THINKING)
    assert masked_runs(tokenizer, sample) == ["2+2 equals 4.<|im_end|>", "Four times three is 12.\n\nDone<|im_end|>"]
    text = tokenizer.decode(sample.input_ids, skip_special_tokens=False)
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 2
    prompt = prompt_ids(tokenizer, CONVERSATION[:1], chat_template_kwargs=NON_THINKING)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert sample.input_ids[:len(prompt)] == prompt and sample.loss_mask[len(prompt)] == 1
    thinking = render_conversation(tokenizer, CONVERSATION)
    assert "<think>" not in tokenizer.decode(thinking.input_ids) and masked_runs(tokenizer, thinking) == \
        masked_runs(tokenizer, sample)
    assert "<think>" not in tokenizer.decode(prompt_ids(tokenizer, CONVERSATION[:1]))
    assert end_of_turn_token_ids(tokenizer, NON_THINKING) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_llama3_template_masks_content_and_eot(smollm_tokenizer):
    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                         special_tokens=True)
    tokenizer.chat_template = LLAMA3
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot in end_of_turn_token_ids(tokenizer)
    messages = [{"role": "system", "content": "Sys."}] + CONVERSATION
    sample = render_conversation(tokenizer, messages)
    text = tokenizer.decode(sample.input_ids, skip_special_tokens=False)
    assert text.count("<|im_start|>") == 1  # bos of this tokenizer, emitted once by {{ bos_token }}
    assert "<|start_header_id|>system<|end_header_id|>\n\nSys.<|eot_id|>" in text
    assert masked_runs(tokenizer, sample) == ["2+2 equals 4.<|eot_id|>", "Four times three is 12.\n\nDone<|eot_id|>"]
    assert_prompt_prefixes(tokenizer, messages, sample)
    header = tokenizer.decode(prompt_ids(tokenizer, messages[:4]), skip_special_tokens=False)
    assert header.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_max_length_and_all_zero_samples_are_reported(smollm_tokenizer, caplog):
    full = render_conversation(smollm_tokenizer, CONVERSATION)
    first_answer = full.loss_mask.index(1)
    cut = render_conversation(smollm_tokenizer, CONVERSATION, max_length=first_answer)
    assert cut.input_ids == full.input_ids[:first_answer] and cut.num_assistant_tokens == 0
    user_only = render_conversation(smollm_tokenizer, CONVERSATION[:1])
    assert user_only.num_assistant_tokens == 0 and sum(user_only.loss_mask) == 0
    with caplog.at_level(logging.WARNING):
        assert count_and_warn([full, cut, user_only], where="val") == 2
    assert "val: 2 of 3 samples have no assistant tokens" in caplog.text
    with pytest.raises(ValueError, match="max_length"):
        render_conversation(smollm_tokenizer, CONVERSATION, max_length=0)


def test_template_breaking_prefixes_raises_clear_error():
    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.chat_template = LAST_ANSWER_ONLY
    with pytest.raises(ValueError, match="not prefix-consistent"):
        render_conversation(tokenizer, CONVERSATION)


def test_bad_conversations_raise(smollm_tokenizer):
    with pytest.raises(ValueError, match="starts with an assistant"):
        render_conversation(smollm_tokenizer, [{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="ending with a user"):
        prompt_ids(smollm_tokenizer, CONVERSATION[:2])
    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        render_conversation(tokenizer, CONVERSATION)
