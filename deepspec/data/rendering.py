"""How a record becomes the target's tokens and loss mask, the same rule in every stage (regeneration, the cache,
training's online features, calibration, evaluation): the chat format or the text format.

chat (the default): the target's chat template renders the conversation (deepspec.data.chat: prefix rendering,
the loss over the assistant answers). The template is the tokenizer's own, or one given in the target config
(`target.chat_template`: the template text, or the path of a file holding it) for a tokenizer without one (a base
model) or to replace its own.

text (a base model, no template): a record is text, tokenized as a completions server tokenizes a prompt: the
special tokens the tokenizer puts before any text (BOS, where it adds one), then the text.
  {"text": T}                       the loss over all of T
  {"prompt": P, "completion": C}    P then C (tokenized apart, so P's tokens are a prefix of the sample); the loss
                                    over C only (what `deepspec regenerate --format text` writes)
  a conversation (conversations / messages / turns): its messages' contents joined by a blank line, the loss over
                                    all of it
The first token of a sample is never scored (nothing precedes it) and nothing is appended (no end-of-sequence
token). A generation (regeneration, evaluation) continues a prefix: P of a prompt record, T of a text record, the
first user message of a conversation (a benchmark's {"turns": [...]}: its first turn); it stops at the
tokenizer's end-of-sequence token.

`Rendering` holds the settings (format, a given template, template options, system prompt); `record()` is what
a later stage must agree with (a cache's meta.json, a regeneration's meta file, a drafter's config) and
`check_recorded` refuses data rendered otherwise, naming the setting. Skipped records are never silent:
`SkipReport` counts them by reason and names the first record of each reason with its cause, and `require_kept`
refuses a run in which every record was skipped, with the cause and the option that fixes it.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspec.data.chat import (
    NoChatTemplate,
    RenderedSample,
    check_chat_template_kwargs,
    encode,
    end_of_turn_token_ids,
    prompt_ids,
    render_conversation,
    tokenizer_name,
)
from deepspec.data.sources import Conversation

FORMATS = ("chat", "text")
TEXT_SEPARATOR = "\n\n"  # between a conversation's messages in the text format
MAX_PROBLEMS_KEPT = 50
_leading_cache: dict[int, tuple[Any, list[int]]] = {}
_templated_cache: dict[tuple[int, str], tuple[Any, Any]] = {}


def resolve_chat_template(value: str | None, field_name: str) -> str | None:
    """A configured chat template: None (the tokenizer's own), the template text itself (it holds Jinja tags),
    or the path of a file holding it."""
    if value is None or value == "":
        return None
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{field_name}={value!r}: no such file, and not a Jinja chat template either (give "
                                "the template text, or the path of a file holding it)")
    return path.read_text(encoding="utf-8")


def command_line_rendering(data_format: str, chat_template: str | None, configured_template: str | None,
                           chat_template_kwargs: Mapping | None, system_prompt: str | None = None) -> Rendering:
    """The rendering of a command line (regenerate, evaluate): `--format`, `--chat-template` (else the target
    config's `chat_template`), the template options and `--system-prompt`."""
    if data_format == "text":
        if system_prompt is not None:
            raise ValueError("--system-prompt is a chat setting: --format text renders no system prompt")
        return Rendering(format="text")
    template = (resolve_chat_template(chat_template, "--chat-template") if chat_template is not None
                else resolve_chat_template(configured_template, "target.chat_template"))
    return Rendering(chat_template=template, chat_template_kwargs=chat_template_kwargs or {},
                     system_prompt=system_prompt)


def describe_template(template: str | None) -> str:
    if template is None:
        return "the tokenizer's own chat template"
    return f"a given chat template (sha256 {hashlib.sha256(template.encode()).hexdigest()[:12]})"


@dataclass(frozen=True)
class RenderingOptions:
    """How a stage's user sets the rendering, as its refusals name it."""

    text_format: str  # e.g. "data.format=text"
    chat_template: str  # e.g. "target.chat_template=<template text or file>"
    max_length: str | None = None  # e.g. "cache.max_length"


COMMAND_LINE_OPTIONS = RenderingOptions("--format text", "--chat-template <template text or file>")


class Skipped(ValueError):
    """A record that cannot become a sample (or a prompt): `reason` is its counter, the message its cause."""

    def __init__(self, reason: str, cause: str):
        super().__init__(cause)
        self.reason = reason


class AllSkipped(ValueError):
    """Every record of a run was skipped: nothing is written."""


def skip_fixes(options: RenderingOptions) -> dict[str, str]:
    """What to do when every record was skipped for a reason (the reasons whose cause does not say it)."""
    max_length = (f", or {options.max_length} cut every sample before its first answer: raise it"
                  if options.max_length else "")
    return {
        "no_chat_template": f"For a base model set {options.text_format} (plain text), or give a chat template with "
                            f"{options.chat_template}",
        "text_record": f"Plain-text records need the text format: set {options.text_format}",
        "no_assistant_tokens": "The chat format learns from assistant answers: prompts alone need their answers "
                               f"first (`deepspec regenerate`), or set {options.text_format}{max_length}",
        "no_loss_tokens": "The text format learns from a record's text or completion: a prompt alone needs its "
                          "continuation first (`deepspec regenerate --format text`)",
        "no_prefix": "A generation continues a prompt, a text or a user message: the records hold none",
        "no_user_turn": "A chat answer needs a user message to answer",
    }


@dataclass
class SkipReport:
    """Skipped records by reason, the first of each named with its cause."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)  # reason -> "record: cause"
    problems: list[str] = field(default_factory=list)  # "record: reason: cause", the first MAX_PROBLEMS_KEPT

    def skip(self, reason: str, where: str, cause: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, f"{where}: {cause}")
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(f"{where}: {reason}: {cause}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def warn(self, logger: logging.Logger, what: str = "records", prefix: str = "") -> None:
        for reason, count in self.counts.items():
            logger.warning("%sskipped %d %s (%s); the first: %s", prefix, count, what, reason, self.first[reason])

    def require_kept(self, num_kept: int, what: str, options: RenderingOptions | None = None) -> None:
        """Refuse (`AllSkipped`) a run whose records were all skipped: one line with each reason's first record and
        cause, and the fix where the cause does not say it. A run given no record at all is the caller's case."""
        if num_kept or not self.total:
            return
        causes = "; ".join(f"{count} {reason}, the first {self.first[reason]}" for reason, count in self.counts.items())
        fixes = skip_fixes(options) if options is not None else {}
        fix = " ".join(f"{fixes[reason]}." for reason in self.counts if reason in fixes)
        raise AllSkipped(f"{what}: all {self.total} records were skipped, nothing was written ({causes})"
                         + (f". {fix}" if fix else ""))


def leading_special_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (BOS, where it adds one); any it appends after the text
    (an end-of-sequence token some tokenizers add) is left out."""
    key = id(tokenizer)
    if key not in _leading_cache or _leading_cache[key][0] is not tokenizer:
        probe = encode(tokenizer, "a")
        full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        start = next((k for k in range(len(full) - len(probe) + 1) if full[k:k + len(probe)] == probe), 0)
        _leading_cache[key] = (tokenizer, full[:start])
    return list(_leading_cache[key][1])


def text_parts(conv: Conversation) -> tuple[str, str]:
    """(unscored prefix, scored text) of a record in the text format (module docstring)."""
    if conv.text is not None:
        return conv.text.prompt, conv.text.completion or ""
    return "", TEXT_SEPARATOR.join(m["content"] for m in conv.messages if m["content"])


def generation_prefix(conv: Conversation) -> str | None:
    """The text a generation continues in the text format (module docstring); None when there is none."""
    if conv.text is not None:
        return conv.text.prompt or conv.text.completion or None
    return first_user_content(conv.messages)


def first_user_content(messages: Sequence[dict]) -> str | None:
    return next((m["content"] for m in messages if m["role"] == "user" and m["content"]), None)


@dataclass(frozen=True)
class Rendering:
    """The rendering settings of a run (module docstring)."""

    format: str = "chat"
    chat_template: str | None = None  # the template text given by the user; None: the tokenizer's own
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None  # chat: replaces any system message (deepspec.data.chat)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} must be one of {list(FORMATS)}")
        if self.format == "text" and self.system_prompt is not None:
            raise ValueError("a system prompt is a chat setting: the text format renders none; leave it unset")
        object.__setattr__(self, "chat_template_kwargs", dict(self.chat_template_kwargs or {}))

    @property
    def is_text(self) -> bool:
        return self.format == "text"

    # --- what later stages agree with ------------------------------------------------------------------------
    def record(self) -> dict:
        """The settings a later stage must render with too (the text format reads no template settings)."""
        if self.is_text:
            return {"data_format": "text", "chat_template": None, "chat_template_kwargs": {}}
        return {"data_format": "chat", "chat_template": self.chat_template,
                "chat_template_kwargs": dict(self.chat_template_kwargs)}

    @classmethod
    def from_record(cls, recorded: Mapping | Any | None) -> Rendering:
        """The rendering of a record (a mapping, or an object such as a cache's meta or a drafter's config); one
        written before these settings were recorded is the chat format with the tokenizer's own template."""
        if isinstance(recorded, Mapping):
            get = recorded.get
        else:
            def get(key, default=None):
                return getattr(recorded, key, default)
        return cls(format=get("data_format") or "chat", chat_template=get("chat_template"),
                   chat_template_kwargs=get("chat_template_kwargs") or {})

    def check_recorded(self, recorded: Mapping | Any | None, recorded_where: str, fields: Mapping[str, str]) -> None:
        """Refuse data rendered otherwise than this (`fields` names the settings: format, chat_template,
        chat_template_kwargs)."""
        theirs = Rendering.from_record(recorded)
        if theirs.format != self.format:
            raise ValueError(f"{fields['format']}={self.format} but {recorded_where} was rendered in the "
                             f"{theirs.format} format: set {fields['format']}={theirs.format}, or rebuild it")
        if self.is_text:
            return
        if theirs.chat_template != self.chat_template:
            raise ValueError(f"{fields['chat_template']} gives {describe_template(self.chat_template)} but "
                             f"{recorded_where} was rendered with {describe_template(theirs.chat_template)}: "
                             f"configure the same template, or rebuild it")
        check_chat_template_kwargs(theirs.chat_template_kwargs, self.chat_template_kwargs, recorded_where,
                                   fields["chat_template_kwargs"])

    def describe(self) -> str:
        if self.is_text:
            return "in the text format"
        return (f"in the chat format with {describe_template(self.chat_template)} and chat_template_kwargs="
                f"{dict(self.chat_template_kwargs)}")

    # --- the tokenizer ---------------------------------------------------------------------------------------
    def chat_tokenizer(self, tokenizer):
        """The tokenizer the chat format renders with: `tokenizer`, or a shallow copy of it carrying the given
        template (the tokenizer itself, and so its fingerprint, is left as it is)."""
        if self.chat_template is None or getattr(tokenizer, "chat_template", None) == self.chat_template:
            return tokenizer
        key = (id(tokenizer), self.chat_template)
        if key not in _templated_cache or _templated_cache[key][0] is not tokenizer:
            templated = copy.copy(tokenizer)
            templated.chat_template = self.chat_template
            _templated_cache[key] = (tokenizer, templated)
        return _templated_cache[key][1]

    def check_tokenizer(self, tokenizer, options: RenderingOptions) -> None:
        """Fail at once where no record could be rendered: the chat format and no chat template (a base model).
        A given template is probed here too, so a broken one fails before any work."""
        if self.is_text:
            return
        templated = self.chat_tokenizer(tokenizer)
        if not getattr(templated, "chat_template", None):
            raise NoChatTemplate(f"the tokenizer of {tokenizer_name(tokenizer)!r} has no chat template (a base "
                                 f"model?): set {options.text_format} to use plain text, or give a chat template "
                                 f"with {options.chat_template}")
        end_of_turn_token_ids(templated, self.chat_template_kwargs)

    def stop_token_ids(self, tokenizer) -> list[int]:
        """Where a generation ends: the template's end-of-turn tokens (chat), the end-of-sequence token (text)."""
        if self.is_text:
            eos = tokenizer.eos_token_id
            return sorted(set(eos if isinstance(eos, list) else [] if eos is None else [eos]))
        return sorted(end_of_turn_token_ids(self.chat_tokenizer(tokenizer), self.chat_template_kwargs))

    # --- samples and prompts ---------------------------------------------------------------------------------
    def sample(self, tokenizer, conv: Conversation) -> RenderedSample:
        """Token ids and loss mask of a record (untruncated); raises `Skipped` for one this rendering cannot use."""
        if self.is_text:
            prefix, scored = text_parts(conv)
            head = leading_special_ids(tokenizer) + encode(tokenizer, prefix)
            tail = encode(tokenizer, scored)
            mask = [0] * len(head) + [1] * len(tail)
            if not head and tail:
                mask[0] = 0  # nothing precedes the first token
            return RenderedSample(input_ids=head + tail, loss_mask=mask, num_assistant_tokens=sum(mask))
        if not conv.messages:
            raise Skipped("text_record", "a plain-text record; the chat format renders conversations")
        try:
            return render_conversation(self.chat_tokenizer(tokenizer), conv.messages, system_prompt=self.system_prompt,
                                       chat_template_kwargs=self.chat_template_kwargs)
        except NoChatTemplate as err:
            raise Skipped("no_chat_template", str(err)) from None
        except ValueError as err:  # e.g. a conversation that starts with an assistant turn
            raise Skipped("render_error", str(err)) from None

    def text_prompt_ids(self, tokenizer, prefix: str | None) -> list[int]:
        """The text format's generation prompt: the prefix as a sample starts with it."""
        if not prefix:
            raise Skipped("no_prefix", "no text to continue (no prompt, text or user message)")
        return leading_special_ids(tokenizer) + encode(tokenizer, prefix)

    def prompt_ids(self, tokenizer, messages: Sequence[dict]) -> list[int]:
        """The generation prompt of a conversation ending with a user turn (evaluation): the chat template's
        (with the system prompt rule), or in the text format its first user message as a prefix."""
        if self.is_text:
            return self.text_prompt_ids(tokenizer, first_user_content(messages))
        try:
            return prompt_ids(self.chat_tokenizer(tokenizer), messages, self.system_prompt, self.chat_template_kwargs)
        except NoChatTemplate as err:
            raise Skipped("no_chat_template", str(err)) from None
        except ValueError as err:
            raise Skipped("render_error", str(err)) from None
