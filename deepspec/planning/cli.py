"""`deepspec plan [OVERRIDES] [--world-size N] [--device cuda|cpu] [--device-memory-gb G] [--samples N --mean-tokens T]
[--measure [--steps N]] [--out FILE]`: the plan of a training configuration (the overrides `deepspec train` takes),
printed as a table and written as JSON; `--measure` also runs it here and prints the measurement beside the plan.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from deepspec.utils.errors import UsageError, command_line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepspec plan", description="Per-rank memory by component, tokens, FLOPs and steps of a training "
        "configuration, and the largest micro-batch that fits a device; --measure runs it on this machine.")
    parser.add_argument("overrides", nargs="*", help="`deepspec train` overrides, e.g. experiment=paper "
                        "target=qwen3-8b drafter=dspark deepspeed=zero2")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks of the run (default: WORLD_SIZE of a launcher, else 1)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the device each rank trains on")
    parser.add_argument("--device-memory-gb", type=float, default=None,
                        help="memory of one device in GiB (default: 79.6 for cuda, an \"80 GB\" H100; this "
                             "machine's RAM for cpu)")
    parser.add_argument("--samples", type=int, default=None, help="conversations in the data (with --mean-tokens)")
    parser.add_argument("--mean-tokens", type=float, default=None, help="mean tokens per conversation")
    parser.add_argument("--measure", action="store_true",
                        help="run the configuration here (one process, a random-weight target of the same widths, a "
                             "synthetic cache of the planned shapes) and print the measurement beside the plan")
    parser.add_argument("--steps", type=int, default=2, help="--measure: optimizer steps to run (at least 2: the "
                        "optimizer states exist from the first step's end on)")
    parser.add_argument("--out", type=Path, default=Path("outputs/plan.json"), help="where the JSON goes")
    return parser


@command_line("deepspec plan")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if (args.samples is None) != (args.mean_tokens is None):
        raise UsageError("--samples and --mean-tokens go together (conversations and their mean tokens)")
    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: measure at least 2 optimizer steps (AdamW's states exist from the "
                         "end of the first one on, so only later steps reach the run's peak)")
    from deepspec.planning.run import run_plan
    from deepspec.utils.io import atomic_write_json

    report, text = run_plan(args.overrides, world_size=args.world_size, device=args.device,
                            device_memory_gb=args.device_memory_gb, samples=args.samples,
                            mean_tokens=args.mean_tokens, measure=args.measure, steps=args.steps)
    report["command"] = "deepspec plan " + " ".join(argv if argv is not None else sys.argv[1:])
    print(text)
    atomic_write_json(args.out, report)
    print(f"written: {args.out}")
    print(json.dumps({"total_mb": report.get("total_mb"), **({"measured_total_mb": report["measured"]["total_mb"]}
                                                              if "measured" in report else {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
