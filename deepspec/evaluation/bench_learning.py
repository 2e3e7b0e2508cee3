"""The learning benchmark (`deepspec bench learning`): every drafter kind trained at an equal budget on one cache,
curves of agreement and simulated/decoded tau against floors (deepspec.evaluation.learning); prints one JSON
object and writes it, with the PNG curves, under --out.

    deepspec bench learning --cache outputs/cache/smollm2-135m --out outputs/bench_learning
"""

from __future__ import annotations

import argparse
import json

from deepspec.evaluation.learning import LearningSettings, run_learning_benchmark
from deepspec.utils.errors import command_line


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    defaults = LearningSettings(cache_dir="", out_dir="")
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, help="a finished feature cache (deepspec cache) with a validation split")
    parser.add_argument("--out", default="outputs/bench_learning", help="folder for learning.json, learning.png and the runs")
    parser.add_argument("--kinds", "--runs", nargs="+", default=defaults.kinds,
                        help="runs: KIND (its default CPU preset) or KIND:PRESET, e.g. dspark dspark:cpu-v1 dspark:paper "
                             "(presets: deepspec/training/presets.py)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--eval-every", type=int, default=defaults.eval_every)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="sequences per optimizer step")
    parser.add_argument("--anchors", type=int, default=defaults.anchors_per_seq, help="anchors per sequence")
    parser.add_argument("--decode-prompts", type=int, default=defaults.decode_prompts)
    parser.add_argument("--decode-max-new-tokens", type=int, default=defaults.decode_max_new_tokens)
    parser.add_argument("--temperatures", type=float, nargs="+", default=defaults.temperatures)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("overrides", nargs="*", help="extra `deepspec train` overrides for every kind, e.g. optim.lr=3e-3")
    return parser


@command_line("deepspec bench learning")
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    settings = LearningSettings(cache_dir=args.cache, out_dir=args.out, kinds=list(args.kinds), steps=args.steps,
                                eval_every=args.eval_every, batch=args.batch, anchors_per_seq=args.anchors,
                                decode_prompts=args.decode_prompts, decode_max_new_tokens=args.decode_max_new_tokens,
                                temperatures=list(args.temperatures), seed=args.seed, overrides=list(args.overrides))
    result = run_learning_benchmark(settings)
    print(json.dumps({"floors": result["floors"],
                      "drafters": {k: v["curve"][-1] if v["curve"] else None for k, v in result["drafters"].items()},
                      "out": args.out}))


if __name__ == "__main__":
    main()
