"""An exponential moving average of the trainable weights (`trainer.ema_decay`): what validation scores and what a
checkpoint's `drafter/` holds, so calibration, evaluation and export read the averaged drafter.

After each optimizer step, average = d * average + (1 - d) * weights (d = `trainer.ema_decay`; 0 turns it off). The
average spans about 1 / (1 - d) steps: at a high learning rate one step's weights carry that step's batch noise, and
the average smooths it away (the learning benchmark's curves: docs/results.md).

The average lives next to the weights DeepSpeed updates, in fp32 on their device, one copy per rank: every rank holds
the whole drafter under ZeRO-1/2; ZeRO-3 partitions it, and is refused (`check_weight_average`). The raw weights go
on training: a checkpoint keeps them too (`TRAINING_WEIGHTS_FILE`), and resume restores both.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def check_weight_average(decay: float, zero_stage: int) -> None:
    if decay > 0 and zero_stage == 3:
        raise ValueError("trainer.ema_decay > 0 needs the whole drafter on every rank: ZeRO stage 1 or 2, not 3 "
                         "(deepspeed.stage)")


class WeightAverage:
    """The average of `module`'s trainable parameters, started at their current values."""

    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = float(decay)
        self.names, self.params = zip(*[(n, p) for n, p in module.named_parameters() if p.requires_grad])
        self.average = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        torch._foreach_lerp_(self.average, [p.detach().float() for p in self.params], 1.0 - self.decay)

    @contextmanager
    def swapped_in(self):
        """The module runs with the average inside the block, with its own weights again after it (bit-exact)."""
        own = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, average in zip(self.params, self.average):
                param.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, weights in zip(self.params, own):
                    param.copy_(weights)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """name -> fp32 average on the CPU."""
        return {name: average.cpu().clone() for name, average in zip(self.names, self.average)}

    @torch.no_grad()
    def load_state_dict(self, weights: dict[str, torch.Tensor], where: str) -> None:
        missing = [name for name in self.names if name not in weights]
        if missing:
            raise ValueError(f"{where} lacks the averaged weights of {missing[:5]}")
        for name, average in zip(self.names, self.average):
            average.copy_(weights[name].float())
