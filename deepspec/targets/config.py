"""The typed `target:` section shared by every job that loads a target (training, the cache job), and the same
section for the argparse entry points (regenerate, evaluate) through `target_settings(name)`.

conf/target/<name>.yaml files are deltas over this dataclass (Hydra ConfigStore entry `target/base_target`).
Per-target protocol settings live there, not in code: the target's recommended sampling for regeneration
(`sampling`), its chat-template options (`chat_template_kwargs`, e.g. Qwen3 non-thinking mode) and, for a target
whose tokenizer has none, a chat template (`chat_template`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class SamplingSchema:
    """The target's recommended sampling (regeneration). A null field falls back to the target's own
    generation_config.json, then to the DSpark reference's choice (T = 0.7, no top-p/top-k)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None


@dataclass
class TargetSchema:
    name: str = "smollm2-135m"  # embedded name, local dir, .gguf file or hub id
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | ...
    device: Optional[str] = None  # null: cuda if available, else cpu
    revision: Optional[str] = None
    num_hidden_layers: Optional[int] = None  # declared depth (checked against config.json when available)
    layer_ids: Optional[List[int]] = None  # cached feature layers ("output of decoder layer l"); null: 5-point spread
    sampling: SamplingSchema = field(default_factory=SamplingSchema)
    # Passed to tokenizer.apply_chat_template everywhere (regenerate, cache, evaluate), recorded in cache meta.
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # A chat template for a tokenizer without one (a base model) or to replace its own: the template text, or the
    # path of a file holding it (deepspec.data.rendering). null: the tokenizer's own.
    chat_template: Optional[str] = None


def target_settings(name: str) -> TargetSchema:
    """The typed target section for `name`: the packaged conf/target/<name>.yaml, matched by file name or by
    its `name:` field (so `qwen3-4b` and `Qwen/Qwen3-4B` give the same settings); else the defaults with that
    name (a local folder or another hub id: no recommended sampling, no template options)."""
    from importlib.resources import files

    from omegaconf import OmegaConf

    for path in sorted(files("deepspec.conf").joinpath("target").iterdir(), key=lambda p: p.name):
        if not path.name.endswith(".yaml"):
            continue
        data = OmegaConf.create(path.read_text())
        data.pop("defaults", None)
        if path.name.removesuffix(".yaml") == name or data.get("name") == name:
            try:
                return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TargetSchema), data))
            except Exception as e:  # omegaconf's validation errors name the key
                raise ValueError(f"deepspec/conf/target/{path.name}: {str(e).splitlines()[0]}") from None
    return TargetSchema(name=name)


CHAT_TEMPLATE_KWARGS_HELP = ("JSON object passed to the chat template, replacing the target config's "
                             "target.chat_template_kwargs (e.g. '{\"enable_thinking\": false}')")


def chat_template_kwargs_option(text: str | None, settings: TargetSchema) -> dict:
    """A `--chat-template-kwargs` command-line value (a JSON object), else the target config's options."""
    if text is None:
        return dict(settings.chat_template_kwargs)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs {text!r}: not JSON ({e.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs {text!r}: must be a JSON object")
    return value
