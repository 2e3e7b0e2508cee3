"""DFlash's configs: the block backbone alone, no sequential stage and no confidence head. Loss: CE (TV optional)."""

from __future__ import annotations

from dataclasses import dataclass

from deepspec.drafters.block.config import BlockDrafterConfig, BlockLoss, BlockParams

# Fields a DSpark checkpoint has and DFlash does not, with the value that means "absent" (older DFlash
# config.json files recorded them; any other value asks for a head DFlash does not have).
_ABSENT_HEAD_FIELDS = {"sequential_head": "none", "confidence_head": False, "calibration_temperatures": None}


class DFlashConfig(BlockDrafterConfig):
    model_type = "deepspec_dflash"
    drafter_kind = "dflash"

    def __init__(self, **kwargs):
        for name, absent in _ABSENT_HEAD_FIELDS.items():
            value = kwargs.pop(name, absent)
            if value != absent:
                raise ValueError(f"DFlash has no {name.replace('_', ' ')}: {name} must be {absent!r}, got {value!r}")
        kwargs.pop("markov_rank", None)  # recorded by older DFlash configs; never used without a sequential head
        super().__init__(**kwargs)


@dataclass
class DFlashParams(BlockParams):
    kind: str = "dflash"


@dataclass
class DFlashLoss(BlockLoss):
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conf_weight != 0:
            raise ValueError(f"loss.conf_weight={self.conf_weight}: DFlash has no confidence head (must be 0)")
