"""The scheduler benchmark (prints one JSON object and writes it to --out): `deepspec bench scheduler --help`."""

from deepspec.benchmarks.scheduler import main

if __name__ == "__main__":
    raise SystemExit(main())
