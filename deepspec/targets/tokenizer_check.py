"""Do two tokenizers map text to the same token ids? (a standalone drafter must share its target's tokenizer)

Checked in order, the first difference is reported: vocabulary size (`len(tokenizer)`, added tokens
included), every id's token string, the bos/eos/unk special tokens and the set of special tokens, then a
round trip of sample texts (both encode to the same ids, and the draft decodes the target's ids to the same
text). The pad token is not compared: the loaders set it to eos where a tokenizer has none, and padding never
reaches a real position of a forward.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prose, code, numbers, whitespace runs, non-Latin scripts and emoji: where BPE merges and byte fallbacks differ.
SAMPLE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "Speculative decoding keeps the target's output distribution: 3.14159, 1e-6, 2**32 = 4294967296.",
    "   leading spaces\ttabs\n\n\nand  double  spaces   ",
    "Übermäßig café naïve — “quotes” ‘single’ …",
    "日本語のテキストと中文文本，한국어 텍스트.",
    "emoji 🙂🚀 and symbols ∑∫√≤≥≠ <|im_start|> </s> <s>",
)


def _token(tokenizer, token_id: int) -> str:
    return repr(tokenizer.convert_ids_to_tokens(int(token_id)))


def _first_difference(a: Sequence, b: Sequence) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def tokenizer_mismatch(target_tokenizer, draft_tokenizer, texts: Sequence[str] = SAMPLE_TEXTS) -> str | None:
    """None when the draft tokenizer agrees with the target's; else the first difference, naming the token."""
    target_size, draft_size = len(target_tokenizer), len(draft_tokenizer)
    size = min(target_size, draft_size)
    target_vocab = target_tokenizer.convert_ids_to_tokens(list(range(size)))
    draft_vocab = draft_tokenizer.convert_ids_to_tokens(list(range(size)))
    index = _first_difference(target_vocab, draft_vocab)
    if index is not None:
        return f"token id {index}: target {target_vocab[index]!r}, draft {draft_vocab[index]!r}"
    if target_size != draft_size:
        longer, name = (target_tokenizer, "target") if target_size > draft_size else (draft_tokenizer, "draft")
        return (f"vocabulary size: target {target_size}, draft {draft_size} tokens (first token only the {name} has: "
                f"id {size} {_token(longer, size)})")
    for name in ("bos_token_id", "eos_token_id", "unk_token_id"):
        target_id, draft_id = getattr(target_tokenizer, name, None), getattr(draft_tokenizer, name, None)
        if target_id != draft_id:
            def show(tokenizer, token_id):
                return "none" if token_id is None else f"{_token(tokenizer, token_id)} (id {token_id})"

            return (f"{name.removesuffix('_id')}: target {show(target_tokenizer, target_id)}, "
                    f"draft {show(draft_tokenizer, draft_id)}")
    target_special, draft_special = set(target_tokenizer.all_special_ids), set(draft_tokenizer.all_special_ids)
    if target_special != draft_special:
        token_id = min(target_special ^ draft_special)
        owner = "target" if token_id in target_special else "draft"
        return f"special tokens: id {token_id} {_token(target_tokenizer, token_id)} is special for the {owner} only"
    for number, text in enumerate(texts):
        target_ids = target_tokenizer.encode(text, add_special_tokens=False)
        draft_ids = draft_tokenizer.encode(text, add_special_tokens=False)
        index = _first_difference(target_ids, draft_ids)
        if index is not None:
            def at(tokenizer, ids, index=index):
                return f"{_token(tokenizer, ids[index])} (id {ids[index]})" if index < len(ids) else "end of text"

            return (f"sample text {number} ({text[:24]!r}...): token {index}: "
                    f"target {at(target_tokenizer, target_ids)}, draft {at(draft_tokenizer, draft_ids)}")
        if draft_tokenizer.decode(target_ids) != target_tokenizer.decode(target_ids):
            return f"sample text {number} ({text[:24]!r}...): the draft decodes the target's ids to other text"
    return None


def check_same_tokenizer(target_tokenizer, draft_tokenizer, draft_name: str,
                         texts: Sequence[str] = SAMPLE_TEXTS) -> None:
    """Raise a ValueError naming the first difference unless `draft_name`'s tokenizer is the target's."""
    problem = tokenizer_mismatch(target_tokenizer, draft_tokenizer, texts)
    if problem is not None:
        raise ValueError(f"{draft_name} does not share the target's tokenizer ({problem}): a draft model must "
                         "produce the target's token ids")
