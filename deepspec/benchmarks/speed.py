"""Wall-clock decoding speed side by side, one process, one target, the same prompts, batch 1.

    deepspec bench speed --target smollm2-135m --drafter outputs/dspark [name=PATH ...] \
        --benchmark humaneval --num-prompts 2 --max-new-tokens 32 [--dtype bf16 --device cuda]

Methods, at every --temperatures value (default 0 and 1):
  * ar_loop: plain autoregressive decoding with DeepSpec's loop (`autoregressive_generate`): the baseline
    every speedup and cost ratio is relative to (same verifier code path as speculative decoding);
  * hf_generate: transformers' `generate` (greedy or sampling);
  * hf_prompt_lookup: transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`);
  * prompt_lookup: prompt lookup in DeepSpec's loop (`PromptLookupProposer`, up to 7 drafts or --block-size), with
    its tau;
  * one entry per drafter: DeepSpec speculative decoding (`speculative_generate`, fixed-length chain), and for a
    calibrated drafter that carries prompt lookup's acceptance (`deepspec calibrate`) one more, `NAME+lookup`:
    each round prompt lookup's drafts or the drafter's, whichever is expected to keep more
    (deepspec.decoding.combined).
Timing excludes model load and prefill: for our loop `GenerationResult.decode_s` (the rounds after the
prefill token); for transformers the time of `generate(max_new_tokens=N)` minus `generate(max_new_tokens=1)`
on the same prompt, over N-1 tokens. EOS never stops generation (our loop gets no EOS ids, transformers
gets `min_new_tokens=N`), so every method decodes the same number of tokens. One warm-up call per method.

Per drafter and temperature: tau, tokens_per_s, speedup_vs_ar, speedup_vs_hf_generate,
speedup_vs_prompt_lookup (against `prompt_lookup`, DeepSpec's loop), speedup_vs_hf_prompt_lookup (against
transformers'), draft_ms_per_round, verify_ms_per_round (verification + acceptance + the drafter's context
update), and the ceiling tau / (verify_cost_ratio + draft_cost_ratio) with both ratios measured relative to one
ar_loop decode step (what speedup the measured costs allow at this tau).
"""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import time
from dataclasses import dataclass

import torch

from deepspec.utils.errors import command_line


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafter", nargs="*", default=[], metavar="[NAME=]PATH",
                   help="saved drafter folders, or KIND:MODEL "
                        "(e.g. standalone:<causal LM sharing the target's tokenizer>)")
    p.add_argument("--benchmark", default="humaneval", help="JSONL path, 'humaneval' or hf:<name>[:<split>]")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--block-size", type=int, default=None, help="drafts per round (default: each drafter's own)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10)
    p.add_argument("--dtype", default=None, help="float32 | bf16 | fp16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 avoids oversubscription on a shared CPU")
    p.add_argument("--allow-target-mismatch", action="store_true")
    p.add_argument("--out", default="outputs/bench_speed.json")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _div(a, b):
    return None if a is None or not b else a / b


def run_loop(method, prompts, max_new_tokens: int, seed: int, device: torch.device) -> dict:
    """Time one of our loop's methods (`method(prompt, n, generator) -> GenerationResult`) over all prompts."""
    method(prompts[0], min(8, max_new_tokens), torch.Generator(device=device).manual_seed(seed))  # warm-up
    tokens = rounds = 0
    decode_s = draft_s = verify_s = 0.0
    emitted = 0
    for index, prompt in enumerate(prompts):
        result = method(prompt, max_new_tokens, torch.Generator(device=device).manual_seed(seed + index))
        tokens += len(result.token_ids) - 1  # the first token comes from the prefill
        decode_s += result.decode_s
        rounds += len(result.rounds)
        emitted += sum(r.tau for r in result.rounds)
        draft_s += sum(r.draft_s for r in result.rounds)
        verify_s += sum(r.verify_s for r in result.rounds)
    return {"tokens": tokens, "decode_s": decode_s, "tokens_per_s": _rate(tokens, decode_s),
            "rounds": rounds, "tau": _div(emitted, rounds),
            "draft_ms_per_round": _div(1000 * draft_s, rounds), "verify_ms_per_round": _div(1000 * verify_s, rounds)}


def run_hf(model, prompts, max_new_tokens: int, temperature: float, seed: int, device: torch.device,
           **extra) -> dict:
    """transformers' generate; decode time = t(N new tokens) - t(1 new token) per prompt."""
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
        {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}

    def generate(prompt, num_tokens):
        ids = torch.tensor([prompt], device=device)
        torch.manual_seed(seed)
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, **sampling, **extra)
        _sync(device)
        return time.perf_counter() - start, out.shape[1] - ids.shape[1]

    try:
        generate(prompts[0], min(8, max_new_tokens))  # warm-up
        tokens, decode_s = 0, 0.0
        for prompt in prompts:
            full_s, produced = generate(prompt, max_new_tokens)
            first_s, _ = generate(prompt, 1)
            tokens += produced - 1
            decode_s += max(full_s - first_s, 0.0)
    except (ValueError, NotImplementedError, TypeError) as err:  # e.g. a mode this transformers version lacks
        return {"error": f"{type(err).__name__}: {err}"}
    return {"tokens": tokens, "decode_s": decode_s, "tokens_per_s": _rate(tokens, decode_s)}


