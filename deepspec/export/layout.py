"""Shared pieces of every export layout: prefix-based state-dict adapters, tensor files, the DeepSpec sidecar.

An adapter maps the drafter's own parameter names onto an engine's names by prefix, so a rename on
either side is one line in the adapter's table. `to_format` and `from_format` are exact inverses and
refuse keys they cannot place (a silently dropped tensor is a drafter that serves garbage).

Engine configs carry only the engine's fields. What DeepSpec needs beyond them to rebuild the drafter
(target config, fingerprint, training-only fields) goes into the sidecar `deepspec_export.json`, minus
the fields the engine config already holds, so each value has one source of truth and re-reading a
layout converts the engine's fields back explicitly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from deepspec.drafters.spec import get_drafter_spec, spec_of
from deepspec.targets.family import family_model_type
from deepspec.utils.io import atomic_path, atomic_write_json, read_json

SIDECAR_FILE = "deepspec_export.json"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class PrefixMap:
    """Rename state-dict keys by prefix: `pairs` are (drafter prefix, engine prefix); longest match wins.

    `drop` lists drafter keys that are derived state and never exported (restored by the loader).
    """

    pairs: tuple[tuple[str, str], ...]
    drop: frozenset[str] = field(default_factory=frozenset)

    @staticmethod
    def _rename(key: str, table: list[tuple[str, str]]) -> str | None:
        for src, dst in table:
            if key.startswith(src):
                return dst + key[len(src):]
        return None

    def _apply(self, state: dict[str, torch.Tensor], table: list[tuple[str, str]],
               side: str) -> dict[str, torch.Tensor]:
        table = sorted(table, key=lambda pair: len(pair[0]), reverse=True)
        out, unmapped = {}, []
        for key, tensor in state.items():
            new = self._rename(key, table)
            if new is None:
                unmapped.append(key)
            else:
                out[new] = tensor
        if unmapped:
            raise ValueError(f"{side}: no mapping for tensor(s) {sorted(unmapped)}; "
                             f"known prefixes: {[s for s, _ in table]}")
        return out

    def to_format(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        kept = {k: v for k, v in state.items() if k not in self.drop}
        return self._apply(kept, list(self.pairs), "export")

    def from_format(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._apply(state, [(dst, src) for src, dst in self.pairs], "load")


def drafter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's own persistent tensors (the frozen target parts are never in its module tree)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


def export_architecture(model, layout: str, description: str) -> str:
    """The engine architecture `layout` writes for this drafter: its kind's spec says (`export_layouts`)."""
    spec = spec_of(model)
    architecture = spec.export_layouts.get(layout)
    if architecture is None:
        raise ValueError(f"{description}; this drafter is {spec.kind!r} (it exports to {sorted(spec.export_layouts)})")
    return architecture


def export_layout(model, out_dir: Path, target, opts: dict, layout: str, description: str, architectures: dict) -> Path:
    """The engine-format export every format module shares: pick the writer of the drafter's architecture
    (`architectures`: name -> (writer(model, out_dir, target) -> engine config, engine-config field names)),
    write config.json and the DeepSpec sidecar."""
    if opts:
        raise ValueError(f"{layout} export: unknown option(s) {sorted(opts)}")
    make, engine_fields = architectures[export_architecture(model, layout, description)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = make(model, out_dir, target)
    write_config(out_dir / CONFIG_FILE, engine)
    write_sidecar(out_dir, layout, model, engine_fields)
    return out_dir


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors file; tensors are cloned so tied/shared storages serialise independently."""
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().clone().cpu() for k, v in tensors.items()}, str(tmp),
                  metadata={"format": "pt"})


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: weights file not found")
    try:
        return load_file(str(path))
    except SafetensorError as error:  # an export older than exports' checksums.json
        cause = str(error).splitlines()[0]
        raise ValueError(f"{path}: unreadable weights ({cause}): damaged or truncated; copy or "
                         "export the drafter again") from None


def write_config(path: Path, config: dict) -> None:
    atomic_write_json(path, config)


def read_config(folder: Path) -> dict:
    return read_json(Path(folder) / CONFIG_FILE)


def write_sidecar(folder: Path, layout: str, model, engine_fields: tuple[str, ...], extra: dict | None = None) -> None:
    """Record what the engine config does not carry: drafter kind and the remaining drafter-config fields."""
    config = model.config.to_dict()
    for key in engine_fields:
        config.pop(key, None)
    for key in ("architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"):
        config.pop(key, None)
    atomic_write_json(Path(folder) / SIDECAR_FILE, {
        "layout": layout,
        "drafter_kind": type(model.config).drafter_kind,
        "drafter_config": config,
        **(extra or {}),
    })


def read_sidecar(folder: Path, layout: str) -> dict:
    path = Path(folder) / SIDECAR_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: DeepSpec needs it to rebuild a drafter from the {layout} layout "
                                f"(the target config and fields the engine config does not carry)")
    sidecar = read_json(path)
    if sidecar.get("layout") != layout:
        raise ValueError(f"{path}: layout={sidecar.get('layout')!r} but the folder was read as {layout!r}")
    for key in ("drafter_kind", "drafter_config"):
        if key not in sidecar:
            raise ValueError(f"{path}: missing field {key!r}")
    return sidecar


def read_layout(path: Path, layout: str) -> tuple[dict, dict, dict[str, torch.Tensor], str]:
    """(engine config, DeepSpec sidecar, tensors, config path for messages) of an exported folder."""
    path = Path(path)
    return read_config(path), read_sidecar(path, layout), read_tensors(path / WEIGHTS_FILE), str(path / CONFIG_FILE)


def require(config: dict, key: str, where: str) -> Any:
    if key not in config or config[key] is None:
        raise ValueError(f"{where}: required field {key!r} is missing")
    return config[key]


def engine_text_config(drafter_config, num_layers: int, **overrides) -> dict:
    """The draft layers' config (the target's text config, or its conversion into `drafter.layer_family`) resized
    to the draft depth, as engines build draft layers from it: its `model_type` is the draft layers' family."""
    cfg = json.loads(json.dumps(drafter_config.draft_config_dict))  # deep copy of plain JSON
    cfg["num_hidden_layers"] = int(num_layers)
    if "layer_types" in cfg:
        cfg["layer_types"] = ["full_attention"] * int(num_layers)  # draft layers attend over full context
    cfg.update(overrides)
    return cfg


