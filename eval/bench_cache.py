"""Benchmark the feature cache on the embedded target; prints one JSON object (also written to --out).

  python eval/bench_cache.py --n 32 --out outputs/bench_cache.json
"""

import argparse
import json
from pathlib import Path

from deepspec.cache.bench import run_cache_benchmark

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--n", type=int, default=32, help="ShareGPT conversations (original answers)")
parser.add_argument("--target", default="smollm2-135m")
parser.add_argument("--max-length", type=int, default=512)
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--shard-size-mb", type=float, default=32)
parser.add_argument("--repeats", type=int, default=2, help="alternating cache/prefill passes (best kept)")
parser.add_argument("--train-tokens-per-s", type=float,
                    help="training throughput (eval/bench_train.py, 1 process): checksum cost as a fraction of an epoch")
parser.add_argument("--work-dir", default="outputs/bench_cache")
parser.add_argument("--out", default="outputs/bench_cache.json")
args = parser.parse_args()

result = run_cache_benchmark(args.n, args.work_dir, target_name=args.target, max_length=args.max_length,
                             batch_size=args.batch_size, shard_size_mb=args.shard_size_mb, repeats=args.repeats,
                             train_tokens_per_s=args.train_tokens_per_s)
text = json.dumps(result, indent=2)
print(text)
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(text + "\n")