@command_line("deepspec bench speed")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import transformers

    from deepspec.data.rendering import command_line_rendering
    from deepspec.decoding.acceptance import Acceptance
    from deepspec.decoding.verifier import TargetVerifier
    from deepspec.evaluation.prompt_sets import load_benchmark
    from deepspec.evaluation.runner import check_drafter_templates, drafter_specs, open_drafter
    from deepspec.targets.config import target_settings
    from deepspec.targets.load import load_target
    from deepspec.utils.io import atomic_write_json

    if args.max_new_tokens < 2:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens} must be >= 2 (the first token is the prefill's)")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads} must be >= 1")
        torch.set_num_threads(args.threads)
    specs = drafter_specs(args.drafter)
    bench = load_benchmark(args.benchmark, args.num_prompts)
    target_cfg = target_settings(args.target)  # its chat_template_kwargs render the prompts, as in evaluate
    target = load_target(target_cfg.name, dtype=args.dtype, device=args.device, revision=target_cfg.revision)
    model = target.model
    device = next(model.parameters()).device
    # Rendered as evaluate renders them: the target config's chat template settings.
    rendering = command_line_rendering("chat", None, target_cfg.chat_template, target_cfg.chat_template_kwargs)
    prompts = [rendering.prompt_ids(target.tokenizer, messages) for messages in bench.prompts]
    drafters = {name: open_drafter(path, target, strict_target=not args.allow_target_mismatch).to(device).eval()
                for name, path in specs.items()}
    check_drafter_templates(drafters, rendering, specs)
    runs = [(name, drafter, False) for name, drafter in drafters.items()]
    runs += [(f"{name}+lookup", drafter, True) for name, drafter in drafters.items()
             if drafter.config.prompt_lookup_acceptance is not None]
    # One AR verifier and one acceptance backend choice for every run of this benchmark.
    job = SpeedJob(args, model, device, prompts, TargetVerifier(model, []), Acceptance())

    report = {"settings": {
        "target": target.name, "dtype": str(model.dtype).replace("torch.", ""), "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else (platform.processor() or platform.machine())),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "benchmark": bench.name, "num_prompts": len(prompts), "prompt_lengths": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens, "prompt_lookup_num_tokens": args.prompt_lookup_tokens,
        "block_size": args.block_size, "seed": args.seed, "batch_size": 1},
        "baselines": {}, "drafters": {name: {} for name, _, _ in runs}}
    with torch.no_grad():
        for temperature in args.temperatures:
            key = f"T={temperature:g}"
            baselines = measure_baselines(job, temperature)
            report["baselines"][key] = baselines["report"]
            for name, drafter, with_lookup in runs:
                report["drafters"][name][key] = measure_drafter(job, temperature, drafter, with_lookup, baselines)
    import json

    print(json.dumps(report, indent=2))
    atomic_write_json(args.out, report)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


@dataclass
class SpeedJob:
    """What every timed run of one `deepspec bench speed` shares."""

    args: argparse.Namespace
    model: torch.nn.Module
    device: torch.device
    prompts: list
    ar_verifier: object  # the target verifying nothing: plain decoding
    acceptance: object  # one acceptance backend for every run


def measure_baselines(job: SpeedJob, temperature: float) -> dict:
    """Plain decoding in our loop, transformers' `generate` with and without prompt lookup, and prompt lookup in our
    loop, at one temperature: their report row, and the rates the drafters' ratios divide by."""
    from deepspec.decoding.lookup import PromptLookupProposer
    from deepspec.decoding.loop import autoregressive_generate, speculative_generate
    from deepspec.decoding.sampling import SamplingParams

    args, sampling = job.args, SamplingParams(temperature=temperature)

    def ar(prompt, n, gen):
        return autoregressive_generate(job.ar_verifier, prompt, n, sampling, generator=gen,
                                       acceptance_backend=job.acceptance)

    def our_lookup(prompt, n, gen):
        return speculative_generate(job.ar_verifier, PromptLookupProposer(args.block_size or 7), prompt, n, sampling,
                                    generator=gen, acceptance_backend=job.acceptance)

    ar_stats = run_loop(ar, job.prompts, args.max_new_tokens, args.seed, job.device)
    hf = run_hf(job.model, job.prompts, args.max_new_tokens, temperature, args.seed, job.device)
    lookup = run_hf(job.model, job.prompts, args.max_new_tokens, temperature, args.seed, job.device,
                    prompt_lookup_num_tokens=args.prompt_lookup_tokens)
    ours = run_loop(our_lookup, job.prompts, args.max_new_tokens, args.seed, job.device)
    ar_step_ms = _div(1000 * ar_stats["decode_s"], ar_stats["rounds"])
    return {"ar": ar_stats, "ar_step_ms": ar_step_ms, "hf": hf, "hf_lookup": lookup, "lookup": ours, "report": {
        "ar_loop": {"tokens_per_s": ar_stats["tokens_per_s"], "step_ms": ar_step_ms},
        "hf_generate": {k: v for k, v in hf.items() if k in ("tokens_per_s", "error")},
        "hf_prompt_lookup": {k: v for k, v in lookup.items() if k in ("tokens_per_s", "error")},
        "prompt_lookup": {"tau": ours["tau"], "tokens_per_s": ours["tokens_per_s"],
                          "speedup_vs_ar": _div(ours["tokens_per_s"], ar_stats["tokens_per_s"])},
    }}


def measure_drafter(job: SpeedJob, temperature: float, drafter, with_lookup: bool, baselines: dict) -> dict:
    """One drafter (or prompt lookup or it, chosen per round, `with_lookup`) at one temperature: τ, its rate, the
    ratios against `measure_baselines`' runs and what a round costs against a plain decode step."""
    from deepspec.decoding.loop import speculative_generate
    from deepspec.decoding.sampling import SamplingParams
    from deepspec.decoding.verifier import TargetVerifier
    from deepspec.drafters.proposers import make_proposer

    args, sampling = job.args, SamplingParams(temperature=temperature)
    verifier = TargetVerifier(job.model, drafter.config.target_layer_ids)
    chosen = []  # (rounds, lookup rounds) of every generation, warm-up first

    def spec(prompt, n, gen):
        proposer = make_proposer(drafter, job.model, num_draft_tokens=args.block_size, with_prompt_lookup=with_lookup)
        result = speculative_generate(verifier, proposer, prompt, n, sampling, generator=gen,
                                      acceptance_backend=job.acceptance)
        if with_lookup:
            chosen.append((proposer.rounds, proposer.lookup_rounds))
        return result

    stats = run_loop(spec, job.prompts, args.max_new_tokens, args.seed, job.device)
    ar_rate, ar_step_ms = baselines["ar"]["tokens_per_s"], baselines["ar_step_ms"]
    verify_ratio = _div(stats["verify_ms_per_round"], ar_step_ms)
    draft_ratio = _div(stats["draft_ms_per_round"], ar_step_ms)
    row = {
        "tau": stats["tau"], "tokens_per_s": stats["tokens_per_s"],
        "speedup_vs_ar": _div(stats["tokens_per_s"], ar_rate),
        "speedup_vs_hf_generate": _div(stats["tokens_per_s"], baselines["hf"].get("tokens_per_s")),
        "speedup_vs_prompt_lookup": _div(stats["tokens_per_s"], baselines["lookup"]["tokens_per_s"]),
        "speedup_vs_hf_prompt_lookup": _div(stats["tokens_per_s"], baselines["hf_lookup"].get("tokens_per_s")),
        "draft_ms_per_round": stats["draft_ms_per_round"],
        "verify_ms_per_round": stats["verify_ms_per_round"],
        "verify_cost_ratio": verify_ratio, "draft_cost_ratio": draft_ratio,
        "ceiling_speedup": _div(stats["tau"], (verify_ratio or 0) + (draft_ratio or 0)),
        "rounds": stats["rounds"],
    }
    if with_lookup:  # the share of the timed rounds that proposed prompt lookup's drafts
        row["lookup_round_share"] = _div(sum(c[1] for c in chosen[1:]), sum(c[0] for c in chosen[1:]))
    return row


if __name__ == "__main__":
    sys.exit(main())
