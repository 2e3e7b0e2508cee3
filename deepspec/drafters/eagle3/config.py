"""Eagle3's configs: the HF config saved with a checkpoint, the `drafter:` params and the `loss:` section.

Fields: `ttt_steps` (training-time-test depth, and the default chain length at inference), an optional
reduced `draft_vocab_size` (d2t/t2d, draft_vocab.py), exactly one draft layer. Target layers: every cached
layer by default (the paper's protocol: the same feature layers for every drafter, 5 by default);
`drafter.feature_layers=low_mid_high` keeps Eagle3's original 3-layer choice (the first, middle and last
cached layer), which is what the SGLang and vLLM Eagle3 engines read (their `fc` is 3H -> H).
Loss: `sum_s ttt_decay^s * mean(soft_ce_s)` (SpecForge: decay 0.8).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from deepspec.drafters.base import DrafterConfig
from deepspec.drafters.params import DrafterParams, LossParams
from deepspec.losses.position_weights import DEFAULT_TTT_DECAY
from deepspec.targets.layers import DEFAULT_NUM_FEATURE_LAYERS, spread_layer_ids, validate_layer_ids

FEATURE_LAYER_CHOICES = ("all", "low_mid_high")


def low_mid_high(layer_ids: Sequence[int]) -> list[int]:
    """The first, middle and last of `layer_ids` (all of them when 3 or fewer): Eagle3's original choice."""
    ids = [int(i) for i in layer_ids]
    return [ids[0], ids[len(ids) // 2], ids[-1]] if len(ids) > 3 else ids


class Eagle3Config(DrafterConfig):
    """Eagle3 drafter config: TTT depth, optional reduced draft vocabulary."""

    model_type = "deepspec_eagle3"
    drafter_kind = "eagle3"

    def __init__(self, ttt_steps: int = 7, draft_vocab_size: int | None = None, pad_token_id_for_shift: int = 0,
                 **kwargs):
        self.ttt_steps = int(ttt_steps)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.pad_token_id_for_shift = int(pad_token_id_for_shift)  # embedded past a sequence end (never scored)
        super().__init__(**kwargs)
        if self.target_config and not self.target_layer_ids:
            self.target_layer_ids = spread_layer_ids(self.target_num_layers, DEFAULT_NUM_FEATURE_LAYERS)
        self.validate_architecture()

    def validate_architecture(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"eagle3.ttt_steps={self.ttt_steps} must be >= 1")
        if self.num_draft_layers != 1:
            raise ValueError(f"eagle3.num_draft_layers={self.num_draft_layers}: Eagle3 has exactly one draft layer")
        if self.target_config:
            validate_layer_ids(self.target_layer_ids, self.target_num_layers, "eagle3.target_layer_ids")
            if not self.target_layer_ids:
                raise ValueError("eagle3.target_layer_ids must name at least one target layer")
            if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.target_vocab_size:
                raise ValueError(f"eagle3.draft_vocab_size={self.draft_vocab_size} must be in "
                                 f"[1, {self.target_vocab_size}] (or None for the full vocabulary)")


@dataclass
class Eagle3Params(DrafterParams):
    kind: str = "eagle3"
    num_draft_layers: int = 1  # Eagle3 has exactly one draft layer
    ttt_steps: int = 7  # training-time-test unroll depth (and the default chain length at inference)
    draft_vocab_size: Optional[int] = None  # null: the full target vocabulary; else the most frequent tokens
    # Cached layers fused by fc when target_layer_ids is null: "all" (the paper's protocol) or "low_mid_high"
    # (the first, middle and last cached layer: Eagle3's original 3, what SGLang/vLLM Eagle3 engines read).
    feature_layers: str = "all"

    def __post_init__(self) -> None:
        if self.feature_layers not in FEATURE_LAYER_CHOICES:
            raise ValueError(f"drafter.feature_layers={self.feature_layers!r} must be one of {FEATURE_LAYER_CHOICES}")
        if self.feature_layers != "all" and self.target_layer_ids is not None:
            raise ValueError(f"drafter.feature_layers={self.feature_layers!r} and drafter.target_layer_ids="
                             f"{list(self.target_layer_ids)}: set one of them")

    def requested_layer_ids(self, cache_layer_ids: Sequence[int]) -> list[int] | None:
        if self.feature_layers == "low_mid_high":
            return low_mid_high(cache_layer_ids)
        return super().requested_layer_ids(cache_layer_ids)

    def to_config_kwargs(self) -> dict:
        kwargs = super().to_config_kwargs()
        kwargs.pop("feature_layers")  # resolved into target_layer_ids against the cache
        return kwargs


@dataclass
class Eagle3Loss(LossParams):
    ttt_decay: float = DEFAULT_TTT_DECAY  # step s weighs ttt_decay^s

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ttt_decay > 0:
            raise ValueError(f"loss.ttt_decay={self.ttt_decay} must be > 0")
