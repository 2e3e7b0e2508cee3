"""The model card (`README.md`) of an exported drafter: what it is, its measured τ, how it was trained, how to run it.

Numbers come only from files the user hands over: the τ table from an evaluation results JSON, the
training budget from the checkpoint's `trainer_state.json` and the data/optimisation settings from the
run's resolved `config.yaml` (`<run>/checkpoints/step-N/` layout of `deepspec.training.checkpoint`).
Without them the card says "not evaluated" / "no training record" — it never invents a number.

Accepted τ results schemas (rows = drafters, columns = benchmarks):
- `eval/evaluate.py`'s `results.json` (`deepspec.evaluation.tables`): `{"settings": {..., "benchmarks":
  [{"name", ...}]}, "drafters": {name: {"kind", "benchmarks": {bench: {"tau", ...}}}}}`;
- `{"results": [{"drafter": "dspark", "benchmark": "gsm8k", "tau": 5.1}, ...]}` (the value key may be
  `tau`, `acceptance_length` or `mean_accepted_tokens`);
- `{"tau": {"dspark": {"gsm8k": 5.1, ...}, ...}}` or the same mapping at the top level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepspec.data.rendering import Rendering
from deepspec.utils.io import read_json

_TAU_KEYS = ("tau", "acceptance_length", "mean_accepted_tokens")


@dataclass
class TauTable:
    drafters: list[str]
    benchmarks: list[str]
    values: dict[tuple[str, str], float]
    source: str = ""
    settings: dict[str, Any] = field(default_factory=dict)  # scalar evaluation settings (temperature, ...)


@dataclass
class ModelCardInputs:
    tau_table: TauTable | None = None
    training: dict[str, Any] | None = None  # scalar facts from trainer_state.json
    training_source: str = ""
    run_config: dict[str, Any] | None = None  # data / budget / optimisation fields of the run's config.yaml
    run_config_source: str = ""
    # An offline run's data: what its cache was built with (its meta.json), named as the cache job's
    cache_settings: dict[str, Any] | None = None
    cache_settings_source: str = ""  # the meta.json read, or the data.cache_dir not found
    commands: list[str] = field(default_factory=list)  # exact commands that produced this export


def _as_float(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{where}: expected a finite number, got {value!r}")
    return float(value)


def load_tau_table(path: str | Path) -> TauTable:
    """Parse an evaluation results JSON into a drafters x benchmarks τ table (schemas: module docstring)."""
    path = Path(path)
    data = read_json(path)
    values: dict[tuple[str, str], float] = {}
    settings: dict[str, Any] = {}
    if isinstance(data, dict) and isinstance(data.get("drafters"), dict):
        raw_settings = data.get("settings") or {}
        settings = {k: v for k, v in raw_settings.items() if isinstance(v, (str, int, float, bool))}
        order = [b.get("name") for b in raw_settings.get("benchmarks", []) if isinstance(b, dict)]
        for drafter, entry in data["drafters"].items():
            benchmarks = entry.get("benchmarks") if isinstance(entry, dict) else None
            if not isinstance(benchmarks, dict):
                raise ValueError(f"{path}: drafters[{drafter!r}].benchmarks must map benchmark -> results")
            for bench in sorted(benchmarks, key=lambda b: order.index(b) if b in order else len(order)):
                tau = benchmarks[bench].get("tau") if isinstance(benchmarks[bench], dict) else None
                if tau is not None:  # a benchmark not run for this drafter stays an empty cell
                    values[(str(drafter), str(bench))] = _as_float(tau, f"{path}: drafters[{drafter!r}][{bench!r}].tau")
    elif isinstance(data, dict) and isinstance(data.get("results"), list):
        for index, record in enumerate(data["results"]):
            where = f"{path}: results[{index}]"
            if not isinstance(record, dict) or "drafter" not in record or "benchmark" not in record:
                raise ValueError(f"{where}: each record needs 'drafter' and 'benchmark'")
            key = next((k for k in _TAU_KEYS if k in record), None)
            if key is None:
                raise ValueError(f"{where}: no τ value (one of {_TAU_KEYS})")
            values[(str(record["drafter"]), str(record["benchmark"]))] = _as_float(record[key], f"{where}.{key}")
    else:
        table = data.get("tau", data) if isinstance(data, dict) else None
        if not isinstance(table, dict) or not table:
            raise ValueError(f"{path}: not a τ results file "
                             "(expected 'results' records or a drafter -> benchmark -> τ mapping)")
        for drafter, row in table.items():
            if not isinstance(row, dict):
                raise ValueError(f"{path}: tau[{drafter!r}] must map benchmark -> τ, got {type(row).__name__}")
            for benchmark, value in row.items():
                values[(str(drafter), str(benchmark))] = _as_float(value, f"{path}: tau[{drafter!r}][{benchmark!r}]")
    drafters = list(dict.fromkeys(d for d, _ in values))
    benchmarks = list(dict.fromkeys(b for _, b in values))
    if not values:
        raise ValueError(f"{path}: no τ values found")
    return TauTable(drafters=drafters, benchmarks=benchmarks, values=values, source=str(path), settings=settings)


def _scalars(mapping: dict, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts to dotted keys, keeping scalars and short scalar lists (no RNG states)."""
    facts: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            facts.update(_scalars(value, f"{prefix}{key}."))
        elif isinstance(value, (str, int, float, bool)) or (
                isinstance(value, list) and len(value) <= 16 and all(isinstance(x, (str, int, float)) for x in value)):
            facts[f"{prefix}{key}"] = value
    return facts


