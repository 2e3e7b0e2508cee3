"""Keep benchmark prompts out of training prompts: `deepspec decontaminate`.

    deepspec decontaminate --prompts sharegpt --benchmarks humaneval mt-bench.jsonl gsm8k.jsonl \
        --out prompts.jsonl [--limit 4000] [--ngram 13]

A training conversation is contaminated when one of its user turns shares a word n-gram (13 words by default,
the usual decontamination window) with any user turn of a benchmark, or, for a benchmark turn shorter than the
window, contains that whole turn. Words are lowercased runs of letters and digits, so whitespace, punctuation and
markup do not hide a copy. Every benchmark turn counts, not only the first one `deepspec evaluate` prompts with.
The kept conversations are written in input order as chat JSONL (`{"id", "conversations"}`, what `deepspec
regenerate --prompts` reads), atomically; the dropped ones are counted and the first few named with the benchmark
prompt they match.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from deepspec.data.sources import Conversation, load_prompts, require_conversations
from deepspec.evaluation.prompt_sets import load_benchmark_conversations
from deepspec.utils.io import atomic_write_text

log = logging.getLogger(__name__)
WORD = re.compile(r"[0-9a-z]+")
DEFAULT_NGRAM = 13
NAMED = 5


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def ngrams(tokens: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


@dataclass
class BenchmarkIndex:
    """The n-grams of every benchmark user turn (and the short turns whole), each naming its prompt."""

    n: int
    grams: dict[tuple[str, ...], str] = field(default_factory=dict)
    short: dict[tuple[str, ...], str] = field(default_factory=dict)

    def add(self, text: str, where: str) -> None:
        tokens = words(text)
        if len(tokens) < self.n:
            if tokens:
                self.short.setdefault(tuple(tokens), where)
            return
        for gram in ngrams(tokens, self.n):
            self.grams.setdefault(gram, where)

    def match(self, text: str) -> str | None:
        """The benchmark prompt `text` overlaps, or None."""
        tokens = words(text)
        for gram in ngrams(tokens, self.n):
            if gram in self.grams:
                return self.grams[gram]
        for short, where in self.short.items():
            if _contains(tokens, short):
                return where
        return None


def _contains(tokens: list[str], run: tuple[str, ...]) -> bool:
    width = len(run)
    return any(tuple(tokens[i:i + width]) == run for i in range(len(tokens) - width + 1))


def benchmark_index(specs: list[str], n: int = DEFAULT_NGRAM) -> BenchmarkIndex:
    if n < 1:
        raise ValueError(f"--ngram {n}: must be >= 1")
    index = BenchmarkIndex(n=n)
    for spec in specs:
        name, conversations = load_benchmark_conversations(spec)
        turns = 0
        for conv in conversations:
            for message in conv.messages:
                if message["role"] == "user":
                    index.add(message["content"], f"{name} {conv.where}")
                    turns += 1
        log.info("benchmark %s: %d user turns indexed", name, turns)
    return index


@dataclass
class Decontamination:
    kept: list[Conversation]
    dropped: list[tuple[str, str]]  # (training record, the benchmark prompt it matches)

    def summary(self) -> str:
        total = len(self.kept) + len(self.dropped)
        text = f"kept {len(self.kept)} of {total} conversations; {len(self.dropped)} overlap a benchmark prompt"
        if self.dropped:
            named = "; ".join(f"{conv} ~ {bench}" for conv, bench in self.dropped[:NAMED])
            text += f" (first: {named})"
        return text


def decontaminate(conversations: list[Conversation], index: BenchmarkIndex) -> Decontamination:
    kept, dropped = [], []
    for conv in conversations:
        match = next((hit for m in conv.messages if m["role"] == "user" and (hit := index.match(m["content"]))),
                     None)
        if match is None:
            kept.append(conv)
        else:
            dropped.append((conv.where, match))
    return Decontamination(kept=kept, dropped=dropped)


def write_conversations(conversations: list[Conversation], out: str | Path) -> None:
    lines = [json.dumps({"id": conv.id, "conversations": conv.messages}, ensure_ascii=False)
             for conv in conversations]
    atomic_write_text(out, "".join(line + "\n" for line in lines))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="sharegpt | path.jsonl | path.json | hf:name[:split]")
    p.add_argument("--benchmarks", nargs="+", required=True,
                   help="benchmark specs, as `deepspec evaluate --benchmarks` takes them")
    p.add_argument("--out", required=True, help="the kept conversations, chat JSONL")
    p.add_argument("--limit", type=int, help="keep at most this many conversations (after decontamination)")
    p.add_argument("--ngram", type=int, default=DEFAULT_NGRAM, help="words in the overlap window")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit {args.limit}: must be positive")
    conversations, report = load_prompts(args.prompts)
    require_conversations(conversations, report, "--prompts")
    result = decontaminate(conversations, benchmark_index(args.benchmarks, args.ngram))
    kept = result.kept[:args.limit] if args.limit is not None else result.kept
    write_conversations(kept, args.out)
    print(result.summary() + f"; wrote {len(kept)} to {args.out}")
    return 0
