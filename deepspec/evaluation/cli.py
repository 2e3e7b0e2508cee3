"""Evaluate drafters' acceptance length τ on benchmarks (paper table 1, fig. 2, fig. 5).

    deepspec evaluate --target smollm2-135m --drafter outputs/dspark [name=outputs/dflash ...] \
        --benchmarks humaneval /path/to/gsm8k.jsonl --num-prompts 20 --max-new-tokens 256 --out outputs/eval

Writes table.md (also printed), results.json, results.csv, positions.png and threshold_sweep_<name>.png
into --out. Defaults follow the paper's protocol (T = 1, chain drafting, the drafter's block size).
`--format text` evaluates a drafter of a base model (trained in the text format): each benchmark prompt's first
turn is a text prefix the target continues, with no chat template (deepspec.data.rendering).
(eval/evaluate.py is the same command.)
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from deepspec.data.rendering import COMMAND_LINE_OPTIONS, FORMATS, command_line_rendering
from deepspec.targets.config import CHAT_TEMPLATE_KWARGS_HELP
from deepspec.utils.errors import command_line
from deepspec.utils.io import check_output_folder


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="embedded name, local folder, .gguf or hub id, or a "
                   "conf/target/*.yaml name (its chat_template_kwargs render the prompts)")
    p.add_argument("--chat-template-kwargs",
                   help=CHAT_TEMPLATE_KWARGS_HELP + "; must equal the drafters' training data's")
    p.add_argument("--format", choices=FORMATS, default="chat",
                   help="chat: prompts rendered with the chat template; text: each prompt's first turn is a text "
                        "prefix (a base model); must be the drafters' training data's")
    p.add_argument("--chat-template", help="the chat template (its text, or a file holding it) for a tokenizer "
                   "without one; default: the target config's target.chat_template, else the tokenizer's own")
    p.add_argument("--drafter", nargs="+", required=True, metavar="[NAME=]PATH",
                   help="saved drafter folders (load_drafter), or KIND:MODEL to wrap a pretrained model (e.g. "
                        "standalone:<causal LM sharing the target's tokenizer>); named by folder unless NAME= is given")
    p.add_argument("--benchmarks", nargs="+", required=True, metavar="SPEC",
                   help="JSONL paths ({'turns': [...]}), 'humaneval', or hf:<name>[:<split>]; optional LABEL=SPEC")
    p.add_argument("--domain", nargs="*", default=[], metavar="BENCH=DOMAIN",
                   help="override a benchmark's domain (math|code|chat|other)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N prompts per benchmark (default all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=None,
                   help="drafts per round (block drafters: <= their drafts per block, block_size or block_size - 1 "
                        "by block_convention; chain drafters: chain length)")
    p.add_argument("--verify-length", type=int, default=None, help="verify at most this many drafts per round")
    p.add_argument("--threshold", type=float, default=None,
                   help="live static confidence threshold for drafters with a confidence head (disables the sweep)")
    p.add_argument("--with-prompt-lookup", action="store_true",
                   help="each round prompt lookup's drafts or the drafter's, whichever is expected to keep more (a "
                        "calibrated drafter: `deepspec calibrate` stores prompt lookup's acceptance with it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default=None, help="float32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--system-prompt", default=None)
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="load drafters trained for a different target fingerprint")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="outputs/eval")
    return p


@command_line("deepspec evaluate")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_output_folder(args.out, "--out")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from deepspec.decoding.sampling import SamplingParams
    from deepspec.evaluation.plots import write_plots
    from deepspec.evaluation.prompt_sets import load_benchmark, parse_domain_overrides
    from deepspec.evaluation.runner import EvalSettings, drafter_specs, evaluate, open_drafter
    from deepspec.evaluation.tables import render_markdown, write_tables
    from deepspec.targets.config import chat_template_kwargs_option, target_settings
    from deepspec.targets.load import load_target, load_tokenizer

    target_cfg = target_settings(args.target)
    rendering = command_line_rendering(args.format, args.chat_template, target_cfg.chat_template,
                                       chat_template_kwargs_option(args.chat_template_kwargs, target_cfg),
                                       args.system_prompt)
    settings = EvalSettings(max_new_tokens=args.max_new_tokens,
                            sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
                            seed=args.seed, num_draft_tokens=args.block_size, verify_length=args.verify_length,
                            threshold=args.threshold, system_prompt=rendering.system_prompt,
                            chat_template_kwargs=dict(rendering.chat_template_kwargs), data_format=rendering.format,
                            chat_template=rendering.chat_template, with_prompt_lookup=args.with_prompt_lookup)
    specs = drafter_specs(args.drafter)
    domains = parse_domain_overrides(args.domain)
    benchmarks = [load_benchmark(spec, args.num_prompts, domains) for spec in args.benchmarks]
    # A target without a chat template fails here, before its weights load.
    rendering.check_tokenizer(load_tokenizer(target_cfg.name, target_cfg.revision), COMMAND_LINE_OPTIONS)
    target = load_target(target_cfg.name, dtype=args.dtype, device=args.device, revision=target_cfg.revision)
    drafters = {name: (open_drafter(path, target, strict_target=not args.allow_target_mismatch), path)
                for name, path in specs.items()}
    device = next(target.model.parameters()).device
    for drafter, _ in drafters.values():
        drafter.to(device).eval()
    with torch.inference_mode():
        results = evaluate(target, drafters, benchmarks, settings, progress=not args.no_progress)
    out = Path(args.out)
    paths = write_tables(results, out)
    plots = write_plots(results, out)
    print(render_markdown(results))
    print(f"wrote {', '.join(str(p) for p in list(paths.values()) + plots)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