_RUN_CONFIG_SECTIONS = ("target", "drafter", "data", "loss", "optim", "trainer")
_RUN_CONFIG_SKIP = ("trainer.progress_bar", "trainer.log_every", "trainer.resume", "trainer.device", "target.device")
# What a run does not read (deepspec.training.config.DataSchema): offline, the online data and
# cache settings (the cache in data.cache_dir was built with its own); online or hybrid, the cache
# job's folder and batching.
_UNREAD_OFFLINE = ("data.source.", "data.cache.", "data.online_batch", "data.target_sharding")
_UNREAD_ONLINE = ("data.cache.out_dir", "data.cache.batch_size", "data.cache.batch_tokens")


def _read_settings(facts: dict[str, Any]) -> dict[str, Any]:
    offline = facts.get("data.features", "offline") == "offline"
    unread = _UNREAD_OFFLINE if offline else _UNREAD_ONLINE
    return {k: v for k, v in facts.items() if not k.startswith(unread)}


def _cache_settings(cache_dir: str, run_dir: Path) -> dict[str, Any]:
    """The settings the cache in `cache_dir` was built with, named as `deepspec cache` takes them;
    a relative `cache_dir` is looked for from here, then from the run folder's parents (where the
    run may have started)."""
    given = Path(cache_dir)
    folders = [given] if given.is_absolute() else [given, *(up / given for up in run_dir.parents)]
    meta_path = next((f / "meta.json" for f in folders if (f / "meta.json").is_file()), None)
    if meta_path is None:
        return {"cache_settings_source": cache_dir}
    meta = read_json(meta_path)
    source, counts = meta.get("source") or {}, meta.get("counts") or {}
    settings = {"data.prompts": source.get("prompts"),
                "data.format": meta.get("data_format", "chat"),
                "data.limit": source.get("limit"), "data.val_fraction": source.get("val_fraction"),
                "data.test_fraction": source.get("test_fraction"), "data.seed": source.get("seed"),
                "data.system_prompt": meta.get("system_prompt"),
                "cache.max_length": meta.get("max_length"),
                "cache.layer_ids": meta.get("layer_ids"), "cache.content": meta.get("content"),
                "cache.storage_dtype": meta.get("storage_dtype"),
                "samples": counts.get("samples"), "tokens": counts.get("tokens"),
                "truncated_to_max_length": counts.get("truncated_to_max_length")}
    return {"cache_settings": settings, "cache_settings_source": str(meta_path)}


def load_training_record(checkpoint_dir: str | Path) -> dict[str, Any]:
    """`ModelCardInputs` fields from the checkpoint: trainer_state.json (budget) and the run's config.yaml."""
    checkpoint_dir = Path(checkpoint_dir)
    found: dict[str, Any] = {}
    for folder in (checkpoint_dir, checkpoint_dir.parent):
        path = folder / "trainer_state.json"
        if path.is_file():
            state = read_json(path)
            if not isinstance(state, dict):
                raise ValueError(f"{path}: expected a JSON object")
            found.update(training={k: v for k, v in _scalars(state).items() if not k.startswith("rng.")},
                         training_source=str(path))
            break
    for folder in list(checkpoint_dir.parents)[:3] + [checkpoint_dir]:
        path = folder / "config.yaml"
        if path.is_file():
            import yaml

            try:
                config = yaml.safe_load(path.read_text())
            except yaml.YAMLError as error:
                raise ValueError(f"{path}: invalid YAML ({error})") from None
            if isinstance(config, dict) and any(section in config for section in _RUN_CONFIG_SECTIONS):
                sections = {k: config[k] for k in _RUN_CONFIG_SECTIONS if isinstance(config.get(k), dict)}
                facts = {k: v for k, v in _scalars(sections).items() if k not in _RUN_CONFIG_SKIP}
                found.update(run_config=_read_settings(facts), run_config_source=str(path))
                offline = facts.get("data.features", "offline") == "offline"
                if offline and "data.cache_dir" in facts:
                    found.update(_cache_settings(str(facts["data.cache_dir"]), path.parent))
                break
    return found


