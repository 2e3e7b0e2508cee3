"""Standalone vs DSpark on the same cache and prompts: train each, then decode side by side; print one JSON object.

    deepspec bench standalone --run NAME:KIND:CACHE_DIR[:OVERRIDE,...] ... --out-dir outputs/bench_standalone

Per `--run` (e.g. `dspark:dspark:outputs/cache_full:drafter.num_draft_layers=2`,
`standalone-topk:standalone:outputs/cache_topk:drafter.init_from_target=true`): `train.py` in a subprocess with
the shared `--train-overrides` (same steps, batch, optimiser for every run) plus its own, timed by the CPU seconds
of that subprocess (`getrusage(RUSAGE_CHILDREN)`, user + system; OMP_NUM_THREADS=1) and described by the
cache it read (content, bytes/token: the payload formula and the bytes on disk per token) and the tokens the run
read (`tokens_seen`), with its last validation metrics (simulated tau). A run whose final checkpoint exists is not
retrained (its recorded cost is kept in `<out-dir>/<name>/bench_train.json`).

Then `bench_speed` (deepspec.benchmarks.speed, same process, `--threads`) on every `--benchmark` with all the
trained drafters: decoded tau at each temperature, speedup vs DeepSpec's autoregressive loop and vs
transformers' prompt lookup. "chat" is the cache's own validation split (held out from training): the first
user turn of each validation conversation, written to `<out-dir>/chat_heldout.jsonl`.

Output: `<out-dir>/bench_standalone.json` (everything) and a Markdown table on stdout after the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from deepspec.utils.errors import command_line
from deepspec.utils.io import atomic_write_json, atomic_write_text, read_json

REPO = Path(__file__).resolve().parents[2]
BENCH_TRAIN_FILE = "bench_train.json"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", nargs="+", required=True, metavar="NAME:KIND:CACHE[:OVERRIDE,...]")
    p.add_argument("--train-overrides", nargs="*", default=[], help="train.py overrides shared by every run")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--benchmark", nargs="+", default=["chat", "humaneval"],
                   help="'chat' (the first cache's validation prompts), 'humaneval', or a JSONL path")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=448, help="chat prompts longer than this are skipped")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out-dir", default="outputs/bench_standalone")
    return p


def parse_run(item: str) -> dict:
    parts = item.split(":", 3)
    if len(parts) < 3 or not all(parts[:3]):
        raise ValueError(f"--run {item!r}: expected NAME:KIND:CACHE_DIR[:OVERRIDE,...]")
    return {"name": parts[0], "kind": parts[1], "cache": parts[2],
            "overrides": [o for o in parts[3].split(",") if o] if len(parts) == 4 else []}


def cache_description(cache_dir: str | Path) -> dict:
    from deepspec.cache.format import read_meta

    meta = read_meta(cache_dir)
    tokens = meta.counts["tokens"]
    return {"cache": str(cache_dir), "content": meta.content, "layer_ids": meta.layer_ids, "top_k": meta.top_k,
            "storage_dtype": meta.storage_dtype, "bytes_per_token": meta.bytes_per_token,
            "bytes_on_disk_per_token": round(meta.counts["bytes_on_disk"] / tokens, 1), "tokens": tokens,
            "train_tokens": meta.counts["per_split"]["train"]["tokens"]}


def train_run(run: dict, shared: list[str], out_dir: Path, target: str) -> dict:
    """Train one run in a subprocess (or reuse a finished one) and return its cost record."""
    from deepspec.training.latest import latest_drafter_dir

    run_dir = out_dir / run["name"]
    record_file = run_dir / BENCH_TRAIN_FILE
    if record_file.is_file():
        return read_json(record_file)
    overrides = [f"target={target}", f"drafter={run['kind']}", f"data.cache_dir={run['cache']}",
                 f"trainer.out_dir={run_dir}", f"hydra.run.dir={run_dir}", "trainer.progress_bar=false",
                 *shared, *run["overrides"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (run_dir / "train.log").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"training run {run['name']} failed (see {run_dir / 'train.log'}):\n{proc.stderr[-3000:]}")
    from deepspec.training.log import read_metrics

    train = read_metrics(run_dir, "train")
    validation = read_metrics(run_dir, "validation")
    record = {"name": run["name"], "kind": run["kind"], "overrides": overrides,
              "cpu_seconds": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
              "wall_seconds": round(wall, 1), "steps": train[-1]["step"], "tokens_seen": train[-1]["tokens_seen"],
              "final_train_loss": train[-1]["loss"],
              "validation": {k: validation[-1][k] for k in ("tau_sim", "tau_greedy_sim", "top1_agreement")
                             if validation and k in validation[-1]},
              "cache": cache_description(run["cache"]), "drafter_dir": str(latest_drafter_dir(run_dir))}
    atomic_write_json(record_file, record)
    return record


def write_heldout_chat(cache_dir: str | Path, tokenizer, path: Path, max_prompt_tokens: int) -> Path:
    """The first user turn of each validation conversation of the cache: its recorded data source re-split with the
    recorded seed and fractions (the split the drafters never trained on); prompts over `max_prompt_tokens`
    tokens are left out (the cache truncated such conversations before their answers)."""
    from deepspec.cache.format import read_meta
    from deepspec.cache.pipeline import load_and_split
    from deepspec.data.chat import prompt_ids

    meta = read_meta(cache_dir)
    splits, _ = load_and_split(meta.source)
    lines = []
    for conversation in splits["validation"]:
        first = [m for m in conversation.messages if m["role"] == "user"][:1]
        rendered = prompt_ids(tokenizer, first, chat_template_kwargs=meta.chat_template_kwargs) if first else None
        if rendered is not None and len(rendered) <= max_prompt_tokens:
            lines.append(json.dumps({"turns": [first[0]["content"]]}))
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def markdown(report: dict) -> str:
    rows = ["| drafter | cache (content, B/token) | train steps / tokens / CPU-s | bench | T | tau | "
            "speedup vs AR | vs prompt lookup |", "|---|---|---|---|---|---|---|---|"]
    for name, run in report["runs"].items():
        cache = run["cache"]
        layers = f" L{cache['layer_ids']}" if cache["layer_ids"] else ""
        top_k = f" k={cache['top_k']}" if cache["top_k"] else ""
        for bench, speed in report["speed"].items():
            for key, entry in speed["drafters"].get(name, {}).items():
                rows.append(f"| {name} | {cache['content']}{layers}{top_k}, {cache['bytes_per_token']:,} | "
                            f"{run['steps']} / {run['tokens_seen']:,} / {run['cpu_seconds']:.0f} | {bench} | "
                            f"{key[2:]} | {entry['tau']:.3f} | {entry['speedup_vs_ar']:.3f} | "
                            f"{(entry['speedup_vs_prompt_lookup'] or float('nan')):.3f} |")
    return "\n".join(rows)


@command_line("deepspec bench standalone")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from deepspec.benchmarks import speed as bench_speed
    from deepspec.targets.load import load_tokenizer

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = [parse_run(item) for item in args.run]
    records = {run["name"]: train_run(run, args.train_overrides, out_dir, args.target) for run in runs}
    speed = {}
    for bench in args.benchmark:
        spec = bench
        if bench == "chat":
            spec = str(write_heldout_chat(runs[0]["cache"], load_tokenizer(args.target), out_dir / "chat_heldout.jsonl",
                                          args.max_prompt_tokens))
        speed_file = out_dir / f"speed_{bench if bench in ('chat', 'humaneval') else Path(bench).stem}.json"
        bench_speed.main(["--target", args.target, "--benchmark", spec, "--num-prompts", str(args.num_prompts),
                          "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
                          "--temperatures", *map(str, args.temperatures), "--out", str(speed_file),
                          "--drafter", *[f"{name}={record['drafter_dir']}" for name, record in records.items()]])
        speed[bench] = read_json(speed_file)
    report = {"settings": vars(args), "runs": records, "speed": speed}
    atomic_write_json(out_dir / "bench_standalone.json", report)
    print(json.dumps(report, indent=2))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
