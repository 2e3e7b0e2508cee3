"""`python -m deepspec.training.latest RUN_DIR`: print the drafter folder of the checkpoint a rerun of the training
would resume from, for the commands that take a drafter (`deepspec calibrate --drafter`, `deepspec evaluate`,
`deepspec export --checkpoint`).

That is `latest_checkpoint`'s choice: the newest `checkpoints/step-XXXXXXXX` whose files match its checksums.json.
A half-written `step-XXXXXXXX.tmp` left by a crash is never taken, nor a damaged checkpoint (each is named in a
warning on stderr and the next older valid one printed). No checkpoint at all is a one-line error.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from deepspec.training.checkpoint import CHECKPOINTS, DRAFTER_DIR, latest_checkpoint
from deepspec.utils.errors import command_line


def latest_drafter_dir(run_dir: str | Path) -> Path:
    """`<run_dir>/checkpoints/step-XXXXXXXX/drafter` of the newest valid checkpoint (FileNotFoundError if none)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise FileNotFoundError(f"{Path(run_dir) / CHECKPOINTS}: no complete checkpoint (a step-XXXXXXXX folder with "
                                "its checksums.json): the run has not saved one yet, or this is not a run folder")
    return checkpoint / DRAFTER_DIR


@command_line("python -m deepspec.training.latest")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepspec.training.latest", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training run folder, e.g. outputs/train/dspark-qwen3-8b")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(latest_drafter_dir(args.run_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
