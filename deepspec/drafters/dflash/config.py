"""DFlash's configs: the block backbone alone, no sequential stage and no confidence head. Loss: CE (TV optional).

Block convention: mask-predicts by default, the reading of every DFlash consumer (slot 0 = the anchor predicts
nothing; dflash 0.1.0 `model.py:243-268`, SpecForge 0.2.0 `modeling/draft/dflash.py:415-429`, SGLang 0.5.23
`speculative/dflash_worker_v2.py:2798-2812`, vLLM 0.33.0 `v1/worker/gpu/spec_decode/dflash/speculator.py:64-89`;
docs/interop.md §2.1). anchor-predicts stays available (`drafter.block_convention=anchor-predicts`) and exports
only to the `hf` layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepspec.drafters.block.config import BlockDrafterConfig, BlockLoss, BlockParams
from deepspec.drafters.spec import MASK_PREDICTS

# Fields DSpark has and DFlash does not, with the value that means "absent" (a DSpark config with its heads off
# is a DFlash one; any other value asks for a head DFlash does not have).
_ABSENT_HEAD_FIELDS = {"sequential_head": "none", "confidence_head": False, "calibration_temperatures": None}


class DFlashConfig(BlockDrafterConfig):
    model_type = "deepspec_dflash"
    drafter_kind = "dflash"
    default_block_convention = MASK_PREDICTS

    def __init__(self, **kwargs):
        for name, absent in _ABSENT_HEAD_FIELDS.items():
            value = kwargs.pop(name, absent)
            if value != absent:
                raise ValueError(f"DFlash has no {name.replace('_', ' ')}: {name} must be {absent!r}, got {value!r}")
        super().__init__(**kwargs)


@dataclass
class DFlashParams(BlockParams):
    kind: str = "dflash"
    block_convention: str = DFlashConfig.default_block_convention


@dataclass
class DFlashLoss(BlockLoss):
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conf_weight != 0:
            raise ValueError(f"loss.conf_weight={self.conf_weight}: DFlash has no confidence head (must be 0)")
