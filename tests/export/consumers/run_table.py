"""Print the kind x layout x consumer interop table (Markdown) and write it as JSON.

Run in an environment that has the consumer libraries (scripts/bootstrap_consumers.sh):
    PYTHONPATH=$PWD .venv/bin/python tests/export/consumers/run_table.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a consumer that resolves a hub name must fail fast, not hang
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))  # scripts beside the harness import it directly
    import harness

    versions = {name: harness.consumer_version(name) for name in ("speculators", "dflash", "specforge",
                                                                  "transformers", "torch")}
    rows = harness.run_all()
    print("consumer versions:", json.dumps(versions))
    print(harness.markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "rows": [r.as_dict() for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
