"""Typed configuration bases shared by every drafter kind: the `drafter:` and `loss:` sections of a run.

Each kind subclasses `DrafterParams` (its architecture fields, with their defaults: the only place they
are written) and `LossParams` (its loss knobs). The config schema stores both in Hydra's ConfigStore, so
`drafter=<kind>` composes the kind's dataclass and an unknown key (`drafter.bogus_key=3`) fails naming
the key. `DrafterParams.to_config_kwargs()` is what reaches the kind's HF config class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import List, Optional

from omegaconf import MISSING

from deepspec.losses.distribution import CHECKPOINT_MODES, DEFAULT_CHECKPOINT_BUDGET_MB, TermsOptions
from deepspec.losses.term_checks import TERM_NAMES


@dataclass
class DrafterParams:
    kind: str = MISSING  # the registry key (conf/drafter/<kind>.yaml sets it)
    num_draft_layers: int = 1
    target_layer_ids: Optional[List[int]] = None  # null: the kind's choice among the cache's layers
    init_from_target: bool = False  # copy target weights into the draft layers (kinds that support it)
    # The draft layers' family: null = the target's; else a model_type (llama, mistral, qwen2, qwen3, gemma3_text)
    # whose layers are built at the target's widths, e.g. qwen3 to serve a Llama-target DFlash/DSpark in
    # vLLM/SGLang, llama for SGLang's EAGLE-3 on a Qwen3 target (deepspec/drafters/base.py).
    layer_family: Optional[str] = None

    def requested_layer_ids(self, cache_layer_ids: Sequence[int]) -> list[int] | None:
        """The layer ids asked of the kind's `select_cache_layers`: explicit ids, else None (the kind's
        choice); a kind with a named choice among the cached layers overrides this."""
        return None if self.target_layer_ids is None else list(self.target_layer_ids)

    def to_config_kwargs(self) -> dict:
        """Keyword arguments for the kind's HF config class (everything but the kind and the layer ids,
        which are resolved against the cache)."""
        kwargs = asdict(self)
        for key in ("kind", "target_layer_ids"):
            kwargs.pop(key)
        return kwargs


@dataclass
class LossParams:
    chunk_rows: int = 512  # rows per chunk of the full-vocabulary softmaxes (memory bound)
    # Activation checkpointing of those chunks (deepspec/losses/distribution.py): auto checkpoints only when the
    # logits autograd would keep (rows x vocab x 16 B) exceed checkpoint_budget_mb; always | never force it.
    checkpoint: str = "auto"
    checkpoint_budget_mb: float = DEFAULT_CHECKPOINT_BUDGET_MB
    # Debugging: check every input of every loss call, label, vocabulary-index and position values included (the value
    # checks read the device: host syncs in every step; deepspec/losses/term_checks.py). Off, the distribution terms
    # only assert their row counts and no value is read: the objectives build the tensors, the cache reader checks
    # every token id once, where it reads it (online features: the target's embedding reads them first), and
    # `set_draft_vocab` the draft vocabulary.
    check_values: bool = False

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise ValueError(f"loss.chunk_rows={self.chunk_rows} must be >= 1")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"loss.checkpoint={self.checkpoint!r} must be one of {CHECKPOINT_MODES}")
        if self.checkpoint_budget_mb < 0:
            raise ValueError(f"loss.checkpoint_budget_mb={self.checkpoint_budget_mb} must be >= 0")

    def terms_options(self, need: Sequence[str] = TERM_NAMES) -> TermsOptions:
        """The options of `distribution_terms` / `top_k_target_terms` for the terms `need`, with this config's
        chunking, checkpointing and value checks."""
        return TermsOptions(need=tuple(need), chunk_rows=self.chunk_rows, checkpoint=self.checkpoint,
                            checkpoint_budget_mb=self.checkpoint_budget_mb, check_values=self.check_values)

    @staticmethod
    def check_weights(**weights: float | None) -> None:
        for name, value in weights.items():
            if value is not None and value < 0:
                raise ValueError(f"loss.{name}={value} must be >= 0")
