"""The training objective of a drafter: its spec's objective, with its kind's loss defaults when none is given.

Each kind's objective lives with the kind (deepspec/drafters/<kind>/objective.py) and returns a
`StepResult` (loss + per-row terms + each row's position/chain), so logging and validation never recompute.
`with_metrics=True` also computes what validation's acceptance metrics read (TV), whatever the loss weights.
"""

from __future__ import annotations

from deepspec.drafters.spec import spec_of
from deepspec.losses.objectives import StepResult


def compute_training_loss(drafter, batch, loss_cfg=None, with_metrics: bool = False) -> StepResult:
    """`loss_cfg`: the kind's loss dataclass (`spec.loss_class`); None uses its defaults."""
    spec = spec_of(drafter)
    if loss_cfg is None:
        loss_cfg = spec.loss_class()
    elif not isinstance(loss_cfg, spec.loss_class):
        raise TypeError(f"drafter kind {spec.kind!r} trains with a {spec.loss_class.__name__} loss config, "
                        f"got {type(loss_cfg).__name__}")
    return spec.objective(drafter, batch, loss_cfg, with_metrics=with_metrics)
