"""Standalone vs DSpark, trained on the same cache and decoded on the same prompts (prints one JSON object and
writes it under --out-dir): `deepspec bench standalone --help`."""

from deepspec.benchmarks.standalone import main

if __name__ == "__main__":
    raise SystemExit(main())
