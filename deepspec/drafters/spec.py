"""What a drafter kind is, in one place: `DrafterSpec`, and the one registry of kinds.

Every stage asks the spec instead of branching on the kind (cf. torchtitan's `ModelSpec` and per-model
`model_registry`): training builds the batcher and the objective from it, decoding its proposers,
calibration/evaluation read its capabilities, export its engine layouts, the config schema its typed
params and loss dataclasses.

Registry: the built-in kinds are listed explicitly in `BUILTIN_KINDS` (kind -> module holding `SPEC`) and
imported lazily on first use; importing a kind's module registers nothing. User kinds are added with
`register_drafter_spec(spec)` (a new drafter is one folder + its `conf/drafter/<kind>.yaml` + its test, see
docs/ADDING_A_DRAFTER.md).

Shape legend: none (no tensors here).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from deepspec.cache.format import CONTENT_HIDDEN

BUILTIN_KINDS: dict[str, str] = {
    "dspark": "deepspec.drafters.dspark.spec",
    "dflash": "deepspec.drafters.dflash.spec",
    "eagle3": "deepspec.drafters.eagle3.spec",
    "mtp": "deepspec.drafters.mtp.spec",
    "standalone": "deepspec.drafters.standalone.spec",
}

ANCHOR_PREDICTS = "anchor-predicts"  # block slot j predicts x[anchor + j + 1] (the DSpark paper's code)
MASK_PREDICTS = "mask-predicts"  # slot 0 predicts nothing, slot j predicts x[anchor + j] (the DFlash engines)


@dataclass(frozen=True)
class Capabilities:
    """What a drafter (a kind with one config) can do; asked instead of probing attributes."""

    num_positions: int  # draft positions per chain it trains and proposes (block size, TTT steps, MTP modules)
    confidence_head: bool = False  # proposes calibrated per-position confidences (STS-calibratable)
    # How its confidences can be labelled for STS (deepspec.calibration.collect), preferred first: "analytic"
    # (teacher-forced blocks from the cache, block drafters) and/or "empirical" (rollouts of the decoding loop).
    confidence_labels: tuple[str, ...] = ("analytic", "empirical")
    draft_vocab: bool = False  # supports a reduced draft vocabulary (d2t/t2d)
    block_convention: str | None = None  # block drafters: ANCHOR_PREDICTS or MASK_PREDICTS; chains: None
    needs_target_lse: bool = False  # training reads the target's per-token log-normaliser (online computes it then)


@dataclass(frozen=True)
class BatchSettings:
    """Everything a batcher needs besides the drafter's own config (from the training/data config)."""

    cache_layer_ids: Sequence[int]  # the layers the cache stores, in its order
    feature_layer_ids: Sequence[int]  # the layers the drafter reads (a subset, in the drafter's order)
    max_anchors_per_seq: int = 512  # block drafters: anchors sampled per sequence
    max_tokens_per_row: int = 4096  # chain drafters: packed row length
    pad_token_id: int = 0
    seed: int = 0


@dataclass
class BatchCounts:
    tokens: int  # context tokens read from the cache
    anchors: int  # draft chains trained (blocks, or supervised positions for chain drafters)


class Batcher(Protocol):
    """Turns cached samples into one training batch of a kind (and counts what a batch holds)."""

    def collate(self, samples: Sequence, epoch: int = 0): ...

    def counts(self, batch) -> BatchCounts: ...


