"""Acceptance parity of exported block drafters in their consumers' own loops: trains a DFlash
(mask-predicts) and a DSpark (anchor-predicts) drafter on a tiny random Qwen3's own greedy continuations, exports
them (SGLang / vLLM layouts) and compares accepted tokens per step, greedy, same prompts: DeepSpec's loop vs
dflash's `dflash_generate` and speculators' DSpark forward. Prints one JSON object and writes it to --out.

Needs the consumer libraries (scripts/bootstrap.sh installs them); the logic is in
tests/export/consumers/acceptance.py (test-harness code, like the consumers it drives).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; a hub lookup must fail fast, not hang


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench_interop_acceptance.json"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48, help="training continuation length (loops: 8 fewer)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kinds", nargs="+", default=["dflash", "dspark"], choices=["dflash", "dspark"])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "export" / "consumers"))
    import acceptance

    from deepspec.utils.io import emit_report

    settings = acceptance.Settings(num_prompts=args.prompts, num_new=args.new_tokens, steps=args.steps,
                                   kinds=tuple(args.kinds))
    with tempfile.TemporaryDirectory(prefix="deepspec-acceptance-") as workdir:
        report = acceptance.run(settings, Path(workdir))
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
