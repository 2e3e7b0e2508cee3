"""The kernels benchmark (prints one JSON object and writes it to --out): `deepspec bench kernels --help`."""

from deepspec.benchmarks.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
