"""The learning benchmark (curves of every drafter kind against floors; one JSON + PNG):
`deepspec bench learning --help`."""

from deepspec.benchmarks.learning import main

if __name__ == "__main__":
    raise SystemExit(main())
