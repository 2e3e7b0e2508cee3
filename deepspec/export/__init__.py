"""Export trained drafters to serving layouts and read them back.

`export_drafter(checkpoint_dir_or_model, out_dir, format, target=None, **opts)` writes one layout:
- "hf": DeepSpec's own `save_pretrained` folder + tokenizer + model card (`hf.py`, `push_to_hub`);
- "sglang": Eagle3 `LlamaForCausalLMEagle3`, DFlash `DFlashDraftModel`, DSpark (`sglang.py`);
- "vllm": vLLM "speculators" Eagle3 / DFlash (`vllm_speculators.py`);
- "nextn": MTP modules in DeepSeek's NextN keys (`mtp_nextn.py`);
- "causal_lm": a standalone drafter as a plain transformers causal LM (`causal_lm.py`; vLLM draft_model,
  SGLang STANDALONE).
`load_exported(path, target)` recognises the layout from its `config.json` and rebuilds the drafter with
DeepSpec's classes — the round trip every test runs (identical logits). Which engine files each layout
follows, and what only a GPU server can confirm, is in `deepspec/export/README.md`.

Every layout also holds `checksums.json` (deepspec.utils.checksums: the sha256 and size of each
other file), written last; engines ignore it. Every DeepSpec reader of an export (`load_exported`,
`load_drafter`, an export given as `--checkpoint`) checks it first and names a damaged file in one
line; `verify_export` (`deepspec export --verify DIR`) checks a folder after it was copied.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from deepspec.drafters.block.config import engine_unread_extensions
from deepspec.export.layout import CONFIG_FILE, read_config
from deepspec.export.model_card import (
    ModelCardInputs,
    load_tau_table,
    load_training_record,
)
from deepspec.utils.checksums import (
    MANIFEST_FILE,
    check_drafter_checksums,
    folder_manifest,
    manifest_problems,
)
from deepspec.utils.io import (
    atomic_dir,
    atomic_write_json,
    read_json,
    remove_abandoned_temps,
    reporting_disk_full,
)
from deepspec.utils.locks import exclusive_lock, remove_free_lock

log = logging.getLogger(__name__)

# format name -> module (each has LAYOUT, matches(config), export(model, out_dir, target, **opts), load(path, target))
FORMAT_MODULES = {
    "hf": "deepspec.export.hf",
    "sglang": "deepspec.export.sglang",
    "vllm": "deepspec.export.vllm_speculators",
    "nextn": "deepspec.export.mtp_nextn",
    "causal_lm": "deepspec.export.causal_lm",
}
# Detection order: the most specific engine markers first; DeepSpec's own folder last.
_DETECTION_ORDER = ("vllm", "sglang", "nextn", "causal_lm", "hf")


def format_module(name: str):
    if name not in FORMAT_MODULES:
        raise ValueError(f"unknown export format {name!r}; choose one of {sorted(FORMAT_MODULES)}")
    return importlib.import_module(FORMAT_MODULES[name])


def find_drafter_folder(checkpoint_dir: str | Path) -> Path:
    """The folder holding the drafter's config.json: the checkpoint itself or its one drafter subfolder."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {checkpoint_dir} does not exist")

    def is_drafter(folder: Path) -> bool:
        return ((folder / CONFIG_FILE).is_file()
                and str(_checked_config(folder).get("model_type", "")).startswith("deepspec_"))

    if is_drafter(checkpoint_dir):
        return checkpoint_dir
    found = sorted(p for p in checkpoint_dir.iterdir() if p.is_dir() and is_drafter(p))
    if len(found) != 1:
        raise FileNotFoundError(f"{checkpoint_dir}: expected a DeepSpec drafter config.json (model_type deepspec_*) "
                                f"in the folder or in exactly one subfolder, found {[p.name for p in found]}")
    return found[0]


def _checked_config(folder: Path) -> dict:
    """The folder's config.json; one that does not parse is named as damaged by the checksums.json
    that records it (an export's, a checkpoint's), else as invalid JSON."""
    try:
        return read_config(folder)
    except ValueError:
        check_drafter_checksums(folder)
        raise


def load_checkpoint(checkpoint_dir: str | Path, target=None):
    """A saved drafter; with `target` it is attached (and its fingerprint checked), else weights
    only. A folder covered by a checksums.json (a training checkpoint's, an export's) is verified
    first (`check_drafter_checksums`)."""
    from deepspec.drafters.build import load_drafter, read_saved_drafter

    folder = find_drafter_folder(checkpoint_dir)
    if target is not None:
        return load_drafter(folder, target)  # verifies the checksums first
    return read_saved_drafter(folder)


