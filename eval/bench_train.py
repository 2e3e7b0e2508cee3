"""Benchmark drafter training throughput with 1 and 2 CPU processes; prints one JSON object.

  python eval/bench_train.py --out outputs/bench_train.json
"""

import argparse
import json
from pathlib import Path

from deepspec.training.bench import bench_train, build_bench_cache, write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path("outputs/cache/smollm2-135m-bench"))
    parser.add_argument("--num-samples", type=int, default=48, help="ShareGPT conversations cached if --cache is empty")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_train.json"))
    parser.add_argument("overrides", nargs="*", default=["drafter.num_draft_layers=2", "data.max_anchors_per_seq=32"],
                        help="extra train.py overrides")
    args = parser.parse_args()
    cache_cmd = build_bench_cache(args.cache.resolve(), args.num_samples, args.max_length)
    result = bench_train(args.cache.resolve(), args.processes, args.steps, args.global_batch, args.micro_batch,
                         args.overrides)
    result["cache_command"] = " ".join(cache_cmd)
    write_result(result, args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
