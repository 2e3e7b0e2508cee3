"""The `deepspec` console script: one subcommand per pipeline stage and per benchmark (also `python -m deepspec.cli`).

    deepspec regenerate --prompts sharegpt --limit 200 --out data.jsonl      (deepspec.data.cli)
    deepspec cache data.prompts=data.jsonl cache.out_dir=cache                (Hydra: deepspec.cache.cli)
    deepspec train drafter=dspark data.cache_dir=cache                        (Hydra: deepspec.training.cli)
    deepspec plan experiment=paper target=qwen3-8b --world-size 8 [--measure] (deepspec.planning.cli)
    deepspec calibrate --drafter DIR --cache DIR                              (deepspec.calibration.cli)
    deepspec evaluate --drafter DIR --benchmarks humaneval                    (deepspec.evaluation.cli)
    deepspec decontaminate --prompts sharegpt --benchmarks humaneval --out P  (deepspec.evaluation.contamination)
    deepspec export --checkpoint DIR --format hf|sglang|vllm|nextn|causal_lm --out DIR [--overwrite] [--target NAME]
                    [--push-to-hub REPO_ID] [--tau-table results.json]
    deepspec export --verify DIR              (an export's files against its checksums.json)
    deepspec bench NAME [options]             (NAME: deepspec.benchmarks.BENCHMARKS; `deepspec bench` lists them)
    deepspec pipeline [--quick] [quickstart.eval_prompts=12 ...]              (deepspec.pipeline)

Every subcommand but `export` forwards its arguments verbatim to the stage's own `main(argv)` (its parser
lives with the stage, so `python data_tools/...`, `python eval/evaluate.py`, `python train.py` and this
command are the same program); Hydra subcommands read them from sys.argv. `export` is defined here: add one
like it with `add_<name>_command(subparsers)` (arguments + `set_defaults(run=run_<name>)`) appended to
`COMMANDS`.

A refusal (a missing or refused file, a bad setting) prints one line `deepspec <command>: error: ...` and exits 1,
a usage error exits 2, a bug prints its traceback; `--debug` anywhere (or DEEPSPEC_DEBUG=1) shows every
traceback (deepspec.utils.errors).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import shlex
import sys
from pathlib import Path

from deepspec.benchmarks import BENCHMARKS
from deepspec.utils.errors import reported_errors, take_debug_flag

# subcommand -> (module with `main(argv)` or, for Hydra jobs, `main()` reading sys.argv; help line)
FORWARDED = {
    "regenerate": ("deepspec.data.cli", "regenerate assistant answers with the target"),
    "cache": ("deepspec.cache.cli", "cache target features (Hydra overrides, conf/cache_hiddens.yaml)"),
    "train": ("deepspec.training.cli", "train a drafter (Hydra overrides, conf/train.yaml)"),
    "plan": ("deepspec.planning.cli", "memory, tokens and FLOPs of a training configuration (--measure: run it here)"),
    "calibrate": ("deepspec.calibration.cli", "fit Sequential Temperature Scaling for a confidence head"),
    "evaluate": ("deepspec.evaluation.cli", "acceptance-length tables over benchmarks"),
    "decontaminate": ("deepspec.evaluation.contamination", "drop training prompts that overlap benchmark prompts"),
    "pipeline": ("deepspec.pipeline", "the quickstart end to end: regenerate -> ... -> export"),
}
HYDRA_COMMANDS = ("cache", "train")


def add_export_command(subparsers) -> None:
    from deepspec.export import FORMAT_MODULES

    parser = subparsers.add_parser(
        "export", help="export a trained drafter to a serving layout",
        description="Export a trained drafter (a save_pretrained checkpoint folder), or check an "
                    "export (--verify).")
    # Required unless --verify (run_export checks: argparse has no "one of these two forms").
    parser.add_argument("--checkpoint", type=Path,
                        help="drafter checkpoint folder (config.json + model.safetensors); "
                             "required")
    parser.add_argument("--format", choices=sorted(FORMAT_MODULES), help="output layout; required")
    parser.add_argument("--out", type=Path,
                        help="output folder (new or empty unless --overwrite); required")
    parser.add_argument("--verify", type=Path, metavar="DIR",
                        help="instead of exporting: check an exported folder's files against "
                             "its checksums.json (what DeepSpec's readers check), e.g. after "
                             "copying it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out whole (the export is written beside it, then swapped in)")
    parser.add_argument("--target", default=None,
                        help="target model (embedded name, local folder or hub id); needed for tokenizer files (hf), "
                             "the stored embedding (vllm) and shared head (nextn)")
    parser.add_argument("--verifier", default=None, metavar="HUB_ID_OR_FOLDER",
                        help="vllm: speculators_config.verifier.name_or_path (default: the target's hub id or local "
                             "folder; required for targets that exist only in memory)")
    parser.add_argument("--push-to-hub", dest="push_to_hub", default=None, metavar="REPO_ID",
                        help="upload the exported folder to this Hugging Face model repo")
    parser.add_argument("--tau-table", dest="tau_table", default=None, type=Path,
                        help="evaluation results JSON whose τ table goes into the model card (hf)")
    parser.set_defaults(run=run_export, export_parser=parser)


def run_export(args) -> int:
    from deepspec.export import export_drafter, push_to_hub, verify_export

    exporting = {"--checkpoint": args.checkpoint, "--format": args.format, "--out": args.out}
    if args.verify is not None:
        given = [flag for flag, value in exporting.items() if value is not None]
        if given:
            args.export_parser.error(f"--verify checks an export and takes no {', '.join(given)}")
        print(verify_export(args.verify))
        return 0
    missing = [flag for flag, value in exporting.items() if value is None]
    if missing:
        args.export_parser.error(f"the following arguments are required: {', '.join(missing)} "
                                 "(or --verify DIR)")
    target = None
    if args.target:
        from deepspec.targets.load import load_target

        target = load_target(args.target, device="cpu")
    opts = {} if args.verifier is None else {"verifier": args.verifier}  # other formats refuse the option
    out = export_drafter(args.checkpoint, args.out, args.format, target=target, tau_table=args.tau_table,
                         commands=[args.command_line] if args.format == "hf" else None, overwrite=args.overwrite,
                         **opts)
    print(f"exported {args.format} layout to {out}")
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, api=args.hub_api)
        print(f"pushed {out} to {args.push_to_hub}")
    return 0


def add_forwarded_commands(subparsers) -> None:
    for name, (module, help_line) in FORWARDED.items():
        parser = subparsers.add_parser(name, add_help=False, help=help_line)
        parser.set_defaults(run=run_forwarded, module=module, forwards_arguments=True)
    bench = subparsers.add_parser("bench", add_help=False,
                                  help="benchmarks (each prints one JSON object and writes it to --out)")
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS))
    bench.set_defaults(run=run_benchmark, forwards_arguments=True)


def run_forwarded(args) -> int:
    main = importlib.import_module(args.module).main
    if args.command in HYDRA_COMMANDS:  # Hydra parses sys.argv itself
        sys.argv = [f"deepspec {args.command}", *args.forwarded]
        return main() or 0
    return main(args.forwarded) or 0


def run_benchmark(args) -> int:
    return importlib.import_module(BENCHMARKS[args.benchmark]).main(args.forwarded) or 0


COMMANDS = (add_export_command, add_forwarded_commands)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspec",
                                     description="DeepSpec: train, calibrate, evaluate and export drafters")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of a refusal too (anywhere on the line; or DEEPSPEC_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_command in COMMANDS:
        add_command(subparsers)
    return parser


def main(argv: list[str] | None = None, hub_api=None) -> int:
    """Console entry point; `hub_api` replaces `huggingface_hub.HfApi()` (tests pass a recorder). A refusal is
    reported as one line when `argv` is the process's (None); a Python caller passing `argv` gets the exception."""
    if argv is None:
        with reported_errors(f"deepspec {_command_name(sys.argv[1:])}"):
            return _main(sys.argv[1:], hub_api)
    return _main(argv, hub_api)


def _command_name(argv: list[str]) -> str:
    """`regenerate`, `bench speed`, ...: the subcommand words of a command line, for its error line."""
    words = [a for a in argv if not a.startswith("-")][:2]
    if not words:
        return "(no command)"
    return " ".join(words) if words[0] == "bench" else words[0]


def _main(argv: list[str], hub_api) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = take_debug_flag(argv)  # before or after the subcommand
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
