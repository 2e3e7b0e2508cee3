"""Benchmark drafter training throughput with 1 and 2 CPU processes (one JSON object): `deepspec bench train --help`."""

from deepspec.benchmarks.train import main

if __name__ == "__main__":
    raise SystemExit(main())
