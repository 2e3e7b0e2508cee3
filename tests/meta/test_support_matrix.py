"""The support matrix in the docs is the code's: which export layouts each drafter kind has for each target family,
with the target's draft layers or another family's (`drafter.layer_family`; the drafter specs' `export_layouts`, the
format modules' `LAYER_FAMILIES` and `TARGET_FAMILIES`, through `deepspec.export.formats_for`), and which engine reads
each layout, which draft layers it builds, which targets it serves and under which conditions (`FUSED_LAYER_COUNTS`,
`FULL_VOCABULARY_ONLY`, `ENGINE_LAYOUTS`).

Every file holding the markers below must carry exactly the table `render()` makes. After a change to the
registries, rewrite them with `python tests/meta/test_support_matrix.py --write` (and say in READER which engine
reads a new layout)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
DOCUMENTS = ("README.md", "docs/support-matrix.md")

FAMILY_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3_text": "Gemma 3"}
KIND_NAMES = {"dspark": "DSpark", "dflash": "DFlash", "eagle3": "EAGLE-3", "mtp": "MTP", "standalone": "standalone LM"}
# (format, engine architecture) -> who reads that layout, with the versions the layout was read against
# (deepspec/export/README.md, docs/interop.md). "checked" readers load and run every such folder in
# tests/export/consumers; the serving engines need CUDA and were read from source.
READER = {
    ("hf", "deepspec"): "DeepSpec itself (`deepspec evaluate`, `load_exported`); no serving engine",
    ("sglang", "eagle3"): "SGLang 0.5.23 `LlamaForCausalLMEagle3` (`--speculative-algorithm EAGLE3`); "
                          "checked: SpecForge 0.2.0",
    ("sglang", "dflash"): "SGLang 0.5.14-0.5.23 `DFlashDraftModel` (`--speculative-algorithm DFLASH`); "
                          "checked: dflash 0.1.0, SpecForge 0.2.0",
    ("sglang", "dspark"): "SGLang 0.5.23 `DSparkDraftModel` (`--speculative-algorithm DSPARK`); "
                          "checked: SpecForge 0.2.0 (mask-predicts drafters only)",
    ("vllm", "eagle3"): "vLLM 0.33.0 (`\"method\": \"eagle3\"`); checked: speculators 0.9.0",
    ("vllm", "dflash"): "vLLM 0.33.0 (`\"method\": \"dflash\"`); checked: speculators 0.9.0",
    ("vllm", "dspark"): "vLLM 0.33.0 (`\"method\": \"dspark\"`); checked: speculators 0.9.0",
    ("vllm", "mtp"): "speculators 0.9.0 (checked); vLLM 0.33.0 has no `mtp` speculators type: not served",
    ("nextn", "mtp"): "SGLang 0.5.23 `DeepseekV3ForCausalLMNextN`, DeepSeek-V3 targets only "
                      "(no family DeepSpec loads today)",
    ("causal_lm", "causal_lm"): "vLLM 0.33.0 (`\"method\": \"draft_model\"`), SGLang 0.5.14-0.5.23 "
                                "(`--speculative-algorithm STANDALONE`); checked: transformers",
}


def conditions(fmt: str, architecture: str) -> str:
    """What a trained drafter must be for the layout to take it, from the format module's constants."""
    from deepspec.drafters.block.config import ENGINE_UNREAD_EXTENSIONS
    from deepspec.export import ENGINE_LAYOUTS, format_module
    from deepspec.export.sglang import BLOCK_ARCHS

    module = format_module(fmt)
    notes = []
    fused = getattr(module, "FUSED_LAYER_COUNTS", {}).get(architecture)
    if fused is not None:
        notes.append(f"exactly {fused} fused target layers (`drafter.feature_layers=low_mid_high`)")
    if architecture in getattr(module, "FULL_VOCABULARY_ONLY", ()):
        notes.append("full vocabulary")
    if fmt in ENGINE_LAYOUTS and architecture in BLOCK_ARCHS:  # the extensions no engine reads
        notes += [f"no {name.replace('_', ' ')} (`drafter.{name}=none`)" for name in ENGINE_UNREAD_EXTENSIONS]
    if architecture == "dflash" and fmt in ENGINE_LAYOUTS:
        notes.append("mask-predicts (DFlash's default)")
    if architecture == "dspark" and fmt in ENGINE_LAYOUTS:
        notes.append("a sequential head (`drafter.sequential_head` markov or rnn)")
    if architecture == "dspark" and fmt == "vllm":
        notes.append("no mask-predicts RNN head")
    if fmt == "vllm" and architecture == "mtp":
        notes.append("1 MTP module")
    return "; ".join(notes) or "-"


def engine_layer_families(kind: str) -> list[str]:
    """The draft-layer family each engine layout of `kind` asks to train with (the first of its `LAYER_FAMILIES`,
    what its refusal names): a row of its own each."""
    from deepspec.drafters.spec import get_drafter_spec
    from deepspec.export import format_module

    found = {format_module(fmt).LAYER_FAMILIES[arch][0] for fmt, arch in get_drafter_spec(kind).export_layouts.items()
             if format_module(fmt).LAYER_FAMILIES[arch]}
    return sorted(found, key=list(FAMILY_NAMES).index)


def family_names(families) -> str:
    """A layout's `LAYER_FAMILIES` / `TARGET_FAMILIES` entry in words (None: any)."""
    if families is None:
        return "any"
    return ", ".join(FAMILY_NAMES.get(f, f) for f in sorted(families, key=lambda f: (f not in FAMILY_NAMES, f)))


