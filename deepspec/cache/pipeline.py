"""The `cache_hiddens` job behind data_tools/cache_hiddens.py: config dict -> build | estimate | verify | merge.

Multi-process: under `torchrun` (RANK/WORLD_SIZE in the environment) a gloo process group is initialised
and each rank caches its share (build.py); otherwise one process does everything.

Smoke-test targets: `target.name=tiny-random-llama` / `tiny-random-qwen3` build a tiny random model
(4 layers, hidden 64, seed 0) around the embedded SmolLM2 tokenizer, so the CLI, multi-process and resume
paths can be exercised in seconds. They are for tests only; their features mean nothing.

Layer choice: `cache.layer_ids`, else `target.layer_ids`, else `cache.num_feature_layers` ids spread from
layer 1 to L-3 (5 by default: what DSpark/DFlash read; Eagle3 reads 3 of them). `cache.layer_ids=[]` stores
the final hidden state only; `cache.content=top_k_logprobs` stores the target's `cache.top_k` next-token ids
and log-probs only (no hidden states, no layers): what a standalone drafter distils from, at a fraction
of the bytes (deepspec/cache/FORMAT.md).

Rendering (deepspec.data.rendering): `data.format=chat` (the target's chat template, or `target.chat_template`)
or `data.format=text` (plain text: a base model). A chat-format job on a tokenizer without a chat template fails
before the target's weights load, naming both fixes; a build or estimate whose every conversation is skipped
fails too (the first of each reason named), and leaves no cache behind.
The cached layers are exactly what every drafter trained on this cache receives; reading a subset
(e.g. Eagle3's 3 of the 5) is not offered, so build one cache per layer choice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from typing import Any

from deepspec.cache.build import BuildJob, build_cache
from deepspec.cache.config import CacheJobConfig, data_rendering, resolve_cache_config
from deepspec.cache.format import CONTENT_TOP_K
from deepspec.cache.merge import merge_cache
from deepspec.cache.plan import (
    CACHE_OPTIONS,
    estimate_cache_size,
    format_estimate,
    length_notes,
    render_samples,
    target_context_length,
)
from deepspec.cache.reader import verify_cache
from deepspec.data.regenerate import check_regenerated_rendering
from deepspec.data.sources import load_prompts, require_conversations
from deepspec.data.split import split_conversations
from deepspec.targets.layers import spread_layer_ids, validate_layer_ids
from deepspec.targets.load import LoadedTarget, load_target
from deepspec.utils.io import check_output_folder

log = logging.getLogger(__name__)

MODES = ("build", "estimate", "verify", "merge")
RENDERING_FIELDS = {"format": "data.format", "chat_template": "target.chat_template",
                    "chat_template_kwargs": "target.chat_template_kwargs"}


def load_cache_target(target_cfg: dict) -> LoadedTarget:
    return load_target(target_cfg["name"], dtype=target_cfg.get("dtype"), device=target_cfg.get("device"),
                       revision=target_cfg.get("revision"))


def load_engine_target(target_cfg: dict) -> LoadedTarget:
    """What DeepSpec loads of a target a serving engine runs: its head only
    (deepspec.targets.head)."""
    from deepspec.targets.head import load_target_head

    return load_target_head(target_cfg["name"], dtype=target_cfg.get("dtype"),
                            device=target_cfg.get("device"), revision=target_cfg.get("revision"))


def feature_engine(job: CacheJobConfig, target: LoadedTarget, layer_ids: list[int]):
    """The engine computing the hidden states (`cache.engine`), or None: the target's own
    forward."""
    if job.cache.engine == "transformers":
        return None
    from deepspec.cache.engine_source import VllmCapture
    from deepspec.cache.plan import target_context_length

    longest = job.cache.max_length or target_context_length(target)
    if longest is None:
        raise ValueError("cache.max_length=null and the target's config names no "
                         "max_position_embeddings: set cache.max_length (vLLM needs the longest "
                         "sample's length)")
    # + 1: the one token the engine samples after each sample
    return VllmCapture(target, layer_ids, job.vllm, max_model_len=longest + 1)


def load_estimate_target(target_cfg: dict):
    """What an estimate reads of the target: its config and tokenizer, no weights (an 8B target's weights would
    take minutes and 16 GB to learn a size). Tiny test targets are simply built."""
    from types import SimpleNamespace

    from deepspec.targets.family import text_config
    from deepspec.targets.load import load_target_config, load_tokenizer
    from deepspec.targets.tiny import is_tiny_target

    if is_tiny_target(target_cfg["name"]):
        return load_cache_target(target_cfg)
    config = text_config(load_target_config(target_cfg["name"], target_cfg.get("revision")))
    return SimpleNamespace(config=config, tokenizer=load_tokenizer(target_cfg["name"], target_cfg.get("revision")),
                           num_layers=int(config.num_hidden_layers))


def disk_note(out_dir: str, total_bytes: int) -> str:
    """Free space where the cache would go against its size, and the way out when it does not fit."""
    import shutil

    from deepspec.utils.io import existing_folder_of

    folder = existing_folder_of(out_dir)  # the nearest existing parent holds the future folder
    free = shutil.disk_usage(folder).free
    verdict = ("fits" if total_bytes < 0.8 * free else
               "does not fit comfortably: train without it (`deepspec train data.features=online "
               "data.source.prompts=...`: the target computes the features inside training), or with "
               "data.features=hybrid (online in epoch 0, writing this cache for the epochs after) where it fits")
    return (f"disk: {free / 2**30:,.1f} GiB free at {folder}; the cache would take {total_bytes / 2**30:,.3f} GiB "
            f"({100 * total_bytes / max(free, 1):.1f}%): {verdict}")


def distributed_rank_world() -> tuple[int, int]:
    """(rank, world size); initialises a gloo process group when launched by torchrun with >1 process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
    return rank, world_size


