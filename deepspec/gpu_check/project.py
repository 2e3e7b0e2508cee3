"""Every place the GPU check touches DeepSpec itself: library calls and entry-point command lines.

The checks (checks.py) see only the functions below. Entry points are run as the user runs them
(`deepspec train` with the Hydra overrides it documents, `deepspec cache`, `deepspec bench NAME`),
through this interpreter's `deepspec.cli`, so an installed wheel runs the check as a checkout does;
library calls are limited to the pieces a check compares (acceptance and loss kernels against their
references, greedy decoding against `generate`). When an entry point or signature changes, this is the
one module to adapt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

DRAFTER_KINDS = ("dspark", "dflash", "eagle3", "mtp")


def python_command(*args: str) -> list[str]:
    return [sys.executable, *args]


def deepspec_command(*args: str) -> list[str]:
    """A `deepspec` subcommand in this interpreter: runs from an installed wheel as from a checkout."""
    return python_command("-m", "deepspec.cli", *args)


# -- 1. acceptance ------------------------------------------------------------------------------


def sampling_params(temperature: float, top_k: int = 0, top_p: float = 1.0):
    from deepspec.decoding.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)


def processed_probs(logits_XV: torch.Tensor, params) -> torch.Tensor:
    """The distribution a draft token is drawn from under `params` (temperature, top-k, top-p)."""
    from deepspec.decoding.sampling import probs_from_logits

    return probs_from_logits(logits_XV, params)


def draw_noise(batch: int, num_draft: int, vocab: int, generator: torch.Generator, device: str):
    from deepspec.decoding.acceptance import AcceptanceNoise

    return AcceptanceNoise.draw(batch, num_draft, vocab, generator, device)


def accept(backend: str, draft_ids_BK, draft_probs_BKV, logits_BK1V, num_draft_B, params, noise):
    """(num_accepted_B, output_ids_BK1) of `accept_draft` on one backend ("torch" or "triton")."""
    from deepspec.decoding.acceptance import accept_draft

    result = accept_draft(draft_ids_BK, draft_probs_BKV, logits_BK1V, num_draft_B, params, noise, backend=backend)
    return result.num_accepted_B, result.output_ids_BK1


def bench_kernels_command(out_json: Path, batch_sizes, vocab_sizes, num_draft: int, iters: int) -> list[str]:
    return deepspec_command("bench", "kernels", "--out", str(out_json),
                          "--batch-sizes", ",".join(map(str, batch_sizes)),
                          "--vocab-sizes", ",".join(map(str, vocab_sizes)),
                          "--num-draft", str(num_draft), "--iters", str(iters))


# -- 2. TV loss -----------------------------------------------------------------------------------


def distribution_terms(draft_hidden_NH, head_VH, target_hidden_NH, labels_N, *, use_triton: bool, chunk_rows: int):
    """(ce_N, tv_N, soft_ce_N) of the chunked loss path, fused Triton kernel or torch reference per chunk."""
    from deepspec.losses.distribution import TermsOptions
    from deepspec.losses.distribution import distribution_terms as terms

    out = terms(draft_hidden_NH, head_VH, target_hidden_NH, head_VH, labels_N,
                options=TermsOptions(chunk_rows=chunk_rows, use_triton=use_triton))
    return out.ce_N, out.tv_N, out.soft_ce_N


def row_terms(draft_logits_NV, target_logits_NV, labels_N, *, fused: bool):
    """(ce_N, tv_N, soft_ce_N) straight from logit rows: the Triton kernel or its torch reference."""
    if fused:
        from deepspec.losses.tv_triton import fused_row_terms

        return fused_row_terms(draft_logits_NV, target_logits_NV, labels_N)
    from deepspec.losses.distribution import row_terms_from_logits

    return row_terms_from_logits(draft_logits_NV, target_logits_NV, labels_N)


def loss_memory_command(out_json: Path, num_rows: int, hidden: int, vocab: int, chunk_rows: int,
                        device: str) -> list[str]:
    return deepspec_command("bench", "loss-memory", "--out", str(out_json), "--num-rows", str(num_rows),
                            "--hidden", str(hidden), "--vocab", str(vocab), "--chunk-rows", str(chunk_rows),
                            "--device", device)


def read_loss_memory(out_json: Path) -> dict:
    """{"chunked_peak_mb", "naive_peak_mb"} from the report `deepspec bench loss-memory` wrote."""
    report = json.loads(out_json.read_text())
    return {key: report[key] for key in ("chunked_peak_mb", "naive_peak_mb")}


# -- targets --------------------------------------------------------------------------------------


def write_target(shape: str, out_dir: Path, device: str) -> Path:
    from deepspec.targets.synthetic import write_random_target

    return write_random_target(shape, out_dir, dtype=torch.bfloat16, device=device)


def make_target(shape: str, device: str, dtype: torch.dtype):
    from deepspec.targets.synthetic import make_random_target

    return make_random_target(shape, device=device, dtype=dtype)


def load_target(path: Path, dtype: str, device: str):
    from deepspec.targets.load import load_target as load

    return load(str(path), dtype=dtype, device=device)


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    from deepspec.data.chat import prompt_ids

    return prompt_ids(tokenizer, [{"role": "user", "content": text}])


# -- 3. training ----------------------------------------------------------------------------------


def _target_overrides(target_dir: Path, dtype: str) -> list[str]:
    # The conf default target is the embedded SmolLM2 (30 layers): name the folder and let its
    # config.json give the depth.
    return [f"target.name={target_dir}", f"target.dtype={dtype}", "target.num_hidden_layers=null",
            "target.layer_ids=null"]


def cache_command(target_dir: Path, prompts: Path, cache_dir: Path, max_length: int, dtype: str) -> list[str]:
    return deepspec_command("cache", *_target_overrides(target_dir, dtype),
                          f"data.prompts={prompts}", "data.val_fraction=0.1", f"cache.out_dir={cache_dir}",
                          f"cache.max_length={max_length}", "cache.storage_dtype=bf16", "cache.batch_size=16",
                          "cache.progress=false")


def cache_counts(cache_dir: Path) -> dict:
    from deepspec.cache.format import read_meta

    counts = read_meta(cache_dir).counts
    return {"samples": counts.get("samples"), "tokens": counts.get("tokens")}


def train_command(target_dir: Path, cache_dir: Path, kinds: list[str], zero_stage: int, run_dir: Path, *,
                  steps: int, global_batch_size: int, micro_batch_size: int, max_tokens_per_row: int,
                  device: str, dtype: str, extra: tuple[str, ...] = ()) -> list[str]:
    """`deepspec train` for one drafter kind (run folder `run_dir`), or a Hydra multirun sweep over
    several (one sub-folder per kind under `run_dir`)."""
    sweep = len(kinds) > 1
    where = ([f"hydra.sweep.dir={run_dir}", "hydra.sweep.subdir=${drafter.kind}"] if sweep
             else [f"hydra.run.dir={run_dir}"])
    return deepspec_command(
        "train", *(["-m"] if sweep else []), *_target_overrides(target_dir, dtype),
        f"drafter={','.join(kinds)}", f"deepspeed=zero{zero_stage}", f"data.cache_dir={cache_dir}",
        f"data.max_tokens_per_row={max_tokens_per_row}", f"trainer.max_steps={steps}",
        f"trainer.global_batch_size={global_batch_size}", f"trainer.micro_batch_size={micro_batch_size}",
        f"trainer.device={device}", "debug=gpu_check", *where, *extra)


def train_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train records, validation records) of one run folder's metrics.jsonl."""
    from deepspec.training.log import read_metrics

    return read_metrics(run_dir, "train"), read_metrics(run_dir, "validation")


