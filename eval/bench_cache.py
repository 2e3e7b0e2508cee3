"""Benchmark the feature cache on the embedded target (one JSON object, also written to --out):
`deepspec bench cache --help`."""

from deepspec.benchmarks.cache import main

if __name__ == "__main__":
    raise SystemExit(main())
