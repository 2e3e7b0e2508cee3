"""Build a drafter for a target, or load a saved one and attach its target.

`build_drafter(kind, target, **overrides)` fills what comes from the target: its text config
(`target_config`), the kind's default feature layer ids (its spec), name/revision/fingerprint,
and, through the config's `complete_from_target(target)`, target-dependent defaults such as the
DSpark/DFlash mask token. Then the model's `initialize_from(target)`: with `init_from_target=True`
`init_from_target_model(target_model)` copies target weights (kinds that cannot refuse with a ValueError); a
kind wrapping a pretrained model loads it there. The target's embedding/LM head are attached frozen, never
copied.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError

from deepspec.drafters.base import DrafterModel, FrozenTargetParts, target_config_dict
from deepspec.drafters.spec import get_drafter_spec, spec_of_model_type
from deepspec.targets.layers import LAYER_ID_CONVENTION, validate_layer_ids
from deepspec.utils.checksums import check_drafter_checksums
from deepspec.utils.io import read_json


def build_drafter(kind: str, target, **overrides) -> DrafterModel:
    """A freshly initialised drafter of `kind` for `target` (a `LoadedTarget`)."""
    spec = get_drafter_spec(kind)
    num_layers = target.num_layers
    settings = {
        "target_config": target_config_dict(target.model.config),
        "target_name": target.name,
        "target_revision": target.revision,
        "target_fingerprint": target.fingerprint(),
        "target_layer_ids": spec.default_feature_layers(num_layers),
        "layer_id_convention": LAYER_ID_CONVENTION,
    }
    settings.update(overrides)
    settings["target_layer_ids"] = validate_layer_ids(settings["target_layer_ids"], num_layers,
                                                      "drafter.target_layer_ids")
    config = spec.config_class(**settings)
    config.complete_from_target(target)
    model = spec.model_class(config)
    model.initialize_from(target)
    model.to(device=target.model.device, dtype=target.model.dtype)
    return model.attach_target(FrozenTargetParts.from_target(target.model, getattr(target, "frozen_copies", None)))


def read_saved_drafter(path: str | Path, **kwargs) -> DrafterModel:
    """The drafter saved in `path` (config.json + model.safetensors), no target attached; where a
    checksums.json records the folder's files (a training checkpoint, an export), they are verified
    before any is read, and a damaged file is one line naming it either way. `kwargs` go to
    `from_pretrained` (e.g. dtype)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a saved drafter directory")
    check_drafter_checksums(path)
    config = read_json(config_file)
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a drafter config (a JSON object)")
    try:
        spec = spec_of_model_type(config.get("model_type"))
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from None
    try:
        return spec.model_class.from_pretrained(path, **kwargs)
    except SafetensorError as error:  # weights no checksums.json vouches for, damaged
        cause = str(error).splitlines()[0]
        raise ValueError(f"{path / 'model.safetensors'}: unreadable weights ({cause}): damaged or "
                         "truncated; copy or export the drafter again") from None


def load_drafter(path: str | Path, target, strict_target: bool = True) -> DrafterModel:
    """Load a saved drafter (`read_saved_drafter`) and attach `target`; the target must match the
    one it was trained for."""
    path = Path(path)
    model = read_saved_drafter(path, dtype=target.model.dtype)
    if strict_target:
        saved = model.config.target_fingerprint
        current = target.fingerprint()
        for key in ("config_hash", "tokenizer_hash"):
            if saved.get(key) and saved.get(key) != current.get(key):
                raise ValueError(f"{path / 'config.json'}: target_fingerprint.{key}={saved.get(key)!r} does not "
                                 f"match the given target ({current.get(key)!r}): the drafter was trained for another "
                                 "target. To use it anyway pass --allow-target-mismatch (deepspec evaluate, "
                                 "deepspec bench speed), or strict_target=False in Python")
    return model.attach_target(target.model)
