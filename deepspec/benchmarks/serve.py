"""A serving engine decodes with DeepSpec's exports: vLLM (its CPU build here) against DeepSpec's own loop.

    deepspec bench serve --drafter eagle3=runs/eagle3/checkpoints/final/drafter [NAME=PATH ...] \
        --target smollm2-135m --benchmark humaneval --num-prompts 8 --max-new-tokens 128

vLLM pins its own torch and transformers, so it runs in its own environment (`scripts/bootstrap_vllm.sh` makes
`.venv-vllm`; `--vllm-python` or `DEEPSPEC_VLLM_PYTHON` names another), one subprocess per engine run
(`vllm_worker.py`, which imports only vLLM). Every run decodes the same prompts, rendered to token ids by DeepSpec
as `deepspec evaluate` renders them, greedily, one prompt at a time (batch 1), in float32:
  * `vllm`: the target alone, the baseline;
  * `vllm ngram`: vLLM's prompt lookup (`"method": "ngram"`), the drafter-free baseline users would pick;
  * per drafter, each layout of the drafter that vLLM reads (`vllm` for EAGLE-3 / DFlash / DSpark / MTP,
    `causal_lm` for a standalone LM as `"method": "draft_model"`), exported by `deepspec export` into a temporary
    folder: vLLM's output must equal the baseline's token for token (lossless), and vLLM's own acceptance record
    (per request, every verification step: `per_request_spec_decode_metrics="detailed"`) is set beside DeepSpec's
    loop (`speculative_generate`, as `deepspec evaluate` runs it) on the drafter re-read from the same exported
    folder, with the same drafts per step.
A drafter with no layout vLLM reads, or a layout the engine refuses, gets one line naming why: DeepSpec's own
export refusal, or the engine's own error message.

Acceptance: τ = tokens emitted per verification step (accepted drafts + the bonus token), `deepspec evaluate`'s
definition, and vLLM's "mean acceptance length" (1 + accepted drafts / steps, as vLLM reports it) beside. vLLM
verifies a full set of drafts even when `max_tokens` or EOS will cut the step, DeepSpec's loop only what may still be
emitted; so the engine's τ counts each step's tokens up to the output's end (`emitted_per_step`), and identical
drafts then give identical step records, step for step.
Speed: generated tokens / wall seconds of each `generate` call (prefill included, load excluded), and the
ratios against `vllm` and `vllm ngram`; CPU-seconds beside. On a CPU the target is small and a verification
step costs several decode steps, so speed ratios say little about a GPU; the acceptance figures carry over.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from deepspec.targets.engine import DEFAULT_VLLM_VENV, VLLM_PYTHON_ENV, vllm_python
from deepspec.targets.engine import engine_env as served_engine_env
from deepspec.targets.engine import target_folder as engine_target_folder
from deepspec.utils.errors import command_line
from deepspec.utils.machine import cpu_model

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
# DeepSpec layout -> vLLM's `speculative_config.method` for it (the vllm layout: per drafter kind).
VLLM_LAYOUTS = ("vllm", "causal_lm")
VLLM_METHOD_OF_KIND = {"eagle3": "eagle3", "dflash": "dflash", "dspark": "dspark", "mtp": "mtp"}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", nargs="*", default=[], metavar="[NAME=]PATH",
                   help="trained drafter checkpoints (their drafter/ folder, or a checkpoint step folder)")
    p.add_argument("--target", default="smollm2-135m", help="an embedded target name or a local model folder")
    p.add_argument("--benchmark", default="humaneval", help="JSONL path, 'humaneval' or hf:<name>[:<split>]")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per step for every drafter (default: each drafter's own; a block drafter's block "
                        "is sized by it in vLLM, so keep its own)")
    p.add_argument("--ngram-tokens", type=int, default=5, help="vLLM ngram: drafts per step")
    p.add_argument("--ngram-min", type=int, default=2, help="vLLM ngram: prompt_lookup_min")
    p.add_argument("--ngram-max", type=int, default=4, help="vLLM ngram: prompt_lookup_max")
    p.add_argument("--vllm-python", default=None,
                   help=f"python of vLLM's environment (default: ${VLLM_PYTHON_ENV}, else {DEFAULT_VLLM_VENV.name}/)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of every run (ours and vLLM's)")
    p.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="keep the exports and engine logs here")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_serve.json"))
    return p


# -- the engine ------------------------------------------------------------------------------------------------
def engine_env(python: Path, threads: int, kv_cache_gib: int) -> dict:
    """A one-shot worker's environment: the server's, with the engine core in-process (its CPU-seconds are the
    worker's)."""
    return dict(served_engine_env(python, threads, kv_cache_gib), VLLM_ENABLE_V1_MULTIPROCESSING="0")


@dataclass
class EngineRun:
    name: str
    speculative_config: dict | None
    drafter: str | None = None  # the DeepSpec drafter it serves
    layout: str | None = None


def run_engine(run: EngineRun, job: dict, python: Path, env: dict, workdir: Path) -> dict:
    """One `vllm_worker.py` subprocess; its result JSON, `ok: false` with the engine's message when it refused."""
    stem = workdir / run.name.replace(" ", "_").replace("/", "_")
    job_file, result_file, log_file = (stem.with_suffix(s) for s in (".job.json", ".result.json", ".log"))
    job_file.write_text(json.dumps(dict(job, speculative_config=run.speculative_config)))
    with open(log_file, "w") as log_out:
        proc = subprocess.run([str(python), "-I", str(WORKER), str(job_file), str(result_file)], env=env,
                              stdout=log_out, stderr=subprocess.STDOUT, cwd=workdir)
    if not result_file.is_file():
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        return {"ok": False, "error_type": "WorkerDied", "error": f"exit {proc.returncode}: {' | '.join(tail)}",
                "log": str(log_file)}
    return json.loads(result_file.read_text()) | {"log": str(log_file)}


def engine_refusal(result: dict) -> str:
    """The engine's own message, one line (pydantic wraps config errors over several and adds its input; a registry
    of functions prints their reprs)."""
    text = re.sub(r"'(\w+)': <function \w+ at 0x[0-9a-f]+>", r"\1", result.get("error", ""))
    lines = [line.split(" [type=")[0].strip() for line in text.splitlines() if line.strip()]
    picked = [line for line in lines if "error" in line.lower() or "not support" in line.lower()] or lines
    return f"{result.get('error_type', 'Error')}: {' '.join(picked[:2])}"[:400]


# -- our side --------------------------------------------------------------------------------------------------
def export_for_vllm(name: str, drafter, target, target_dir: str, workdir: Path) -> tuple[list[tuple], list[dict]]:
    """Every layout of `drafter` that vLLM reads, exported: ([(layout, folder, speculative method)], refusals)."""
    from deepspec.drafters.spec import spec_of
    from deepspec.export import export_drafter

    spec = spec_of(drafter)
    exported, refusals = [], []
    layouts = [layout for layout in VLLM_LAYOUTS if layout in spec.export_layouts]
    if not layouts:
        refusals.append({"drafter": name, "layout": None, "by": "deepspec",
                         "reason": f"{spec.kind} drafters have no layout vLLM reads "
                                   f"(their layouts: {', '.join(spec.export_layouts)})"})
    for layout in layouts:
        folder = workdir / f"{name}-{layout}"
        opts = {"verifier": target_dir} if layout == "vllm" else {}
        try:
            export_drafter(drafter, folder, layout, target=target, overwrite=True, **opts)
        except ValueError as err:
            refusals.append({"drafter": name, "layout": layout, "by": "deepspec export", "reason": str(err)})
            continue
        method = "draft_model" if layout == "causal_lm" else VLLM_METHOD_OF_KIND[spec.kind]
        exported.append((layout, folder, method))
    return exported, refusals


def our_rounds(drafter, target, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
               num_draft_tokens: int | None, seed: int) -> list[dict]:
    """DeepSpec's loop per prompt, greedy (as `deepspec evaluate` runs it): tokens and (drafted, accepted) per round."""
    import torch

    from deepspec.decoding.acceptance import Acceptance
    from deepspec.decoding.loop import speculative_generate
    from deepspec.decoding.sampling import SamplingParams
    from deepspec.decoding.verifier import TargetVerifier
    from deepspec.drafters.proposers import make_proposer

    verifier = TargetVerifier(target.model, drafter.config.target_layer_ids)
    proposer = make_proposer(drafter, target.model, num_draft_tokens=num_draft_tokens)
    acceptance = Acceptance()
    out = []
    for index, ids in enumerate(prompts):
        generator = torch.Generator().manual_seed(seed + index)
        result = speculative_generate(verifier, proposer, ids, max_new_tokens, SamplingParams(temperature=0.0),
                                      eos_token_ids=eos_ids, generator=generator, acceptance_backend=acceptance)
        out.append({"token_ids": result.token_ids, "accepted": [r.accepted for r in result.rounds],
                    "verified": [r.proposed for r in result.rounds], "decode_s": result.decode_s})
    return out


def drafts_per_step(drafter, target, num_draft_tokens: int | None) -> int:
    from deepspec.drafters.proposers import make_proposer

    return make_proposer(drafter, target.model, num_draft_tokens=num_draft_tokens).max_tokens


# -- comparison -----------------------------------------------------------------------------------------------
def mean_accepted_length(accepted_per_step: list[int]) -> float | None:
    """vLLM's mean acceptance length: 1 + accepted drafts per verification step."""
    return None if not accepted_per_step else 1.0 + sum(accepted_per_step) / len(accepted_per_step)


def emitted_per_step(accepted: list[int], num_tokens: int) -> list[int]:
    """Tokens each verification step added to an output of `num_tokens` (1 prefill token first): accepted drafts +
    the bonus, cut where the output ends. vLLM verifies a full set of drafts and truncates at `max_tokens` or EOS;
    DeepSpec's loop verifies only what may still be emitted, so its rounds' τ already is this count."""
    out, emitted = [], 1
    for n in accepted:
        step = min(n + 1, num_tokens - emitted)
        if step <= 0:
            break
        out.append(step)
        emitted += step
    return out


def acceptance_comparison(engine: dict, ours: list[dict]) -> dict:
    """vLLM's per-request step records against DeepSpec's rounds on the same prompts."""
    accepted = [p["spec"]["per_step_accepted"] if p.get("spec") else [] for p in engine["prompts"]]
    theirs = [emitted_per_step(a, len(p["token_ids"])) for a, p in zip(accepted, engine["prompts"])]
    mine = [[n + 1 for n in p["accepted"]] for p in ours]
    flat = lambda rows: [n for row in rows for n in row]  # noqa: E731
    engine_tau, ours_tau = (sum(flat(x)) / max(len(flat(x)), 1) for x in (theirs, mine))
    return {
        "engine_mean_accepted_length": mean_accepted_length(flat(accepted)),  # as vLLM reports it
        "engine_tau": engine_tau, "deepspec_tau": ours_tau,
        "relative_difference": abs(engine_tau - ours_tau) / ours_tau if ours_tau else None,
        "steps_compared": sum(min(len(t), len(m)) for t, m in zip(theirs, mine)),
        "steps_equal": sum(a == b for t, m in zip(theirs, mine) for a, b in zip(t, m)),
        "engine_steps": len(flat(theirs)), "deepspec_rounds": len(flat(mine)),
        "engine_counters": engine.get("counters"),
        "deepspec_tokens_equal_engine": [p["token_ids"] for p in ours] == [p["token_ids"] for p in engine["prompts"]],
    }


def speed(result: dict) -> dict:
    tokens = sum(len(p["token_ids"]) for p in result["prompts"])
    wall = sum(p["generate_s"] for p in result["prompts"])
    cpu = sum(p["cpu_s"] for p in result["prompts"])
    return {"tokens": tokens, "generate_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall if wall else None,
            "load_s": result["load_s"]}


def ratio(a, b):
    return None if a is None or not b else a / b


# -- the benchmark --------------------------------------------------------------------------------------------
@dataclass
class ServeSettings:
    max_new_tokens: int = 128
    num_speculative_tokens: int | None = None  # None: each drafter's own drafts per step
    ngram_tokens: int = 5
    ngram_min: int = 2
    ngram_max: int = 4
    threads: int = 1
    kv_cache_gib: int = 1
    seed: int = 0

    def ngram_config(self) -> dict:
        return {"method": "ngram", "num_speculative_tokens": self.ngram_tokens,
                "prompt_lookup_min": self.ngram_min, "prompt_lookup_max": self.ngram_max}


def plan_runs(drafters: dict, target, target_dir: str, settings: ServeSettings, workdir: Path
              ) -> tuple[list[EngineRun], dict, list[dict]]:
    """The engine runs (baselines first), the re-read exported drafters by run name, and DeepSpec's refusals."""
    from deepspec.export import load_exported

    runs = [EngineRun("vllm", None), EngineRun("vllm ngram", settings.ngram_config())]
    exported, refusals = {}, []
    for name, drafter in drafters.items():
        folders, refused = export_for_vllm(name, drafter, target, target_dir, workdir)
        refusals += refused
        for layout, folder, method in folders:
            reread = load_exported(folder, target).eval()  # what the engine reads, read back by DeepSpec
            drafts = drafts_per_step(reread, target, settings.num_speculative_tokens)
            key = f"{name} {layout}"
            exported[key] = (reread, drafts)
            runs.append(EngineRun(key, {"method": method, "model": str(folder), "num_speculative_tokens": drafts},
                                  drafter=name, layout=layout))
    return runs, exported, refusals


def serve_and_compare(target, target_dir: str, drafters: dict, prompts: list[list[int]], eos_ids: list[int],
                      settings: ServeSettings, python: Path, workdir: Path) -> dict:
    """Every engine run and DeepSpec's loop beside each served drafter (module docstring): the report."""
    job = {"target": target_dir, "dtype": "float32", "seed": settings.seed, "prompts": prompts,
           "max_tokens": settings.max_new_tokens, "stop_token_ids": eos_ids, "temperature": 0.0,
           "max_model_len": max(len(p) for p in prompts) + settings.max_new_tokens + 64}
    env = engine_env(python, settings.threads, settings.kv_cache_gib)
    runs, exported, refusals = plan_runs(drafters, target, target_dir, settings, workdir)
    results = {run.name: run_engine(run, job, python, env, workdir) for run in runs}
    baseline = results["vllm"]
    if not baseline["ok"]:
        raise ValueError(f"vLLM cannot serve the target {target_dir} alone: {engine_refusal(baseline)} "
                         f"(log: {baseline['log']})")
    for run in runs:
        if not results[run.name]["ok"]:
            refusals.append({"drafter": run.drafter, "layout": run.layout, "by": "vllm",
                             "reason": engine_refusal(results[run.name])})
    reference = [p["token_ids"] for p in baseline["prompts"]]
    base_speed = speed(baseline)
    report = {"engine": f"vllm {baseline['vllm_version']}", "vllm": base_speed, "vllm_ngram": None, "served": {},
              "refused": refusals}
    ngram = results["vllm ngram"]
    if ngram["ok"]:
        report["vllm_ngram"] = speed(ngram) | {
            "lossless": [p["token_ids"] for p in ngram["prompts"]] == reference,
            "engine_mean_accepted_length": mean_accepted_length(
                [n for p in ngram["prompts"] if p.get("spec") for n in p["spec"]["per_step_accepted"]]),
            "speedup_vs_vllm": ratio(speed(ngram)["tokens_per_s"], base_speed["tokens_per_s"])}
    ngram_rate = (report["vllm_ngram"] or {}).get("tokens_per_s")
    for run in runs[2:]:
        result = results[run.name]
        if not result["ok"]:
            continue
        drafter, drafts = exported[run.name]
        ours = our_rounds(drafter, target, prompts, settings.max_new_tokens, eos_ids, drafts, settings.seed)
        run_speed = speed(result)
        report["served"][run.name] = {
            "drafter": run.drafter, "layout": run.layout, "method": run.speculative_config["method"],
            "drafts_per_step": drafts, "lossless": [p["token_ids"] for p in result["prompts"]] == reference,
            **acceptance_comparison(result, ours), **run_speed,
            "speedup_vs_vllm": ratio(run_speed["tokens_per_s"], base_speed["tokens_per_s"]),
            "speedup_vs_vllm_ngram": ratio(run_speed["tokens_per_s"], ngram_rate)}
    return report


def render_prompts(target_name: str, benchmark: str, num_prompts: int, tokenizer) -> tuple[list, list[int], str]:
    """The benchmark's first turns as `deepspec evaluate` renders them (the target config's template options)."""
    from deepspec.data.rendering import command_line_rendering
    from deepspec.evaluation.prompt_sets import load_benchmark
    from deepspec.targets.config import target_settings

    settings = target_settings(target_name)
    bench = load_benchmark(benchmark, num_prompts)
    rendering = command_line_rendering("chat", None, settings.chat_template, settings.chat_template_kwargs)
    prompts = [rendering.prompt_ids(tokenizer, messages) for messages in bench.prompts]
    return prompts, sorted(rendering.stop_token_ids(tokenizer)), bench.name


def target_folder(target) -> str:
    """The folder vLLM loads the target from."""
    return engine_target_folder(target.path, target.name)


@command_line("deepspec bench serve")
def main(argv=None) -> int:
    args = build_parser("deepspec bench serve").parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch

    from deepspec.evaluation.runner import drafter_specs, open_drafter
    from deepspec.targets.load import load_target
    from deepspec.utils.io import emit_report

    if args.threads < 1:
        raise ValueError(f"--threads={args.threads} must be >= 1")
    python = vllm_python(args.vllm_python)
    torch.set_num_threads(args.threads)
    settings = ServeSettings(max_new_tokens=args.max_new_tokens, num_speculative_tokens=args.num_speculative_tokens,
                             ngram_tokens=args.ngram_tokens, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                             threads=args.threads, kv_cache_gib=args.kv_cache_gib, seed=args.seed)
    target = load_target(args.target, dtype="float32", device="cpu")
    target_dir = target_folder(target)
    prompts, eos_ids, bench_name = render_prompts(args.target, args.benchmark, args.num_prompts, target.tokenizer)
    drafters = {name: open_drafter(path, target).eval() for name, path in drafter_specs(args.drafter).items()}
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="deepspec-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        report = serve_and_compare(target, target_dir, drafters, prompts, eos_ids, settings, python, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    for refusal in report["refused"]:
        print(f"deepspec bench serve: {refusal['by']} refused {refusal['drafter']} "
              f"{refusal['layout'] or ''}: {refusal['reason'].splitlines()[0]}", file=sys.stderr)
    report["settings"] = {
        "target": target.name, "target_folder": target_dir, "vllm_python": str(python), "benchmark": bench_name,
        "num_prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts], "temperature": 0.0,
        "dtype": "float32", "batch_size": 1, "torch": torch.__version__, "cpu": cpu_model(), **vars(settings)}
    emit_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
