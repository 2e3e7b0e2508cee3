"""Imports every drafter module so each registers its kind with `base.register_drafter`."""

from __future__ import annotations

import deepspec.drafters.dflash
import deepspec.drafters.eagle3
import deepspec.drafters.mtp  # noqa: F401  ("mtp")
