"""The confidence head's calibration after training: an `on_train_end` hook (`Session.on_train_end`: each is called
as `hook(session, checkpoint)` once the last checkpoint is saved, with the averaged weights swapped in when there is
an average). `deepspec.training.run` adds it, after the caller's hooks, for a drafter with a confidence head when
`calibration.enabled`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from deepspec.targets.sharding import is_partitioned
from deepspec.training.checkpoint import DRAFTER_DIR

log = logging.getLogger(__name__)


def calibrate_after_training_hook(session, checkpoint: Path | None):
    """`on_train_end` hook: STS of the confidence head on the training cache's validation split (the run's
    `calibration:` section: rollouts with the training target by default), results under
    `<out_dir>/calibration/`, temperatures into the last checkpoint's
    saved drafter. Rank 0 only; under ZeRO-3 the drafter's weights would have to be gathered first: not
    supported, skipped with a warning (run `deepspec calibrate` on the checkpoint)."""
    from deepspec.calibration.run import calibrate_after_training

    if session.placement.rank != 0:
        return None
    if is_partitioned(session.target):
        log.warning("calibration after training skipped with data.target_sharding=%s (rank 0 would run a target whose "
                    "weights every rank holds a part of alone): run `deepspec calibrate` on the checkpoint",
                    session.cfg.data.target_sharding)
        return None
    if session.cfg.deepspeed.stage == 3:
        log.warning("calibration after training skipped under ZeRO-3: run `deepspec calibrate` on the checkpoint")
        return None
    drafter_dir = Path(checkpoint) / DRAFTER_DIR if checkpoint is not None else None
    dirs = [drafter_dir] if drafter_dir is not None and drafter_dir.is_dir() else []
    return calibrate_after_training(session.out_dir, session.drafter, session.data.reader, session.cfg.calibration,
                                    drafter_dirs=dirs, target=session.target)


def calibrate_confidence(session, checkpoint) -> None:
    """The hook with a failure (e.g. a validation split too small for the configured minimum)
    reported, not fatal: `deepspec calibrate` can be rerun. The error says what to change; the
    warning adds the rerun."""
    try:
        calibrate_after_training_hook(session, checkpoint)
    except ValueError as err:
        log.warning("calibration after training skipped: %s (once that is addressed: `deepspec "
                    "calibrate --drafter %s/drafter --cache ...`)", err, checkpoint)