def load_and_split(data_cfg: dict) -> tuple[dict, dict]:
    """Conversations by split and the `source` record kept in meta.json (incl. the loader's skip report)."""
    conversations, report = load_prompts(data_cfg["prompts"], limit=data_cfg.get("limit"))
    require_conversations(conversations, report, "data.prompts")
    splits = split_conversations(conversations, seed=data_cfg["seed"], val_fraction=data_cfg["val_fraction"],
                                 test_fraction=data_cfg["test_fraction"])
    source = {"prompts": data_cfg["prompts"], "limit": data_cfg.get("limit"), "seed": data_cfg["seed"],
              "val_fraction": data_cfg["val_fraction"], "test_fraction": data_cfg["test_fraction"],
              "load_report": dataclasses.asdict(report)}
    return splits, source


def warn_empty_splits(splits: dict, data_cfg: dict) -> list[str]:
    """Warn, naming the fields, for each split given a share (> 0) that got no conversation: each conversation's
    split is drawn from a hash of its id, so a few conversations can leave one empty. Returns the warnings."""
    total = sum(len(convs) for convs in splits.values())
    val, test = data_cfg["val_fraction"], data_cfg["test_fraction"]
    shares = {"train": (f"data.val_fraction={val} and data.test_fraction={test} (train: the rest, {1 - val - test:g})",
                        1 - val - test, "training on this cache is refused"),
              "validation": (f"data.val_fraction={val}", val,
                             "training reports no validation metrics and calibration has nothing to fit on"),
              "test": (f"data.test_fraction={test}", test, "nothing is held out for testing")}
    warnings = [f"{fields} gave none of the {total} conversation(s) to the '{split}' split (each one's split is "
                f"drawn from a hash of its id): the cache has no '{split}' samples, so {consequence}; give more "
                "conversations (data.prompts, data.limit) or try another data.seed"
                for split, (fields, share, consequence) in shares.items() if share > 0 and not splits.get(split)]
    for warning in warnings:
        log.warning(warning)
    return warnings


def resolve_layer_ids(cache_cfg: dict, target_cfg: dict, num_layers: int) -> list[int]:
    """cache.layer_ids, else the target config's layer_ids, else cache.num_feature_layers spread ids; none for
    a top-k cache (it stores no hidden states)."""
    if cache_cfg.get("content") == CONTENT_TOP_K:
        return validate_layer_ids(list(cache_cfg.get("layer_ids") or []), num_layers, field="cache.layer_ids")
    for field, layer_ids in (("cache.layer_ids", cache_cfg.get("layer_ids")),
                             ("target.layer_ids", target_cfg.get("layer_ids"))):
        if layer_ids is not None:
            return validate_layer_ids(list(layer_ids), num_layers, field=field)
    return spread_layer_ids(num_layers, cache_cfg.get("num_feature_layers", 5))


def validate_job_config(cfg: dict) -> None:
    """Cheap checks before any weights or data are loaded (the `cache:` options validated themselves:
    `CacheSchema.__post_init__`)."""
    if cfg.get("mode") not in MODES:
        raise ValueError(f"mode={cfg.get('mode')!r} is not one of {list(MODES)}")
    cache_cfg = cfg["cache"]
    if not cache_cfg.get("out_dir"):
        raise ValueError("cache.out_dir must be set")
    if cfg["mode"] == "build":
        check_output_folder(cache_cfg["out_dir"], "cache.out_dir")
    data_rendering(cfg["data"], cfg["target"])  # data.format, data.system_prompt, target.chat_template