def check_engine_families(config, engine: str, layer_families: tuple[str, ...], target_families: set[str],
                          target_reason: str) -> None:
    """Refuse a drafter whose draft layers are not of a family the engine class builds (`layer_families`, the first
    preferred), or whose target the engine does not serve with it (`target_families`, `target_reason` says why),
    naming the fix."""
    draft, target = config.draft_layer_family, family_model_type(config.target_config["model_type"])
    if draft not in layer_families:
        whose = "the target's family" if config.layer_family is None else "drafter.layer_family"
        raise ValueError(f"{engine} builds {' or '.join(layer_families)} draft layers; this drafter's are {draft} "
                         f"({whose}): train it with drafter.layer_family={layer_families[0]} to serve it there, or "
                         "export format='hf'")
    if target not in target_families:
        raise ValueError(f"{engine} does not serve {target} targets ({target_reason}); it serves "
                         f"{', '.join(sorted(target_families))}: export format='hf' for DeepSpec's own decoding loop")


def layer_family_from_engine(engine_model_type: str, sidecar_config: dict) -> str | None:
    """The drafter's `layer_family` from the model_type of the draft-layer config an engine layout holds (null: the
    target's own family), so the engine config is its one source of truth."""
    target = family_model_type(sidecar_config["target_config"]["model_type"])
    family = family_model_type(engine_model_type)
    return None if family == target else family


def check_target(sidecar_config: dict, target, where: str) -> None:
    """Refuse to attach a target other than the one the drafter was trained against (config/tokenizer hash)."""
    saved = sidecar_config.get("target_fingerprint") or {}
    current = target.fingerprint()
    for key in ("config_hash", "tokenizer_hash"):
        if saved.get(key) and saved.get(key) != current.get(key):
            raise ValueError(f"{where}: target_fingerprint.{key}={saved.get(key)!r} does not match the given target "
                             f"({current.get(key)!r})")


def rebuild_drafter(kind: str, config_dict: dict, state: dict[str, torch.Tensor], target, where: str):
    """Construct the drafter from a config dict, load its tensors (all of them, strictly), attach the target."""
    check_target(config_dict, target, where)
    spec = get_drafter_spec(kind)
    model = spec.model_class(spec.config_class.from_dict(config_dict))
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        raise ValueError(f"{where}: tensors do not match the {kind} drafter this config describes: {error}") from None
    model.to(dtype=target.model.dtype).eval()
    return model.attach_target(target.model)


def shared_target_tensor(target, which: str, where: str) -> torch.Tensor:
    """The target's embedding or LM-head matrix, for layouts that store a copy next to the draft weights."""
    if target is None:
        raise ValueError(f"{where} stores the target's {which} next to the draft weights: pass target=... "
                         f"(--target on the command line) to export it")
    if which == "embedding":
        return target.model.get_input_embeddings().weight.detach()
    return target.model.get_output_embeddings().weight.detach()


def pop_shared_copy(state: dict[str, torch.Tensor], key: str, target, which: str, where: str) -> None:
    """Remove a stored copy of a target matrix, checking it is the given target's (else: wrong target)."""
    if key not in state:
        return
    stored = state.pop(key)
    expected = shared_target_tensor(target, which, where)
    if stored.shape != expected.shape or not torch.equal(stored.to(expected.dtype), expected.cpu()):
        raise ValueError(f"{where}: {key} differs from the given target's {which}: "
                         "this export was made for another target")


def check_fused_layer_count(layer_ids: list[int], expected: int, engine: str) -> None:
    """An engine whose `fc` reads a fixed number of target layers refuses any other count, naming the fix."""
    if len(layer_ids) != expected:
        raise ValueError(f"{engine} fuses exactly {expected} target layers (fc: {expected}H -> H); this drafter "
                         f"has target_layer_ids={list(layer_ids)}. Train it with drafter.feature_layers=low_mid_high "
                         f"(or {expected} explicit drafter.target_layer_ids) to serve it there; the hf layout holds "
                         f"any count")


def check_layer_keys(state: dict[str, torch.Tensor], prefix: str, allowed: set[str], engine: str) -> None:
    """Fail when a draft layer holds tensors the engine's layer class has no place for (or lacks one it needs)."""
    names = {k[len(prefix):] for k in state if k.startswith(prefix)}
    required = {n for n in allowed if not n.endswith(".bias")}
    extra, missing = sorted(names - allowed), sorted(required - names)
    if extra or missing:
        raise ValueError(f"{engine} cannot represent this drafter's layer {prefix!r}: tensors the engine layer lacks "
                         f"{extra}, tensors it requires but the drafter lacks {missing}")
