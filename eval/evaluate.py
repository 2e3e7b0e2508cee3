"""Evaluate drafters' acceptance length tau on benchmarks (paper table 1, fig. 2, fig. 5):
`deepspec evaluate --help`."""

from deepspec.evaluation.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
