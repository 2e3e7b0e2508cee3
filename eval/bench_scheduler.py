"""The scheduler benchmark (prints one JSON object and writes it to --out): `deepspec bench scheduler --help`."""

from deepspec.evaluation.bench_scheduler import main

if __name__ == "__main__":
    raise SystemExit(main())
