"""DSpark's configs: the HF config saved with a checkpoint, the `drafter:` params and the `loss:` section.

DSpark = the block backbone + a sequential head (`sequential_head`: markov | rnn | none) of rank
`markov_rank` + a confidence head; `markov_init` (random | bigram) chooses how the Markov head starts
(bigram: a rank-r fit of the training split's bigram log-ratios times `markov_init_scale`, bigram_init.py);
`calibration_temperatures` (one per draft, from STS) rescale the confidence logits at inference. Loss (paper
eq. 12): `0.1 L_ce + 0.9 L_tv + 1.0 L_conf`.

Block convention: anchor-predicts by default. DSpark's consumers disagree (docs/interop.md §2.1), and the
serving side reads anchor-predicts by default: speculators 0.9.0 `models/dspark/config.py:28-38`
(`sample_from_anchor` default True, "matches DeepSeek/DeepSpec convention"), SGLang 0.5.23
`speculative/dspark_components/dspark_config.py:29-31` (default True; 0.5.16-0.5.18 anchor-only), vLLM 0.33.0
`v1/worker/gpu/spec_decode/dspark/speculator.py:46-55`; only SpecForge 0.2.0's `spec_generate` is mask-predicts
only (`modeling/draft/dspark.py:326-343`). Exports write `sample_from_anchor` explicitly either way, so a
mask-predicts DSpark (`drafter.block_convention=mask-predicts`) serves as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepspec.drafters.block.config import BlockDrafterConfig, BlockLoss, BlockParams
from deepspec.drafters.spec import ANCHOR_PREDICTS

SEQUENTIAL_HEADS = ("markov", "rnn", "none")
MARKOV_INITS = ("random", "bigram")


class DSparkConfig(BlockDrafterConfig):
    model_type = "deepspec_dspark"
    drafter_kind = "dspark"
    default_block_convention = ANCHOR_PREDICTS

    def __init__(self, sequential_head: str = "markov", markov_rank: int = 256, confidence_head: bool = True,
                 calibration_temperatures: list[float] | None = None, markov_init: str = "random",
                 markov_init_scale: float = 1.0, **kwargs):
        self.sequential_head = sequential_head
        self.markov_init = markov_init
        self.markov_init_scale = float(markov_init_scale)
        self.markov_rank = int(markov_rank)
        self.confidence_head = bool(confidence_head)
        self.calibration_temperatures = (None if calibration_temperatures is None
                                         else [float(t) for t in calibration_temperatures])
        super().__init__(**kwargs)

    def validate_heads(self) -> None:
        if self.sequential_head not in SEQUENTIAL_HEADS:
            raise ValueError(f"sequential_head={self.sequential_head!r} must be one of {SEQUENTIAL_HEADS}")
        if self.markov_init not in MARKOV_INITS:
            raise ValueError(f"markov_init={self.markov_init!r} must be one of {MARKOV_INITS}")
        if self.markov_init != "random" and self.sequential_head != "markov":
            raise ValueError(f"markov_init={self.markov_init!r} needs sequential_head='markov', "
                             f"got {self.sequential_head!r}")
        if not (math.isfinite(self.markov_init_scale) and self.markov_init_scale > 0):
            raise ValueError(f"markov_init_scale={self.markov_init_scale} must be finite and > 0")
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank={self.markov_rank} must be >= 1")
        temps = self.calibration_temperatures
        if temps is not None and (len(temps) != self.num_drafts or any(t <= 0 for t in temps)):
            raise ValueError(f"calibration_temperatures must hold {self.num_drafts} positive values (one per draft "
                             f"of a {self.block_convention} block of {self.block_size}), got {temps}")


@dataclass
class DSparkParams(BlockParams):
    kind: str = "dspark"
    block_convention: str = DSparkConfig.default_block_convention
    sequential_head: str = "markov"  # markov | rnn | none
    markov_rank: int = 256  # rank r of W1 [V, r] / W2 [r, V] (also the confidence head's W1 width)
    confidence_head: bool = True
    # bigram: W1/W2 start from the training split's bigram statistics (bigram_init.py: slot 0 starts at the
    # bigram floor instead of near 0%); random: the paper's plain initialisation.
    markov_init: str = "bigram"  # bigram | random
    markov_init_scale: float = 2.0  # multiplies the bigram log-ratios the Markov head starts from


@dataclass
class DSparkLoss(BlockLoss):
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
