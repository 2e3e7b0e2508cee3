"""Build a drafter for a target, or load a saved one and attach its target.

`build_drafter(kind, target, **overrides)` fills what comes from the target: its text config
(`target_config`), default feature layer ids (`deepspec.targets.layers`), name/revision/fingerprint,
and, through the config's optional `complete_from_target(target)`, target-dependent defaults such as
the DSpark/DFlash mask token. With `init_from_target=True` the model's optional
`init_from_target_model(target_model)` copies target weights. The target's embedding/LM head are
attached frozen, never copied.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepspec.drafters.base import (
    DrafterModel,
    drafter_classes,
    registered_kinds,
    target_config_dict,
)
from deepspec.targets.layers import (
    LAYER_ID_CONVENTION,
    default_feature_layers,
    validate_layer_ids,
)


def build_drafter(kind: str, target, **overrides) -> DrafterModel:
    """A freshly initialised drafter of `kind` for `target` (a `LoadedTarget`)."""
    config_cls, model_cls = drafter_classes(kind)
    num_layers = target.num_layers
    settings = {
        "target_config": target_config_dict(target.model.config),
        "target_name": target.name,
        "target_revision": target.revision,
        "target_fingerprint": target.fingerprint(),
        "target_layer_ids": default_feature_layers(num_layers, kind),
        "layer_id_convention": LAYER_ID_CONVENTION,
    }
    settings.update(overrides)
    settings["target_layer_ids"] = validate_layer_ids(settings["target_layer_ids"], num_layers, "drafter.target_layer_ids")
    config = config_cls(**settings)
    complete = getattr(config, "complete_from_target", None)
    if complete is not None:
        complete(target)
    model = model_cls(config)
    if config.init_from_target:
        init = getattr(model, "init_from_target_model", None)
        if init is None:
            raise ValueError(f"drafter kind {kind!r} does not support init_from_target")
        init(target.model)
    model.to(device=target.model.device, dtype=target.model.dtype)
    return model.attach_target(target.model)


def _kind_of_model_type(model_type: str) -> str:
    for kind in registered_kinds():
        if drafter_classes(kind)[0].model_type == model_type:
            return kind
    raise ValueError(f"config.json model_type {model_type!r} is not a registered drafter; known kinds: {registered_kinds()}")


def load_drafter(path: str | Path, target, strict_target: bool = True) -> DrafterModel:
    """Load a saved drafter and attach `target`; the target must match the one it was trained for."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a saved drafter directory")
    model_type = json.loads(config_file.read_text()).get("model_type")
    _, model_cls = drafter_classes(_kind_of_model_type(model_type))
    model = model_cls.from_pretrained(path, dtype=target.model.dtype)
    if strict_target:
        saved = model.config.target_fingerprint
        current = target.fingerprint()
        for key in ("config_hash", "tokenizer_hash"):
            if saved.get(key) and saved.get(key) != current.get(key):
                raise ValueError(f"{config_file}: target_fingerprint.{key}={saved.get(key)!r} does not match the "
                                 f"given target ({current.get(key)!r}): the drafter was trained for another target. "
                                 "To use it anyway pass --allow-target-mismatch (eval/evaluate.py, eval/bench_speed.py), "
                                 "or strict_target=False in Python")
    return model.attach_target(target.model)
