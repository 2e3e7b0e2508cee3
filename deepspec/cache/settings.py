"""The settings record of a cache build: everything that determines its bytes. A resume, a merge and a hybrid training
run compare records field by field and refuse a folder built with other settings, naming every field that differs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deepspec.cache import format as fmt
from deepspec.cache.plan import iter_positions
from deepspec.data.rendering import Rendering
from deepspec.targets.load import LoadedTarget
from deepspec.utils.io import sha256_json


def build_settings(target: LoadedTarget, layer_ids: list[int], *, storage_dtype: str, max_length: int | None,
                   world_size: int, source: dict, data_hash: str, rendering: Rendering | None = None,
                   content: str = fmt.CONTENT_HIDDEN, top_k: int | None = None) -> dict:
    """Everything that determines the cache bytes; a resume refuses a folder built with other settings."""
    rendering = rendering or Rendering()
    recorded = rendering.record()
    fingerprint = target.fingerprint()
    settings = {
        "target": fingerprint["target"], "revision": fingerprint["revision"],
        "config_hash": fingerprint["config_hash"], "tokenizer_hash": fingerprint["tokenizer_hash"],
        "layer_ids": list(layer_ids), "hidden_size": int(target.config.hidden_size),
        "num_target_layers": int(target.num_layers), "storage_dtype": storage_dtype, "max_length": max_length,
        "world_size": world_size, "system_prompt": rendering.system_prompt, "source": source, "data_hash": data_hash,
        "chat_template_kwargs": recorded["chat_template_kwargs"],
        "format_version": fmt.FORMAT_VERSION,  # a resume never mixes shards of two versions
    }
    if recorded["data_format"] != "chat" or recorded["chat_template"] is not None:  # only then, as content below
        settings.update(data_format=recorded["data_format"], chat_template=recorded["chat_template"])
    if content != fmt.CONTENT_HIDDEN:  # only then: partial indices of hidden-state builds resume as before
        settings.update(content=content, top_k=int(top_k))
    return settings


def finished_settings(meta: fmt.CacheMeta) -> dict:
    """The `build_settings` record a finished cache was built with, as its meta.json says (`merge_cache` writes
    meta.json from it)."""
    source = dict(meta.source)
    data_hash = source.pop("data_hash", None)
    settings = {"target": meta.target, "revision": meta.revision, "config_hash": meta.config_hash,
                "tokenizer_hash": meta.tokenizer_hash, "layer_ids": list(meta.layer_ids),
                "hidden_size": meta.hidden_size, "num_target_layers": meta.num_target_layers,
                "storage_dtype": meta.storage_dtype,
                "max_length": meta.max_length, "world_size": meta.world_size, "system_prompt": meta.system_prompt,
                "source": source, "data_hash": data_hash, "chat_template_kwargs": dict(meta.chat_template_kwargs),
                "format_version": meta.format_version}
    if meta.data_format != "chat" or meta.chat_template is not None:
        settings.update(data_format=meta.data_format, chat_template=meta.chat_template)
    if meta.content != fmt.CONTENT_HIDDEN:
        settings.update(content=meta.content, top_k=meta.top_k)
    return settings


def conversations_hash(conversations_by_split: Mapping[str, Sequence]) -> str:
    # A text record's text is hashed too (its messages are only its chat reading); conversations hash as before.
    return sha256_json([[split, conv.id, conv.messages] + ([[conv.text.prompt, conv.text.completion]] if conv.text
                                                           else [])
                        for _, split, conv in iter_positions(conversations_by_split)])


def settings_differences(old: Mapping, new: Mapping, prefix: str = "") -> list[str]:
    """`field: old vs now new` for every field in which two settings records differ (the fields of two sub-records
    with fields in common by dotted name, e.g. `source.val_fraction`)."""
    differences = []
    for key in sorted(set(old) | set(new)):
        before, now = old.get(key), new.get(key)
        if isinstance(before, Mapping) and isinstance(now, Mapping) and set(before) & set(now):
            differences += settings_differences(before, now, f"{prefix}{key}.")
        elif before != now:
            differences.append(f"{prefix}{key}: {before!r} vs now {now!r}")
    return differences