def render() -> str:
    from deepspec.drafters.spec import BUILTIN_KINDS, get_drafter_spec
    from deepspec.export import format_module, formats_for
    from deepspec.targets.family import supported_model_types

    families = sorted(supported_model_types(), key=list(FAMILY_NAMES).index)
    lines = ["| drafter kind | draft layers | " + " | ".join(FAMILY_NAMES[f] for f in families) + " |",
             "|---|---|" + "---|" * len(families)]
    for kind in BUILTIN_KINDS:
        for layer_family in [None, *engine_layer_families(kind)]:
            cells = [", ".join(f"`{fmt}`" for fmt in formats_for(kind, family, layer_family=layer_family))
                     for family in families]
            layers = "the target's" if layer_family is None else f"`layer_family={layer_family}`"
            lines.append(f"| {KIND_NAMES[kind]} | {layers} | " + " | ".join(cells) + " |")
    lines += ["", "| layout | holds | read by (versions read) | draft layers it builds | targets it serves | "
                  "the drafter must have |", "|---|---|---|---|---|---|"]
    pairs = {(fmt, arch) for kind in BUILTIN_KINDS for fmt, arch in get_drafter_spec(kind).export_layouts.items()}
    pairs = sorted(pairs, key=lambda pair: list(READER).index(pair) if pair in READER else len(READER))
    for fmt, arch in pairs:
        kinds = ", ".join(KIND_NAMES[k] for k in BUILTIN_KINDS if get_drafter_spec(k).export_layouts.get(fmt) == arch)
        module = format_module(fmt)
        lines.append(f"| `{fmt}` | {kinds} | {READER.get((fmt, arch), 'UNDOCUMENTED')} | "
                     f"{family_names(module.LAYER_FAMILIES[arch])} | {family_names(module.TARGET_FAMILIES[arch])} | "
                     f"{conditions(fmt, arch)} |")
    return "\n".join(lines)


def block_of(text: str) -> str | None:
    match = re.search(re.escape(START) + r"\n(.*?)\n?" + re.escape(END), text, flags=re.DOTALL)
    return None if match is None else match.group(1)


def test_every_layout_pair_names_its_reader():
    from deepspec.drafters.spec import BUILTIN_KINDS, get_drafter_spec

    pairs = {(fmt, arch) for kind in BUILTIN_KINDS for fmt, arch in get_drafter_spec(kind).export_layouts.items()}
    assert pairs == set(READER), "a layout was added or removed: update READER (who reads it, which version)"
    assert set(BUILTIN_KINDS) == set(KIND_NAMES)


def test_the_documented_matrix_is_the_code_s():
    found = {name: block_of((REPO / name).read_text(encoding="utf-8"))
             for name in DOCUMENTS if (REPO / name).is_file()}
    found = {name: block for name, block in found.items() if block is not None}
    assert "docs/support-matrix.md" in found
    expected = render()
    stale = [name for name, block in found.items() if block != expected]
    assert stale == [], f"{stale}: stale support matrix; run python tests/meta/test_support_matrix.py --write"


def test_the_matrix_follows_a_registry_change(monkeypatch):
    """A kind that loses a layout loses its cells: the table is computed, not copied."""
    import dataclasses

    from deepspec.drafters import spec as spec_module

    before = render()
    original = spec_module.get_drafter_spec

    def without_vllm(kind):
        spec = original(kind)
        layouts = {fmt: arch for fmt, arch in spec.export_layouts.items() if not (kind == "dspark" and fmt == "vllm")}
        return dataclasses.replace(spec, export_layouts=layouts)

    monkeypatch.setattr(spec_module, "get_drafter_spec", without_vllm)
    after = render()
    assert after != before and "| DSpark | the target's | `hf` | `hf` | `hf` | `hf`, `sglang` | `hf` |" in after


def test_the_layer_family_rows_reason_about_draft_layers_and_targets_apart():
    """A row per draft-layer family an engine builds: the engine's layer class decides whether it holds the
    drafter, its target model classes whether it serves the target (SGLang's DFlash: no Qwen2, no Gemma 3; vLLM's
    engines: no Gemma 3)."""
    table = render()
    assert "| DFlash | the target's | `hf` | `hf` | `hf` | `hf`, `sglang`, `vllm` | `hf` |" in table
    assert ("| DFlash | `layer_family=qwen3` | `hf`, `sglang`, `vllm` | `hf`, `sglang`, `vllm` | `hf`, `vllm` | "
            "`hf`, `sglang`, `vllm` | `hf` |") in table
    assert ("| EAGLE-3 | `layer_family=llama` | `hf`, `sglang`, `vllm` | `hf`, `sglang`, `vllm` | "
            "`hf`, `sglang`, `vllm` | `hf`, `sglang`, `vllm` | `hf` |") in table
    assert "| MTP | `layer_family=qwen3` | `hf`, `vllm` | `hf`, `vllm` | `hf`, `vllm` | `hf`, `vllm` | `hf` |" in table
    assert "| standalone LM | the target's |" in table and "| standalone LM | `layer_family" not in table


def write() -> None:
    table = render()
    for name in DOCUMENTS:
        path = REPO / name
        if path.is_file() and block_of(text := path.read_text(encoding="utf-8")) is not None:
            start, end = text.index(START) + len(START), text.index(END)
            path.write_text(text[:start] + "\n" + table + "\n" + text[end:], encoding="utf-8")
            print(f"wrote {name}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1:] == ["--write"]:
        write()
    else:
        print(render())
