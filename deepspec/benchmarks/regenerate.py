"""Regeneration throughput: vLLM's server (DeepSpec's `--backend vllm`) against the local transformers backend.

    deepspec bench regenerate --prompts prompts.jsonl --num-prompts 64 --max-new-tokens 128 --threads 1

Both answer the same first user turns greedily, in float32, with the same thread count, through
`regenerate_conversations` (the code `deepspec regenerate` runs). Loading is not timed (the target's weights
here; the server's start and warm-up there): tokens/s is generated tokens over the wall seconds of the
regeneration, and tokens per CPU-second counts this process and, for vLLM, every process of its server (read from
/proc before and after). The answers are compared turn by turn: both decode greedily in float32, but with
different kernels, so a few answers part after some tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from deepspec.data.openai_backend import OpenAIChatBackend
from deepspec.data.regenerate import LocalBackend, RegenerationSettings, regenerate_conversations
from deepspec.data.rendering import command_line_rendering
from deepspec.data.sources import load_prompts, require_conversations
from deepspec.targets.engine import ServerSettings, VllmServer, target_folder
from deepspec.targets.load import load_target
from deepspec.utils.errors import command_line
from deepspec.utils.io import emit_report
from deepspec.utils.machine import cpu_model


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default="sharegpt", help="sharegpt | path.jsonl | hf:name[:split]")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default="smollm2-135m", help="an embedded target name or a local model folder")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of both backends")
    p.add_argument("--batch-size", type=int, default=16, help="local backend: conversations per generate call")
    p.add_argument("--concurrency", type=int, default=64, help="vLLM: requests in flight (and its max-num-seqs)")
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--workdir", type=Path, default=None, help="keep the answers and the server's log here")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_regenerate.json"))
    return p


def timed_regeneration(conversations, backend, out: Path, max_new_tokens: int, batch_size: int,
                       extra_cpu=lambda: 0.0) -> dict:
    """Regenerate the first turns; wall and CPU seconds (`extra_cpu`: another process's CPU-seconds so far)."""
    wall, cpu, extra = time.perf_counter(), time.process_time(), extra_cpu()
    settings = RegenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size, max_turns=1,
                                    show_progress=False)
    report = regenerate_conversations(conversations, backend, out, settings)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu + extra_cpu() - extra
    tokens = report.num_generated_tokens
    return {"tokens": tokens, "turns": report.num_turns_generated, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "tokens_per_s": round(tokens / wall, 2), "tokens_per_cpu_s": round(tokens / cpu, 2),
            "finish_reasons": report.finish_reasons}


def answers(path: Path) -> dict[str, list[str]]:
    records = (json.loads(line) for line in path.read_text().splitlines())
    return {r["id"]: [m["content"] for m in r["conversations"] if m["role"] == "assistant"] for r in records}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    conversations, report = load_prompts(args.prompts, limit=args.num_prompts)
    require_conversations(conversations, report, "--prompts")
    rendering = command_line_rendering("chat", None, None, {})
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_regenerate_"))
    workdir.mkdir(parents=True, exist_ok=True)
    target = load_target(args.target, dtype="float32", device="cpu")
    local = LocalBackend(target.model, target.tokenizer, rendering=rendering)
    results = {"local": timed_regeneration(conversations, local, workdir / "local.jsonl", args.max_new_tokens,
                                           args.batch_size)}
    folder = target_folder(target.path, target.name)
    del local, target
    settings = ServerSettings(threads=args.threads, kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.concurrency)
    with VllmServer(folder, "target", workdir / "vllm_server.log", settings, python=args.vllm_python) as server:
        backend = OpenAIChatBackend(server.base_url, server.name, concurrency=args.concurrency, rendering=rendering)
        # One batch: the server schedules the requests itself.
        results["vllm"] = timed_regeneration(conversations, backend, workdir / "vllm.jsonl", args.max_new_tokens,
                                             len(conversations), extra_cpu=server.running_cpu_seconds)
    ours, theirs = answers(workdir / "local.jsonl"), answers(workdir / "vllm.jsonl")
    pairs = [(a, b) for cid in ours for a, b in zip(ours[cid], theirs.get(cid, []))]
    local_r, vllm_r = results["local"], results["vllm"]
    return {"benchmark": "regenerate", "cpu": cpu_model(), "threads": args.threads, "target": args.target,
            "prompts": args.prompts, "num_prompts": len(conversations), "max_new_tokens": args.max_new_tokens,
            **results,
            "speedup_tokens_per_s": round(vllm_r["tokens_per_s"] / local_r["tokens_per_s"], 2),
            "speedup_tokens_per_cpu_s": round(vllm_r["tokens_per_cpu_s"] / local_r["tokens_per_cpu_s"], 2),
            "identical_answers": f"{sum(a == b for a, b in pairs)}/{len(pairs)}", "workdir": str(workdir)}


@command_line("deepspec bench regenerate")
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    emit_report(run(args), args.out)
    return 0
