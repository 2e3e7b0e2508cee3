"""Acceptance parity of exported block drafters in their consumers' own loops: `deepspec bench interop --help`."""

from deepspec.benchmarks.interop_acceptance import main

if __name__ == "__main__":
    raise SystemExit(main())
