"""The calibration benchmark (prints one JSON object and writes it to --out): `deepspec bench calibration --help`."""

from deepspec.benchmarks.calibration import main

if __name__ == "__main__":
    raise SystemExit(main())
