"""Regenerate assistant answers with the target: prompts -> JSONL in input order (resumable):
`deepspec regenerate --help`."""

from deepspec.data.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
