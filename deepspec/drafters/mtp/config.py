"""MTP's configs: the HF config saved with a checkpoint, the `drafter:` params and the `loss:` section.

D chained modules (`num_mtp_modules`), reading only the target's final hidden state (no feature layers).
Loss: `module_loss_weight / D * sum_k mean(CE_k)` (lambda = 0.3 in DeepSeek-V3), or soft CE against the
target distribution with `use_target_kl` (KL(p_t || p_d) up to the constant target entropy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from deepspec.drafters.base import DrafterConfig
from deepspec.drafters.params import DrafterParams, LossParams


class MTPConfig(DrafterConfig):
    """D chained modules over the target's final hidden state."""

    model_type = "deepspec_mtp"
    drafter_kind = "mtp"

    def __init__(self, num_mtp_modules: int = 1, pad_token_id_for_shift: int = 0, **kwargs):
        self.num_mtp_modules = int(num_mtp_modules)
        self.pad_token_id_for_shift = int(pad_token_id_for_shift)
        super().__init__(**kwargs)
        self.validate_architecture()

    def validate_architecture(self) -> None:
        if self.num_mtp_modules < 1:
            raise ValueError(f"mtp.num_mtp_modules={self.num_mtp_modules} must be >= 1")


@dataclass
class MTPParams(DrafterParams):
    kind: str = "mtp"
    target_layer_ids: Optional[List[int]] = field(default_factory=list)  # MTP reads only the final hidden state
    num_mtp_modules: int = 1  # D chained modules; a round drafts D tokens by default


@dataclass
class MTPLoss(LossParams):
    module_loss_weight: float = 0.3  # lambda (DeepSeek-V3): L = lambda / D * sum_k L_k
    use_target_kl: bool = False  # L_k = soft CE against the target distribution instead of CE against the data

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.module_loss_weight > 0:
            raise ValueError(f"mtp.module_loss_weight={self.module_loss_weight} must be > 0")
