"""Render conversations with the target's chat template and derive the assistant loss mask.

The mask comes from rendering *prefixes*, never from guessing offsets: for assistant turn i,
  A_i = render(messages[:i], add_generation_prompt=True)   (everything the model sees before answering)
  B_i = render(messages[:i+1])                               (the same plus the answer)
and the text B_i - A_i (answer + end-of-turn marker + template whitespace) is the turn's contribution.
Its tokens are marked up to and including the last end-of-turn token; the role header belongs to A_i
(the generation prompt), trailing newlines after the end-of-turn token are never generated and stay 0.

Token ids are the concatenation of the separately tokenised segments [0, A_1), [A_1, B_1), [B_1, A_2), ...
so a prompt's ids are by construction a token prefix of the full sample (BPE merges across a segment
boundary cannot shift the mask), and `prompt_ids` - used for generation and evaluation - walks the same
segments, so the training sample and the generation prompt agree token for token.

System prompt rule (the same for regeneration, caching and evaluation): nothing is injected unless
`system_prompt` is given, in which case it replaces any system message of the conversation. A template
that adds its own default system prompt (SmolLM2's ChatML does) adds it in every path alike.

Template options (`chat_template_kwargs`, e.g. Qwen3's `{"enable_thinking": false}` for non-thinking mode) are
the target config's `target.chat_template_kwargs`; every rendering here takes them, and regeneration, the cache
(its meta.json records them) and evaluation pass the same ones, so prompts, answers and loss masks agree.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PROBE_ANSWER = "DEEPSPEC_PROBE_ANSWER"
_end_of_turn_cache: dict[tuple[int, int, str, str], frozenset[int]] = {}


@dataclass
class RenderedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant answer tokens and their end-of-turn token, else 0
    num_assistant_tokens: int


def apply_system_prompt(messages: Sequence[dict], system_prompt: str | None) -> list[dict]:
    """The conversation as it is rendered: a configured system prompt replaces any existing one."""
    messages = [dict(m) for m in messages]
    if system_prompt is None:
        return messages
    if messages and messages[0]["role"] == "system":
        messages = messages[1:]
    return [{"role": "system", "content": system_prompt}] + messages


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template (a base model) and none was given."""


def tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool,
                chat_template_kwargs: Mapping | None = None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(f"the tokenizer of {tokenizer_name(tokenizer)!r} has no chat template")
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **dict(chat_template_kwargs or {}))


def encode(tokenizer, text: str) -> list[int]:
    # The template text already carries BOS/special tokens; adding them again would double BOS.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def end_of_turn_token_ids(tokenizer, chat_template_kwargs: Mapping | None = None) -> frozenset[int]:
    """Special tokens the template appends after an assistant answer (probed), plus eos.

    Generation stops at these and the loss mask ends at the last of them in each assistant turn.
    """
    key = (id(tokenizer), len(tokenizer), str(tokenizer.chat_template),
           json.dumps(dict(chat_template_kwargs or {}), sort_keys=True))
    if key in _end_of_turn_cache:
        return _end_of_turn_cache[key]
    ids = set()
    eos = tokenizer.eos_token_id
    if eos is not None:
        ids.update(eos if isinstance(eos, list) else [eos])
    user = {"role": "user", "content": "hi"}
    prompt = render_text(tokenizer, [user], True, chat_template_kwargs)
    full = render_text(tokenizer, [user, {"role": "assistant", "content": _PROBE_ANSWER}], False, chat_template_kwargs)
    at = full.find(_PROBE_ANSWER, len(prompt) if full.startswith(prompt) else 0)
    if at >= 0:
        special_ids = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        ids.update(i for i in encode(tokenizer, full[at + len(_PROBE_ANSWER):]) if i in special_ids)
    if not ids:
        raise ValueError("cannot find an end-of-turn token: tokenizer has no eos and the chat template "
                         "appends no special token after an assistant message")
    _end_of_turn_cache[key] = frozenset(ids)
    return _end_of_turn_cache[key]


def _check_prefix(prefix: str, full: str, what: str) -> None:
    if not full.startswith(prefix):
        at = next((k for k, (a, b) in enumerate(zip(prefix, full)) if a != b), min(len(prefix), len(full)))
        raise ValueError(
            f"chat template is not prefix-consistent: {what} (first difference at char {at}: "
            f"{prefix[at:at + 40]!r} vs {full[at:at + 40]!r}). Templates that rewrite earlier turns "
            "(strip reasoning, inject dates, special-case the last turn) cannot be masked by prefix "
            "rendering; use a template without that behaviour")


