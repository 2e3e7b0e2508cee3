"""Acceptance-length tables like paper table 1: Markdown, CSV and JSON from one results dict.

Input: the dict `runner.evaluate` returns,
  {"settings": {"target", "benchmarks": [{"name", "domain", "num_prompts", ...}], "max_new_tokens",
                "temperature", "top_k", "top_p", ...},
   "drafters": {name: {"kind", "benchmarks": {bench: {"tau", "num_prompts", "num_rounds", ...}}}}}
Rows are drafters; columns are benchmarks grouped math | code | chat | other (input order within a
domain), then one macro average per domain present (mean of that domain's benchmark τ) and "Macro",
the mean of the domain averages (equal to the plain benchmark mean when domains have equal counts, as
in the paper). An average is left empty when any of its benchmarks is missing for that drafter.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from deepspec.evaluation.prompt_sets import DOMAINS
from deepspec.utils.io import atomic_write_json, atomic_write_text

MISSING = "–"


def _ordered_benchmarks(results: dict) -> list[dict]:
    benches = results.get("settings", {}).get("benchmarks")
    if not benches:
        raise ValueError("results.settings.benchmarks is missing or empty")
    for index, bench in enumerate(benches):
        if "name" not in bench or bench.get("domain") not in DOMAINS:
            raise ValueError(f"results.settings.benchmarks[{index}] needs a name and a domain in {DOMAINS}")
    return sorted(benches, key=lambda b: DOMAINS.index(b["domain"]))  # stable: input order within a domain


def _mean(values: list[float | None]) -> float | None:
    if not values or any(v is None for v in values):
        return None
    return sum(values) / len(values)


def table_data(results: dict) -> tuple[list[str], list[dict]]:
    """Column keys and one row per drafter: {"drafter", "kind", <bench>: tau, "avg:<domain>": .., "avg:macro": ..}."""
    benches = _ordered_benchmarks(results)
    domains = [d for d in DOMAINS if any(b["domain"] == d for b in benches)]
    columns = [b["name"] for b in benches] + [f"avg:{d}" for d in domains] + ["avg:macro"]
    drafters = results.get("drafters")
    if not drafters:
        raise ValueError("results.drafters is missing or empty")
    rows = []
    for name, entry in drafters.items():
        per_bench = entry.get("benchmarks", {})
        row = {"drafter": name, "kind": entry.get("kind", "")}
        for bench in benches:
            row[bench["name"]] = per_bench.get(bench["name"], {}).get("tau")
        domain_means = []
        for domain in domains:
            row[f"avg:{domain}"] = _mean([row[b["name"]] for b in benches if b["domain"] == domain])
            domain_means.append(row[f"avg:{domain}"])
        row["avg:macro"] = _mean(domain_means)
        rows.append(row)
    return columns, rows


def _column_label(key: str, benches: dict[str, str]) -> str:
    if key == "avg:macro":
        return "Macro"
    if key.startswith("avg:"):
        return f"{key[4:].capitalize()} avg"
    return f"{key} ({benches[key]})"


def caption(results: dict) -> str:
    s = results["settings"]
    prompts = ", ".join(f"{b['name']} {b.get('num_prompts', '?')}" for b in _ordered_benchmarks(results))
    policy = f"static threshold {s['threshold']}" if s.get("threshold") is not None else "fixed length"
    if s.get("verify_length") is not None:
        policy += f", at most {s['verify_length']} drafts verified"
    return (f"Acceptance length τ (tokens per decoding round: accepted drafts + bonus token). "
            f"Target `{s.get('target', '?')}`; temperature {s.get('temperature')} (top-k {s.get('top_k', 0)}, "
            f"top-p {s.get('top_p', 1.0)}); max new tokens {s.get('max_new_tokens')}; prompts: {prompts}; "
            f"verification: {policy}; seed {s.get('seed')}.")


def render_markdown(results: dict, digits: int = 2) -> str:
    columns, rows = table_data(results)
    domain_of = {b["name"]: b["domain"] for b in results["settings"]["benchmarks"]}
    header = ["Drafter"] + [_column_label(c, domain_of) for c in columns]
    lines = [caption(results), "", "| " + " | ".join(header) + " |",
             "|" + "|".join([":---"] + ["---:"] * len(columns)) + "|"]
    for row in rows:
        cells = [row["drafter"]] + [MISSING if row[c] is None else f"{row[c]:.{digits}f}" for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


CSV_FIELDS = ("drafter", "kind", "benchmark", "domain", "tau", "num_prompts", "num_rounds", "max_new_tokens",
              "temperature", "top_k", "top_p")


def render_csv(results: dict) -> str:
    """Long format: one line per (drafter, benchmark) and per (drafter, average); settings on every line."""
    columns, rows = table_data(results)
    settings = results["settings"]
    domain_of = {b["name"]: b["domain"] for b in settings["benchmarks"]}
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        per_bench = results["drafters"][row["drafter"]].get("benchmarks", {})
        for key in columns:
            is_avg = key.startswith("avg:")
            stats = {} if is_avg else per_bench.get(key, {})
            writer.writerow({"drafter": row["drafter"], "kind": row["kind"], "benchmark": key,
                             "domain": key[4:] if is_avg else domain_of[key],
                             "tau": "" if row[key] is None else f"{row[key]:.6g}",
                             "num_prompts": stats.get("num_prompts", ""), "num_rounds": stats.get("num_rounds", ""),
                             "max_new_tokens": settings.get("max_new_tokens"),
                             "temperature": settings.get("temperature"), "top_k": settings.get("top_k", 0),
                             "top_p": settings.get("top_p", 1.0)})
    return buffer.getvalue()


def results_json(results: dict) -> dict:
    """The results dict plus the rendered table (columns, rows) for programmatic use."""
    columns, rows = table_data(results)
    return {**results, "table": {"columns": columns, "rows": rows, "caption": caption(results)}}


def write_tables(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write table.md, results.csv and results.json into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "table.md", "csv": out / "results.csv", "json": out / "results.json"}
    atomic_write_text(paths["markdown"], render_markdown(results))
    atomic_write_text(paths["csv"], render_csv(results))
    atomic_write_json(paths["json"], results_json(results))
    return paths
