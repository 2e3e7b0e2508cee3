"""The cache built by vLLM against the transformers builder (one JSON object, also written to
--out): `deepspec bench cache_engine --help`."""

from deepspec.benchmarks.cache_engine import main

if __name__ == "__main__":
    raise SystemExit(main())