def _render_segments(tokenizer, messages: Sequence[dict], add_generation_prompt: bool,
                     chat_template_kwargs: Mapping | None = None) -> tuple[list[int], list[int]]:
    """Token ids and assistant mask of `messages` (already including any configured system prompt)."""
    first_turn = next((m for m in messages if m["role"] != "system"), None)
    if first_turn is not None and first_turn["role"] == "assistant":
        raise ValueError("conversation starts with an assistant message; the first non-system message must "
                         "be a user message")
    end_ids = end_of_turn_token_ids(tokenizer, chat_template_kwargs)
    input_ids: list[int] = []
    loss_mask: list[int] = []
    done_chars = 0  # characters of the final text already tokenised
    done_text = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_text(tokenizer, messages[:i], True, chat_template_kwargs)
        after = render_text(tokenizer, messages[:i + 1], False, chat_template_kwargs)
        _check_prefix(done_text, before, f"rendering messages[:{i}] does not extend the earlier prefix")
        _check_prefix(before, after, f"messages[:{i}] with add_generation_prompt=True is not a prefix of "
                                     f"messages[:{i + 1}]")
        prompt_part = encode(tokenizer, before[done_chars:])
        answer_part = encode(tokenizer, after[len(before):])
        last_end = max((k for k, t in enumerate(answer_part) if t in end_ids), default=len(answer_part) - 1)
        input_ids += prompt_part + answer_part
        loss_mask += [0] * len(prompt_part) + [1] * (last_end + 1) + [0] * (len(answer_part) - last_end - 1)
        done_chars, done_text = len(after), after
    final = render_text(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    _check_prefix(done_text, final, "the full rendering does not extend the last assistant prefix")
    tail = encode(tokenizer, final[done_chars:])
    return input_ids + tail, loss_mask + [0] * len(tail)


def render_conversation(tokenizer, messages: Sequence[dict], system_prompt: str | None = None,
                        max_length: int | None = None, chat_template_kwargs: Mapping | None = None) -> RenderedSample:
    """Token ids and assistant loss mask of a whole conversation (see module docstring).

    A sample whose mask is all zero (no assistant turn, or truncated before it) is returned with
    num_assistant_tokens == 0: callers count and skip it (`count_and_warn`).
    """
    input_ids, loss_mask = _render_segments(tokenizer, apply_system_prompt(messages, system_prompt),
                                            add_generation_prompt=False, chat_template_kwargs=chat_template_kwargs)
    if max_length is not None:
        if max_length <= 0:
            raise ValueError(f"max_length={max_length} must be positive")
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return RenderedSample(input_ids=input_ids, loss_mask=loss_mask, num_assistant_tokens=sum(loss_mask))


def prompt_ids(tokenizer, messages: Sequence[dict], system_prompt: str | None = None,
               chat_template_kwargs: Mapping | None = None) -> list[int]:
    """Generation prompt for the next assistant turn; equals the corresponding prefix of the rendered sample."""
    if not messages or messages[-1]["role"] == "assistant":
        raise ValueError("prompt_ids needs a conversation ending with a user (or system) message")
    input_ids, _ = _render_segments(tokenizer, apply_system_prompt(messages, system_prompt),
                                    add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
    return input_ids


def check_chat_template_kwargs(recorded: Mapping | None, configured: Mapping | None, recorded_where: str,
                               field: str) -> None:
    """Refuse to mix renderings: data rendered with one set of template options (`recorded`, e.g. a cache's
    meta.json) and a run configured with another (`field`). Nothing recorded means no options."""
    recorded, configured = dict(recorded or {}), dict(configured or {})
    if recorded != configured:
        raise ValueError(f"{field}={configured} but {recorded_where} was rendered with chat_template_kwargs="
                         f"{recorded}: prompts, answers and loss masks would come from different chat renderings "
                         f"(e.g. Qwen3 thinking vs non-thinking). Configure the same options, or rebuild it")


def count_and_warn(samples: Iterable[RenderedSample], where: str = "") -> int:
    """Number of samples without any assistant token; logs a warning when there are any."""
    samples = list(samples)
    num_empty = sum(1 for s in samples if s.num_assistant_tokens == 0)
    if num_empty:
        log.warning("%s%d of %d samples have no assistant tokens (all-zero loss mask); they are skipped",
                    f"{where}: " if where else "", num_empty, len(samples))
    return num_empty
