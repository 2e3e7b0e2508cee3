"""The typed `target:` section shared by every job that loads a target (training, the cache job).

conf/target/<name>.yaml files are deltas over this dataclass (Hydra ConfigStore entry `target/base_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional


@dataclass
class TargetSchema:
    name: str = "smollm2-135m"  # embedded name, local dir, .gguf file or hub id
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | float32 | bfloat16 | ...
    device: Optional[str] = None  # null: cuda if available, else cpu
    revision: Optional[str] = None
    num_hidden_layers: Optional[int] = None  # declared depth (checked against config.json when available)
    layer_ids: Optional[List[int]] = None  # cached feature layers ("output of decoder layer l"); null: 5-point spread