def export_drafter(checkpoint_dir_or_model, out_dir: str | Path, format: str = "hf", target=None,
                   tau_table: str | Path | None = None, commands: list[str] | None = None, overwrite: bool = False,
                   **opts) -> Path:
    """Write `format`'s layout of a drafter (a `DrafterModel` or a saved checkpoint folder) into `out_dir`.

    `target` (a `LoadedTarget`) is needed by layouts that store target-derived data (vLLM's embedding,
    NextN's shared head, the tokenizer files of the HF folder). `tau_table` (an evaluation results JSON)
    and `commands` feed the HF model card; `opts` go to the format (e.g. nextn `include_shared`).
    A non-empty `out_dir` is refused unless `overwrite`; the layout is written into a temp folder beside
    it that replaces `out_dir` whole once complete (no stale or foreign files, no half-written export). A second
    export into the same `out_dir` while one runs is refused (`LockHeldError`), as is a folder another writer
    filled meanwhile; a symbolic link `out_dir` is written through (the folder it points to gets the export).
    The temp folder a killed export left beside `out_dir` goes at the next export into it (its lock
    file too). The folder's checksums.json is written last (module docstring).
    """
    module = format_module(format)
    out_dir = Path(out_dir)
    checkpoint_dir = Path(checkpoint_dir_or_model) if isinstance(checkpoint_dir_or_model, (str, Path)) else None
    if (checkpoint_dir is not None
            and out_dir.resolve() in (checkpoint_dir.resolve(), *checkpoint_dir.resolve().parents)):
        raise ValueError(f"--out {out_dir} holds the checkpoint {checkpoint_dir} being exported; choose another folder")
    if format != "hf" and tau_table is not None:
        raise ValueError(f"tau_table is written into the model card of the 'hf' layout only (format={format!r})")
    # One export at a time into a folder (a second one is refused at once, naming the first); the lock sits beside
    # the folder written, which for a symbolic link --out is the one it points to.
    lock = out_dir.resolve().with_name(f".{out_dir.resolve().name}.lock")
    try:
        with exclusive_lock(lock, f"the export into {out_dir}"):
            # A killed export's temp folder: no live export owns it while this one holds the lock.
            for leftover in remove_abandoned_temps(out_dir):
                log.info("removed %s, left by an export into %s that was killed", leftover, out_dir)
            with atomic_dir(out_dir, overwrite, hint="pass --overwrite (overwrite=True) to replace it whole") as tmp:
                model = (load_checkpoint(checkpoint_dir, target) if checkpoint_dir is not None
                         else checkpoint_dir_or_model)
                _write_layout(module, model, tmp, format, target, checkpoint_dir, tau_table, commands, opts)
    finally:
        remove_free_lock(lock)
    return out_dir


def _write_layout(module, model, folder: Path, format: str, target, checkpoint_dir: Path | None, tau_table,
                  commands: list[str] | None, opts: dict) -> None:
    extensions = engine_unread_extensions(model.config)
    if extensions and format in ENGINE_LAYOUTS:
        named = ", ".join(f"drafter.{k}={v!r}" for k, v in extensions.items())
        fix = " ".join(f"drafter.{k}=none" for k in extensions)
        raise ValueError(f"format={format!r}: no serving engine reads {named} (deepspec/drafters/block/config.py); "
                         f"export the 'hf' layout, or train with {fix} (the paper's architecture) to serve it "
                         "there")
    if format == "hf":
        record = load_training_record(checkpoint_dir) if checkpoint_dir is not None else {}
        opts["card"] = ModelCardInputs(tau_table=load_tau_table(tau_table) if tau_table else None,
                                       commands=list(commands or []), **record)
    needed = export_bytes(model, format, target, opts)
    with reporting_disk_full(needed_bytes=needed):  # atomic_dir names out_dir and what it left
        module.export(model, folder, target=target, **opts)
        # Last, over every file written: what each DeepSpec reader checks first (engines ignore it).
        atomic_write_json(folder / MANIFEST_FILE, folder_manifest(folder, exclude=(MANIFEST_FILE,)))


# Copies of the target's (embedding, LM head) a layout stores beside the drafter's tensors, at most
# (the export's size): vLLM's speculators both, SGLang's Eagle3 a full-vocabulary head, causal_lm
# both (a drafter sharing them), NextN both in every module (include_shared).
_TARGET_COPIES = {"vllm": (1, 1), "sglang": (0, 1), "causal_lm": (1, 1), "nextn": (1, 1)}
_TOKENIZER_LAYOUTS = ("hf", "causal_lm")  # they hold the target's tokenizer files


