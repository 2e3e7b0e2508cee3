"""The speed benchmark (prints one JSON object and writes it to --out): `deepspec bench speed --help`."""

from deepspec.benchmarks.speed import main

if __name__ == "__main__":
    raise SystemExit(main())