def _tau_section(table: TauTable | None) -> list[str]:
    lines = ["## Acceptance length τ", ""]
    if table is None:
        lines += ["Not evaluated: no evaluation results were given at export time.", ""]
        return lines
    lines += [f"Mean accepted tokens per target forward (τ), from `{Path(table.source).name}`.", ""]
    if table.settings:
        lines += ["Settings: " + ", ".join(f"{k}={v}" for k, v in table.settings.items()) + ".", ""]
    lines.append("| drafter | " + " | ".join(table.benchmarks) + " |")
    lines.append("|---" * (len(table.benchmarks) + 1) + "|")
    for drafter in table.drafters:
        cells = [f"{table.values[(drafter, b)]:.2f}" if (drafter, b) in table.values else "–" for b in table.benchmarks]
        lines.append(f"| {drafter} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def render_model_card(config, inputs: ModelCardInputs) -> str:
    kind = type(config).drafter_kind
    target = config.target_name or "(unknown target)"
    facts = [
        ("drafter kind", kind),
        ("target", f"`{target}` (revision `{config.target_revision or 'unknown'}`)"),
        ("target layer ids", (f"{config.target_layer_ids} (convention `{config.layer_id_convention}`: id l = output "
                             f"of decoder layer l = transformers `hidden_states[l + 1]`)")),
        ("draft layers", str(config.num_draft_layers)),
        # How its training data (and so the prompts it drafts for) were rendered: chat template or plain text.
        ("training data", f"rendered {Rendering.from_record(config).describe()}"),
    ]
    recorded = config.to_dict()  # the fields this kind's config.json holds
    for name, label in (("block_size", "block size"), ("block_convention", "block convention"),
                        ("mask_token_id", "mask token id"),
                        ("sequential_head", "sequential head"), ("markov_rank", "Markov rank"),
                        ("confidence_head", "confidence head"),
                        ("calibration_temperatures", "calibration temperatures"),
                        ("ttt_steps", "TTT steps"), ("draft_vocab_size", "draft vocabulary size"),
                        ("num_mtp_modules", "MTP modules")):
        if name in recorded:
            facts.append((label, str(recorded[name])))
    lines = [
        "---",
        "library_name: deepspec",
        f"base_model: {target}",
        "tags:",
        "- speculative-decoding",
        "- deepspec",
        f"- {kind}",
        "---",
        "",
        f"# {kind} drafter for {target}",
        "",
        ("A draft model for speculative decoding trained with DeepSpec against a frozen target. The target's "
        "embedding and LM head are shared and not stored here: load the drafter together with the target."),
        "",
        "| field | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in facts],
        "",
        *_tau_section(inputs.tau_table),
        "## Training",
        "",
    ]
    if inputs.training:
        lines += [f"Budget, from `{Path(inputs.training_source).name}`:", "", "| field | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in inputs.training.items()]
    else:
        lines.append("No training record (trainer_state.json) was found next to the checkpoint.")
    if inputs.run_config:
        lines += ["", f"Data and settings, from the run's `{Path(inputs.run_config_source).name}`:", "",
                  "| field | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in inputs.run_config.items()]
    if inputs.cache_settings:
        lines += ["", "The cache it trained on (data.cache_dir) was built with, from "
                  f"`{inputs.cache_settings_source}`:", "", "| field | value |", "|---|---|"]
        lines += [f"| {k} | {'null' if v is None else v} |"
                  for k, v in inputs.cache_settings.items()]
    elif inputs.cache_settings_source:
        lines += ["", "The cache it trained on (data.cache_dir="
                  f"{inputs.cache_settings_source}) was not found at export time: the settings it "
                  "was built with are not shown."]
    lines += [
        "",
        "## Usage",
        "",
        "```python",
        "from deepspec.targets.load import load_target",
        "from deepspec.drafters.build import load_drafter",
        "",
        f"target = load_target({target!r})",
        "drafter = load_drafter('path/to/this/folder', target)",
        "```",
        "",
    ]
    serving = _serving_section(config)
    if serving:
        lines += serving
    if inputs.commands:
        lines += ["Commands that produced this export:", "", "```bash", *inputs.commands, "```", ""]
    return "\n".join(lines)


def _serving_section(config) -> list[str]:
    """Engine caveats of this drafter's serving layouts (`deepspec export --format ...`)."""
    from deepspec.export.sglang import specforge_dspark_note

    note = specforge_dspark_note(config)
    if not note:
        return []
    return ["## Serving", "", f"SGLang / SpecForge (`deepspec export --format sglang`): {note}.", ""]
