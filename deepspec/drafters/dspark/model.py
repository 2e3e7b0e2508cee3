"""DSpark = the block drafter + a sequential head (Markov / RNN, `heads.py`) + a confidence head.

The heads are built after the backbone (`BlockDrafter.build_heads`), so parameters are created in the
same order as the single-class drafter this split from. Confidence at inference is `sigmoid(logit / T_k)`
with the STS temperatures in `config.calibration_temperatures` (plain sigmoid before calibration).
"""

from __future__ import annotations

import torch

from deepspec.drafters.block.model import BlockDrafter
from deepspec.drafters.dspark.config import DSparkConfig
from deepspec.drafters.dspark.heads import SEQUENTIAL_HEAD_CLASSES, ConfidenceHead


class DSparkDrafter(BlockDrafter):
    config_class = DSparkConfig

    def build_heads(self, config: DSparkConfig):
        # With a reduced vocabulary W2 maps to the draft vocabulary and W1 has one more row for every previous
        # token outside it (heads.py, BlockDrafter.draft_rows).
        vocab = config.draft_vocab_size or config.target_vocab_size
        prev_rows = vocab if config.draft_vocab_size is None else vocab + 1
        rank, hidden = config.markov_rank, config.hidden_size
        sequential = None
        if config.sequential_head != "none":
            sequential = SEQUENTIAL_HEAD_CLASSES[config.sequential_head](vocab, rank, hidden, prev_rows)
        confidence = None
        if config.confidence_head:
            confidence = ConfidenceHead(hidden, rank, prev_rows, own_embedding=sequential is None)
        return sequential, confidence

    def confidence_probability(self, logit_B: torch.Tensor, slot: int) -> torch.Tensor:
        temps = self.config.calibration_temperatures
        return torch.sigmoid(logit_B / temps[slot] if temps else logit_B)
