"""Eagle3's configs: the HF config saved with a checkpoint, the `drafter:` params and the `loss:` section.

Fields: `ttt_steps` (training-time-test depth, and the default chain length at inference), an optional
reduced `draft_vocab_size` (d2t/t2d, draft_vocab.py), exactly one draft layer, 3 target layers by default
(low/mid/high). Loss: `sum_s ttt_decay^s * mean(soft_ce_s)` (SpecForge: decay 0.8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from deepspec.drafters.base import DrafterConfig
from deepspec.drafters.params import DrafterParams, LossParams
from deepspec.losses.position_weights import DEFAULT_TTT_DECAY
from deepspec.targets.layers import spread_layer_ids, validate_layer_ids

NUM_FEATURE_LAYERS = 3  # low / mid / high target layers fused by fc


class Eagle3Config(DrafterConfig):
    """Eagle3 drafter config: TTT depth, optional reduced draft vocabulary."""

    model_type = "deepspec_eagle3"
    drafter_kind = "eagle3"

    def __init__(self, ttt_steps: int = 7, draft_vocab_size: int | None = None, pad_token_id_for_shift: int = 0,
                 **kwargs):
        kwargs.pop("ttt_decay", None)  # older config.json files kept the loss decay here (now `loss.ttt_decay`)
        self.ttt_steps = int(ttt_steps)
        self.draft_vocab_size = None if draft_vocab_size is None else int(draft_vocab_size)
        self.pad_token_id_for_shift = int(pad_token_id_for_shift)  # embedded past a sequence end (never scored)
        super().__init__(**kwargs)
        if self.target_config and not self.target_layer_ids:
            self.target_layer_ids = spread_layer_ids(self.target_num_layers, NUM_FEATURE_LAYERS)
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


@dataclass
class Eagle3Loss(LossParams):
    ttt_decay: float = DEFAULT_TTT_DECAY  # step s weighs ttt_decay^s

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.ttt_decay > 0:
            raise ValueError(f"loss.ttt_decay={self.ttt_decay} must be > 0")
