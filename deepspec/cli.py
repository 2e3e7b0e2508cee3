"""The `deepspec` console script: one subcommand per pipeline action, each one thin function pair.

    deepspec export --checkpoint DIR --format hf|sglang|vllm|nextn --out DIR [--overwrite] [--target NAME]
                    [--push-to-hub REPO_ID] [--tau-table results.json]

A subcommand is `add_<name>_command(subparsers)` (arguments + `set_defaults(run=run_<name>)`) and
`run_<name>(args) -> int` (one library call). Add a new one by appending its `add_...` to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path


def add_export_command(subparsers) -> None:
    from deepspec.export import FORMAT_MODULES

    parser = subparsers.add_parser("export", help="export a trained drafter to a serving layout",
                                   description="Export a trained drafter (a save_pretrained checkpoint folder).")
    parser.add_argument("--checkpoint", required=True, type=Path, help="drafter checkpoint folder (config.json + model.safetensors)")
    parser.add_argument("--format", required=True, choices=sorted(FORMAT_MODULES), help="output layout")
    parser.add_argument("--out", required=True, type=Path, help="output folder (new or empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out whole (the export is written beside it, then swapped in)")
    parser.add_argument("--target", default=None,
                        help="target model (embedded name, local folder or hub id); needed for tokenizer files (hf), "
                             "the stored embedding (vllm) and shared head (nextn)")
    parser.add_argument("--push-to-hub", dest="push_to_hub", default=None, metavar="REPO_ID",
                        help="upload the exported folder to this Hugging Face model repo")
    parser.add_argument("--tau-table", dest="tau_table", default=None, type=Path,
                        help="evaluation results JSON whose τ table goes into the model card (hf)")
    parser.set_defaults(run=run_export)


def run_export(args) -> int:
    from deepspec.export import export_drafter, push_to_hub

    target = None
    if args.target:
        from deepspec.targets.load import load_target

        target = load_target(args.target, device="cpu")
    out = export_drafter(args.checkpoint, args.out, args.format, target=target, tau_table=args.tau_table,
                         commands=[args.command_line] if args.format == "hf" else None, overwrite=args.overwrite)
    print(f"exported {args.format} layout to {out}")
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, api=args.hub_api)
        print(f"pushed {out} to {args.push_to_hub}")
    return 0


def add_calibrate_command(subparsers) -> None:
    # Arguments are owned by deepspec.calibration.cli (also usable on its own); forwarded verbatim.
    parser = subparsers.add_parser("calibrate", add_help=False,
                                   help="fit Sequential Temperature Scaling for a DSpark confidence head")
    parser.set_defaults(run=run_calibrate, forwards_arguments=True)


def run_calibrate(args) -> int:
    from deepspec.calibration.cli import main as calibrate_main

    return calibrate_main(args.forwarded)


COMMANDS = (add_export_command, add_calibrate_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspec", description="DeepSpec: train, calibrate, evaluate and export drafters")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None, hub_api=None) -> int:
    """Console entry point; `hub_api` replaces `huggingface_hub.HfApi()` (tests pass a recorder)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "forwards_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.forwarded = extra
    args.command_line = "deepspec " + shlex.join(argv)
    args.hub_api = hub_api
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
