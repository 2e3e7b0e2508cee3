"""The drafters benchmark (prints one JSON object and writes it to --out): `deepspec bench drafters --help`."""

from deepspec.benchmarks.drafters import main

if __name__ == "__main__":
    raise SystemExit(main())