@dataclass(frozen=True)
class DrafterSpec:
    """Everything the stages need to know about one drafter kind.

    `objective(drafter, batch, loss_cfg, with_metrics)` returns a `deepspec.losses.objectives.StepResult`;
    with `with_metrics=True` it also computes the per-row terms validation's acceptance metrics read (TV),
    whatever the loss weights. `proposer(drafter, **opts)` / `batch_proposer(drafter, **opts)` build the
    batch-1 and batched proposers (`deepspec.decoding.proposers` protocols). `default_feature_layers(L)` is
    the kind's default target-layer choice for an L-layer target; `select_cache_layers(cache_ids, requested)`
    the layers it reads from a cache that stores `cache_ids` (raises naming `drafter.target_layer_ids`).
    `export_layouts` maps an export format ("hf", "sglang", "vllm", "nextn", "causal_lm") to the engine
    architecture the format's module writes for this kind. `prepare_for_training(drafter, samples, tokenizer)`
    runs before the first step (data-dependent initialisation, e.g. Eagle3's reduced vocabulary), or is None.
    `cache_contents` lists the cache content modes (`deepspec.cache.format.CONTENTS`) it can train from: every
    kind reads hidden states; a kind that needs only the target's next-token law may also read a top-k cache.
    """

    kind: str
    config_class: type  # the HF `DrafterConfig` subclass saved as config.json
    model_class: type  # the `DrafterModel` subclass
    params_class: type  # Hydra-typed `drafter:` section (per-kind fields, defaults live here)
    loss_class: type  # Hydra-typed `loss:` section (per-kind loss knobs and defaults)
    make_batcher: Callable[[Any, BatchSettings], Batcher]  # (drafter config, settings) -> Batcher
    objective: Callable[..., Any]
    proposer: Callable[..., Any]
    batch_proposer: Callable[..., Any]
    capabilities: Callable[[Any], Capabilities]  # drafter config -> Capabilities
    default_feature_layers: Callable[[int], list[int]]
    select_cache_layers: Callable[[Sequence[int], Sequence[int] | None], list[int]]
    export_layouts: Mapping[str, str] = field(default_factory=dict)
    prepare_for_training: Callable[..., None] | None = None
    cache_contents: tuple[str, ...] = (CONTENT_HIDDEN,)


_USER_SPECS: dict[str, DrafterSpec] = {}


def register_drafter_spec(spec: DrafterSpec) -> DrafterSpec:
    """Add a user drafter kind (a built-in kind's name cannot be taken); returns the spec."""
    if spec.kind in BUILTIN_KINDS:
        raise ValueError(f"drafter kind {spec.kind!r} is built in; choose another name")
    existing = _USER_SPECS.get(spec.kind)
    if existing is not None and existing is not spec:
        raise ValueError(f"drafter kind {spec.kind!r} is already registered")
    if getattr(spec.config_class, "drafter_kind", None) != spec.kind:
        raise ValueError(f"{spec.config_class.__name__}.drafter_kind must be {spec.kind!r}")
    _USER_SPECS[spec.kind] = spec
    return spec


def unregister_drafter_spec(kind: str) -> None:
    """Remove a user kind (tests that register one clean up after themselves)."""
    _USER_SPECS.pop(kind, None)


def drafter_kinds() -> list[str]:
    return sorted([*BUILTIN_KINDS, *_USER_SPECS])


def get_drafter_spec(kind: str) -> DrafterSpec:
    if kind in _USER_SPECS:
        return _USER_SPECS[kind]
    if kind not in BUILTIN_KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; known: {drafter_kinds()}")
    return importlib.import_module(BUILTIN_KINDS[kind]).SPEC


def spec_of(drafter_or_config) -> DrafterSpec:
    """The spec of a drafter model or its config (by `config.drafter_kind`)."""
    config = getattr(drafter_or_config, "config", drafter_or_config)
    kind = getattr(config, "drafter_kind", None)
    if not isinstance(kind, str):
        raise ValueError(f"{type(drafter_or_config).__name__} has no config.drafter_kind: not a DeepSpec drafter")
    return get_drafter_spec(kind)


def spec_of_model_type(model_type: str) -> DrafterSpec:
    """The spec whose HF config has `model_type` (what a saved config.json names)."""
    for kind in drafter_kinds():
        spec = get_drafter_spec(kind)
        if spec.config_class.model_type == model_type:
            return spec
    raise ValueError(f"config.json model_type {model_type!r} is not a registered drafter; "
                     f"known kinds: {drafter_kinds()}")


def capabilities_of(drafter_or_config) -> Capabilities:
    config = getattr(drafter_or_config, "config", drafter_or_config)
    return spec_of(config).capabilities(config)


def layers_in_cache(ids: Sequence[int], cache_layer_ids: Sequence[int]) -> list[int]:
    """`ids` as a list, after checking each is stored in the cache (a `select_cache_layers` helper)."""
    ids, cached = [int(i) for i in ids], [int(i) for i in cache_layer_ids]
    missing = [i for i in ids if i not in cached]
    if missing:
        raise ValueError(f"drafter.target_layer_ids={ids}: layers {missing} are not in the cache's layer ids {cached}")
    return ids
