"""What grows with what in a training step (CPU-s, memory; one JSON + PNG): `deepspec bench scaling --help`."""

from deepspec.benchmarks.scaling import main

if __name__ == "__main__":
    raise SystemExit(main())