def export_bytes(model, format: str, target=None, opts: dict | None = None) -> int:
    """About the bytes the export of `model` in `format` takes (a full disk's message): the
    drafter's tensors, the copies of the target's matrices the layout stores and the target's
    tokenizer (its tokenizer.json)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if target is None:
        return total
    embeddings, heads = _TARGET_COPIES.get(format, (0, 0))
    if format == "nextn":
        shared = (opts or {}).get("include_shared", True)
        copies = getattr(model.config, "num_mtp_modules", 1) if shared else 0
        embeddings, heads = copies, copies
    for count, matrix in ((embeddings, target.model.get_input_embeddings()),
                          (heads, target.model.get_output_embeddings())):
        if count and matrix is not None:
            total += count * matrix.weight.numel() * matrix.weight.element_size()
    backend = getattr(target.tokenizer, "backend_tokenizer", None)
    if format in _TOKENIZER_LAYOUTS and backend is not None:
        total += len(backend.to_str(pretty=True).encode("utf-8"))  # as save_pretrained writes it
    return total


ENGINE_LAYOUTS = ("sglang", "vllm")  # read by serving engines' own classes (no anchor fusion, no output adapter)


def formats_for(kind: str, target_model_type: str, num_feature_layers: int | None = None,
                reduced_vocab: bool = False, engine_unread: bool = False, num_positions: int | None = None,
                layer_family: str | None = None) -> list[str]:
    """The export formats that can hold a drafter of `kind` for a target of `target_model_type` whose draft layers
    are of `layer_family` (null: the target's family): the kind's spec lists its layouts, each format module the
    draft-layer families its engine class builds (`LAYER_FAMILIES`) and, separately, the target families it serves
    with them (`TARGET_FAMILIES`); a layer family the target's config cannot convert into has no format. Where an
    engine fuses a fixed number of target layers (`FUSED_LAYER_COUNTS`), with `num_feature_layers` (the trained
    drafter's) a layout whose engine reads another count is left out; with `num_positions` (its capabilities' draft
    positions) so is one whose engine holds another fixed number (`FIXED_POSITIONS`); with `reduced_vocab` so is one
    whose engine class reads only the full vocabulary (`FULL_VOCABULARY_ONLY`); with `engine_unread` (the drafter
    has an extension no engine reads: `engine_unread_extensions`) every engine layout (`ENGINE_LAYOUTS`)."""
    from deepspec.drafters.spec import get_drafter_spec
    from deepspec.targets.family import conversion_refusal, family_model_type

    target = family_model_type(target_model_type)
    if layer_family is not None and conversion_refusal(target, layer_family) is not None:
        return []
    draft = family_model_type(layer_family or target)
    formats = []
    for name, architecture in get_drafter_spec(kind).export_layouts.items():
        module = format_module(name)
        fused = getattr(module, "FUSED_LAYER_COUNTS", {}).get(architecture)
        if num_feature_layers is not None and fused is not None and fused != num_feature_layers:
            continue
        positions = getattr(module, "FIXED_POSITIONS", {}).get(architecture)
        if num_positions is not None and positions is not None and positions != num_positions:
            continue
        if reduced_vocab and architecture in getattr(module, "FULL_VOCABULARY_ONLY", ()):
            continue
        if engine_unread and name in ENGINE_LAYOUTS:
            continue
        layers, targets = module.LAYER_FAMILIES[architecture], module.TARGET_FAMILIES[architecture]
        if (layers is None or draft in layers) and (targets is None or target in targets):
            formats.append(name)
    return formats


def detect_layout(path: str | Path) -> str:
    config = _checked_config(Path(path))
    for name in _DETECTION_ORDER:
        if format_module(name).matches(config):
            return name
    raise ValueError(f"{Path(path) / CONFIG_FILE}: not a layout DeepSpec exports ({', '.join(_DETECTION_ORDER)})")


def load_exported(path: str | Path, target):
    """Rebuild a drafter from any exported layout and attach `target` (checked against its
    fingerprint); the files are checked against the export's checksums.json first."""
    layout = detect_layout(path)
    if layout != "hf":  # the hf layout is read by load_drafter, which checks them itself
        check_drafter_checksums(path)
    return format_module(layout).load(Path(path), target)


def verify_export(folder: str | Path) -> str:
    """Check an exported folder against its checksums.json: one line saying what matched, or a
    ValueError naming each damaged or missing file (`deepspec export --verify`)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder")
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ValueError(f"{folder}: no {MANIFEST_FILE} (not an export, or one written before "
                         "exports recorded checksums): nothing to verify it against; export it "
                         "again to get one")
    manifest = read_json(manifest_path)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{manifest_path}: not a checksum manifest (no 'files' mapping)")
    problems = manifest_problems(folder, manifest)
    if problems:
        raise ValueError(f"{folder}: the export is damaged: {'; '.join(problems)} (recorded in "
                         f"{manifest_path}); copy it again from where it came from, or export it "
                         "again from its checkpoint")
    names = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    unrecorded = sorted(n for n in names if n != MANIFEST_FILE and n not in manifest["files"])
    note = (f"; not recorded (added since, not checked): {', '.join(unrecorded)}" if unrecorded
            else "")
    return f"{folder}: {len(manifest['files'])} files match {MANIFEST_FILE}{note}"


def push_to_hub(folder: str | Path, repo_id: str, api=None, **kwargs) -> str:
    from deepspec.export.hf import push_to_hub as push

    return push(folder, repo_id, api=api, **kwargs)


__all__ = ["FORMAT_MODULES", "detect_layout", "export_drafter", "formats_for", "load_checkpoint", "load_exported",
           "push_to_hub", "verify_export"]
