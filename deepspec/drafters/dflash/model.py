"""DFlash = the block drafter with no heads (deepspec/drafters/block/model.py)."""

from __future__ import annotations

from deepspec.drafters.block.model import BlockDrafter
from deepspec.drafters.dflash.config import DFlashConfig


class DFlashDrafter(BlockDrafter):
    config_class = DFlashConfig