# -- 4. decoding ----------------------------------------------------------------------------------


def greedy_generate(model, prompt: list[int], num_tokens: int) -> list[int]:
    """The target's own greedy decoding (transformers `generate`), EOS ignored."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                         min_new_tokens=num_tokens, do_sample=False, temperature=None, top_k=None, top_p=None)
    return out[0, len(prompt):].tolist()


def random_drafter(target, kind: str, seed: int = 0):
    """A freshly initialised drafter of `kind` with its default architecture (deepspec/drafters/<kind>/config.py)."""
    from deepspec.drafters.build import build_drafter

    torch.manual_seed(seed)
    return build_drafter(kind, target).eval()


def speculative_greedy(target, drafter, prompt: list[int], num_tokens: int) -> tuple[list[int], int, int]:
    """(tokens, rounds, accepted drafts) of DeepSpec's speculative loop at temperature 0."""
    from deepspec.decoding.loop import speculative_generate
    from deepspec.decoding.verifier import TargetVerifier
    from deepspec.drafters.proposers import make_proposer

    verifier = TargetVerifier(target.model, drafter.config.target_layer_ids)
    result = speculative_generate(verifier, make_proposer(drafter, target.model), prompt, num_tokens,
                                  sampling_params(0.0))
    return result.token_ids, len(result.rounds), sum(r.accepted for r in result.rounds)


def save_drafter(drafter, out_dir: Path) -> Path:
    drafter.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def bench_speed_command(target_dir: Path, drafters: dict[str, Path], prompts: Path, out_json: Path, *,
                        num_prompts: int, max_new_tokens: int, temperatures, dtype: str, device: str) -> list[str]:
    return deepspec_command("bench", "speed", "--target", str(target_dir),
                          "--drafter", *[f"{name}={path}" for name, path in drafters.items()],
                          "--benchmark", str(prompts), "--num-prompts", str(num_prompts),
                          "--max-new-tokens", str(max_new_tokens), "--temperatures", *map(str, temperatures),
                          "--dtype", dtype, "--device", device, "--out", str(out_json))


def bench_scheduler_command(target_dir: Path, prompts: Path, out_json: Path, *, concurrency, max_new_tokens: int,
                            requests_per_slot: int, context_len: int, profile_repeats: int, device: str) -> list[str]:
    """The batched loop (`deepspec bench scheduler`; an untrained 1-layer DSpark drafter, fp32 target)."""
    return deepspec_command("bench", "scheduler", "--target", str(target_dir),
                          "--concurrency", ",".join(map(str, concurrency)), "--max-new-tokens", str(max_new_tokens),
                          "--requests-per-slot", str(requests_per_slot), "--context-len", str(context_len),
                          "--profile-repeats", str(profile_repeats), "--prompts", str(prompts),
                          "--device", device, "--threads", "1" if device == "cpu" else "4",
                          "--out", str(out_json), "--sps-dir", str(out_json.parent / "sps"))
