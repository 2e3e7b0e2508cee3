"""The drafters benchmark (prints one JSON object and writes it to --out): `deepspec bench drafters --help`."""

from deepspec.evaluation.bench_drafters import main

if __name__ == "__main__":
    raise SystemExit(main())
