"""The rendering rule (deepspec.data.rendering): the text format's samples and prompts, a given chat template, the
records later stages check, and the accounting of skipped records."""

from __future__ import annotations

import json

import pytest

from deepspec.data.rendering import (
    AllSkipped,
    Rendering,
    RenderingOptions,
    Skipped,
    SkipReport,
    leading_special_ids,
    resolve_chat_template,
)
from deepspec.data.sources import Conversation, TextRecord, load_jsonl

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT = Rendering(format="text")
FIELDS = {"format": "data.format", "chat_template": "target.chat_template",
          "chat_template_kwargs": "target.chat_template_kwargs"}


def fresh_base_tokenizer():
    """The SmolLM2 tokenizer without a chat template (an object of its own)."""
    from deepspec.targets.load import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.chat_template = None
    return tokenizer


@pytest.fixture
def base_tokenizer():
    return fresh_base_tokenizer()


@pytest.fixture
def bos_eos_tokenizer():
    """A tokenizer that puts BOS before a text and EOS after it when asked for special tokens (as some do)."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = fresh_base_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A <|im_end|>", special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)])
    return tokenizer


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def record(**fields) -> Conversation:
    path_line = fields.pop("line", 1)
    return Conversation(id=fields.pop("id", "r"), messages=fields.pop("messages", []), source="t.jsonl",
                        line=path_line, text=fields.pop("text", None))


def test_text_records_and_their_loss(base_tokenizer, bos_eos_tokenizer):
    """{"text"}: the loss over all of it but the first token; {"prompt", "completion"}: over the completion;
    a conversation: its contents joined by a blank line. BOS where the tokenizer adds one, no EOS appended."""
    tok = base_tokenizer
    plain = TEXT.sample(tok, record(text=TextRecord("", "Once upon a time")))
    assert plain.input_ids == ids(tok, "Once upon a time") and plain.loss_mask == [0] + [1] * (len(plain.input_ids) - 1)
    pair = TEXT.sample(tok, record(text=TextRecord("The sky is", " blue today")))
    prompt, completion = ids(tok, "The sky is"), ids(tok, " blue today")
    assert pair.input_ids == prompt + completion and pair.loss_mask == [0] * len(prompt) + [1] * len(completion)
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    chat = TEXT.sample(tok, record(messages=turn))
    assert chat.input_ids == ids(tok, "Hi\n\nYo") and sum(chat.loss_mask) == len(chat.input_ids) - 1
    assert TEXT.sample(tok, record(text=TextRecord("Only a prompt", None))).num_assistant_tokens == 0

    bos = leading_special_ids(bos_eos_tokenizer)
    assert bos == [1]  # BOS kept, the EOS it would append after a prompt left out
    with_bos = TEXT.sample(bos_eos_tokenizer, record(text=TextRecord("", "Once upon a time")))
    assert with_bos.input_ids == [1] + ids(tok, "Once upon a time") and with_bos.loss_mask[:2] == [0, 1]
    assert with_bos.input_ids[-1] != 2
    # The generation prompt is the sample's start, token for token.
    prefix = TEXT.text_prompt_ids(bos_eos_tokenizer, "The sky is")
    sample = TEXT.sample(bos_eos_tokenizer, record(text=TextRecord("The sky is", " blue")))
    assert sample.input_ids[:len(prefix)] == prefix
    assert TEXT.prompt_ids(tok, [{"role": "user", "content": "First turn"}]) == ids(tok, "First turn")
    with pytest.raises(Skipped, match="no text to continue"):
        TEXT.prompt_ids(tok, [{"role": "system", "content": "only a system message"}])
    assert TEXT.stop_token_ids(tok) == [tok.eos_token_id]


def test_a_given_chat_template_renders_without_changing_the_tokenizer(base_tokenizer, tmp_path):
    given = Rendering(chat_template=CHATML)
    conv = record(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    sample = given.sample(base_tokenizer, conv)
    assert base_tokenizer.decode(sample.input_ids) == ("<|im_start|>user\nHi<|im_end|>\n"
                                                       "<|im_start|>assistant\nYo<|im_end|>\n")
    assert base_tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m]) == "Yo<|im_end|>"
    assert base_tokenizer.chat_template is None and given.stop_token_ids(base_tokenizer) == [2]
    with pytest.raises(Skipped, match="has no chat template") as err:
        Rendering().sample(base_tokenizer, conv)
    assert err.value.reason == "no_chat_template"
    with pytest.raises(ValueError, match=r"has no chat template \(a base model\?\): set data.format=text to use plain "
                                         r"text, or give a chat template with target.chat_template=<t>"):
        Rendering().check_tokenizer(base_tokenizer, RenderingOptions("data.format=text", "target.chat_template=<t>"))
    given.check_tokenizer(base_tokenizer, RenderingOptions("data.format=text", "target.chat_template=<t>"))
    with pytest.raises(Skipped, match="a plain-text record") as err:
        given.sample(base_tokenizer, record(text=TextRecord("", "plain")))
    assert err.value.reason == "text_record"

    path = tmp_path / "t.jinja"
    path.write_text(CHATML)
    assert resolve_chat_template(str(path), "target.chat_template") == CHATML == resolve_chat_template(CHATML, "x")
    assert resolve_chat_template(None, "x") is None
    with pytest.raises(FileNotFoundError, match="target.chat_template='missing.jinja': no such file"):
        resolve_chat_template("missing.jinja", "target.chat_template")


def test_recorded_renderings_are_checked_naming_the_setting():
    text, chat = TEXT.record(), Rendering(chat_template_kwargs={"enable_thinking": False}).record()
    assert text == {"data_format": "text", "chat_template": None, "chat_template_kwargs": {}}
    assert Rendering.from_record({}) == Rendering()  # written before the rendering was recorded: chat, its own
    TEXT.check_recorded(text, "the cache", FIELDS)
    with pytest.raises(ValueError, match="data.format=chat but the cache was rendered in the text format: set "
                                         "data.format=text, or rebuild it"):
        Rendering().check_recorded(text, "the cache", FIELDS)
    with pytest.raises(ValueError, match=r"target.chat_template gives a given chat template \(sha256 \w+\) but the "
                                         r"cache was rendered with the tokenizer's own chat template"):
        Rendering(chat_template=CHATML).check_recorded({"data_format": "chat"}, "the cache", FIELDS)
    with pytest.raises(ValueError, match=r"target.chat_template_kwargs=\{\} but the cache was rendered with "
                                         r"chat_template_kwargs=\{'enable_thinking': False\}"):
        Rendering().check_recorded(chat, "the cache", FIELDS)
    with pytest.raises(ValueError, match="a system prompt is a chat setting"):
        Rendering(format="text", system_prompt="be brief")


def test_skips_are_named_and_all_skipped_is_refused_with_the_fix(caplog):
    report = SkipReport()
    report.require_kept(0, "nothing given")  # no record at all: the caller's case, not this one
    report.skip("no_chat_template", "'a' (x.jsonl:1)", "the tokenizer of 'm' has no chat template")
    report.skip("no_chat_template", "'b' (x.jsonl:2)", "the tokenizer of 'm' has no chat template")
    report.skip("empty", "'c' (x.jsonl:3)", "rendered to zero tokens")
    import logging

    with caplog.at_level(logging.WARNING):
        report.warn(logging.getLogger("t"), "conversations", "data.prompts='x.jsonl': ")
    assert "skipped 2 conversations (no_chat_template); the first: 'a' (x.jsonl:1): the tokenizer" in caplog.text
    report.require_kept(1, "data.prompts='x.jsonl'")  # one sample left: a warning, not a refusal
    options = RenderingOptions("data.format=text", "target.chat_template=<template text or file>", "cache.max_length")
    with pytest.raises(AllSkipped) as err:
        report.require_kept(0, "data.prompts='x.jsonl'", options)
    message = str(err.value)
    assert "\n" not in message
    assert message == ("data.prompts='x.jsonl': all 3 records were skipped, nothing was written (2 no_chat_template, "
                       "the first 'a' (x.jsonl:1): the tokenizer of 'm' has no chat template; 1 empty, the first 'c' "
                       "(x.jsonl:3): rendered to zero tokens). For a base model set data.format=text (plain text), or "
                       "give a chat template with target.chat_template=<template text or file>.")


def test_text_records_load_and_read_as_one_chat_turn(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "t", "text": "plain"}, {"id": "pc", "prompt": "P", "completion": "C"}, {"id": "p", "prompt": "P"},
        {"id": "bad", "prompt": 3}, {"text": "  "}]) + "\n")
    convs, report = load_jsonl(path)
    assert [c.id for c in convs] == ["t", "pc", "p"]
    assert [c.text for c in convs] == [TextRecord("", "plain"), TextRecord("P", "C"), TextRecord("P", None)]
    assert convs[0].messages == [] and convs[2].messages == [{"role": "user", "content": "P"}]
    assert convs[1].messages == [{"role": "user", "content": "P"}, {"role": "assistant", "content": "C"}]
    assert (report.num_malformed, report.num_empty) == (1, 1) and "'prompt' must be a string" in report.problems[0]
    assert convs[1].where == "'pc' (t.jsonl:2)"
