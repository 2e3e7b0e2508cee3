"""The target's architecture from configuration alone: no weights, and no network for the named targets.

Order: `target.shape` (the published config.json widths kept in `deepspec.targets.synthetic.RANDOM_SHAPES`;
conf/target/<name>.yaml names it for every packaged target), else a tiny test target's config, else the
config.json of `target.name` (a local folder, the embedded target, or the hub when it can be reached).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from deepspec.targets.config import TargetSchema


def planned_target_config(target: TargetSchema) -> tuple[PretrainedConfig, str]:
    """(text config, where it came from) of `target`, checked against its declared depth."""
    from deepspec.targets.family import text_config
    from deepspec.targets.synthetic import RANDOM_SHAPES, shaped_config
    from deepspec.targets.tiny import TINY_RANDOM_PREFIX, is_tiny_target, tiny_config

    if target.shape is not None:
        if target.shape not in RANDOM_SHAPES:
            raise ValueError(f"target.shape={target.shape!r} is not one of {sorted(RANDOM_SHAPES)}")
        config, source = shaped_config(target.shape), f"target.shape={target.shape} (published widths)"
    elif is_tiny_target(target.name):
        from deepspec.targets.load import load_tokenizer

        config = tiny_config(target.name.removeprefix(TINY_RANDOM_PREFIX), len(load_tokenizer(target.name)))
        source = f"{target.name} (tiny test target)"
    else:
        from deepspec.targets.load import load_target_config

        try:
            config = load_target_config(target.name, target.revision)
        except OSError as e:
            raise ValueError(f"target.name={target.name!r}: its config.json could not be read "
                             f"({str(e).splitlines()[0]}); name a local folder, or set target.shape to its published "
                             f"architecture (one of {sorted(RANDOM_SHAPES)})") from None
        source = f"{target.name} config.json"
    config = text_config(config)
    declared = target.num_hidden_layers
    if declared is not None and declared != int(config.num_hidden_layers):
        raise ValueError(f"target.num_hidden_layers={declared} but {source} has {config.num_hidden_layers} layers")
    return config, source