def run_cache_job(cfg: CacheJobConfig | dict[str, Any]) -> int:
    """Run one mode of the job; returns the process exit code (non-zero: verify found problems)."""
    job = resolve_cache_config(cfg)  # unknown keys and wrong types fail here, naming the key
    cfg = dataclasses.asdict(job)
    validate_job_config(cfg)
    mode, cache_cfg, data_cfg = cfg["mode"], cfg["cache"], cfg["data"]
    out_dir = cache_cfg["out_dir"]
    if mode == "verify":
        problems = verify_cache(out_dir)
        print(f"{out_dir}: OK" if not problems
              else f"{out_dir}: {len(problems)} problem(s)\n  " + "\n  ".join(problems))
        return 1 if problems else 0
    if mode == "merge":
        meta = merge_cache(out_dir)
        print(f"{out_dir}: merged {meta.counts['samples']} samples, {meta.counts['tokens']} tokens")
        return 0

    rendering = data_rendering(data_cfg, cfg["target"])
    check_regenerated_rendering(data_cfg["prompts"], rendering, RENDERING_FIELDS)
    splits, source = load_and_split(data_cfg)  # bad or empty input fails before the target loads
    warn_empty_splits(splits, data_cfg)
    if mode == "build":  # a tokenizer without a chat template fails before the weights load
        from deepspec.targets.load import load_tokenizer

        rendering.check_tokenizer(load_tokenizer(cfg["target"]["name"], cfg["target"].get("revision")),
                                  CACHE_OPTIONS)
    target = (load_estimate_target(cfg["target"]) if mode == "estimate" else
              load_engine_target(cfg["target"]) if cache_cfg["engine"] != "transformers" else
              load_cache_target(cfg["target"]))
    rendering.check_tokenizer(target.tokenizer, CACHE_OPTIONS)
    layer_ids = resolve_layer_ids(cache_cfg, cfg["target"], target.num_layers)
    if mode == "estimate":
        rendered = render_samples(splits, target.tokenizer, max_length=cache_cfg["max_length"], rendering=rendering,
                                  context_length=target_context_length(target))
        rendered.require_samples(f"data.prompts={data_cfg['prompts']!r}")
        estimate = estimate_cache_size(rendered.num_tokens, len(rendered.samples), int(target.config.hidden_size),
                                       len(layer_ids), cache_cfg["storage_dtype"], cache_cfg["content"],
                                       cache_cfg["top_k"])
        print(format_estimate(estimate) + f"; skipped {dict(rendered.skipped)}; layer_ids {layer_ids}")
        for note in length_notes(rendered, cache_cfg["max_length"]):
            print(note)
        print(disk_note(out_dir, estimate["total_bytes"]))
        return 0

    import torch.distributed as dist

    # Tear down only a process group this job created (not, say, a training run's in the same process).
    owns_group = not (dist.is_available() and dist.is_initialized())
    rank, world_size = distributed_rank_world()
    engine = feature_engine(job, target, layer_ids)
    if engine is not None:  # recorded in meta.json; a resume with another engine is refused
        source = {**source, "engine": engine.record()}
    try:
        with engine or contextlib.nullcontext():
            build = BuildJob(dataclasses.replace(job.cache, layer_ids=layer_ids), rank=rank,
                             world_size=world_size, rendering=rendering, source=source,
                             faults=job.faults, engine=engine)
            stats = build_cache(splits, target, build)
            engine_cpu_s = engine.running_cpu_seconds() if engine is not None else None
    finally:
        if owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if engine_cpu_s is not None:
        print(f"rank {rank}: vLLM {engine.version} computed the hidden states "
              f"({engine.num_requests} requests, {engine_cpu_s:.1f} CPU-s in its processes)")
    print(f"rank {rank}: {stats.num_samples} samples, {stats.num_tokens} tokens, {stats.num_shards} shards "
          f"({stats.num_resumed_samples} samples resumed), {stats.tokens_per_s:.0f} tok/s")
    if stats.meta is not None:
        counts = stats.meta.counts
        print(f"cache {out_dir}: {counts['samples']} samples, {counts['tokens']} tokens, skipped "
              f"{counts['skipped']}" + (f", fp8 relative L2 error {stats.meta.fp8_rel_error:.4f}"
                                        if stats.meta.fp8_rel_error is not None else ""))
    return 0
