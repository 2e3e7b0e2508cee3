"""Merging a finished build: every rank's complete partial index joined into `index.json` (samples in global order),
then `meta.json` written last, so a folder with a meta.json is a finished cache. The merge reads no shard: the
partial indices hold the checksums of the bytes each rank wrote (or verified on resume).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from deepspec.cache import format as fmt
from deepspec.cache.plan import MAX_PROBLEMS_KEPT
from deepspec.cache.shards import read_partial_index
from deepspec.cache.stage import remove_stage

log = logging.getLogger(__name__)

# The loader's skip counts (meta.json `source.load_report`) surfaced in the cache counts as `input_<reason>`.
LOAD_REPORT_SKIPS = ("num_malformed", "num_empty", "num_unknown_role", "num_truncated")


def merge_when_all_done(out_dir: Path, rank: int, world_size: int) -> fmt.CacheMeta | None:
    """With torch.distributed initialised over the build's ranks, they meet and rank 0 merges; a single process
    merges itself; separate processes without a process group leave the merge to `merge_cache` (None)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size:
        dist.barrier()  # every rank's partial index is complete
        meta = merge_cache(out_dir) if rank == 0 else None
        dist.barrier()  # nobody reads index.json before it exists
        return meta
    if world_size == 1:
        return merge_cache(out_dir)
    log.info("rank %d finished; run merge_cache(%s) once all %d ranks are done", rank, out_dir, world_size)
    return None


def merge_cache(out_dir: str | Path) -> fmt.CacheMeta:
    """Join every rank's complete partial index into index.json (global order), then write meta.json."""
    out_dir = Path(out_dir)
    partials = read_complete_partials(out_dir)
    joined = join_partials(out_dir, partials)
    _check_each_sample_once(out_dir, joined.samples, partials)
    samples = [{"id": s["id"], "split": s["split"], "shard": s["shard"], "offset": s["offset"],
                "length": s["length"], "position": s["position"], "num_loss_tokens": s["num_loss_tokens"]}
               for s in joined.samples]
    settings = partials[0]["settings"]
    counts = cache_counts(samples, joined, settings)
    index = {"format_version": fmt.FORMAT_VERSION, "world_size": len(partials), "num_samples": len(samples),
             "num_tokens": counts["tokens"], "shards": joined.shards, "samples": samples}
    meta = fmt.write_index_and_meta(out_dir, index, cache_meta(settings, partials, joined, counts))
    removed = remove_stage(out_dir, "the samples a hybrid training run staged for this cache, which is now finished")
    if removed:
        print(f"cache {out_dir}: {removed}", flush=True)
        log.info("%s", removed)
    return meta


def read_complete_partials(out_dir: Path) -> list[dict]:
    """Every rank's partial index, in rank order; refused unless each exists, is complete and has rank 0's settings."""
    first_path = out_dir / fmt.partial_index_name(0)
    if not first_path.is_file():
        raise FileNotFoundError(f"{first_path}: no partial index of rank 0; has the build run?")
    world_size = read_partial_index(first_path, 0)["world_size"]
    partials = []
    for rank in range(world_size):
        path = out_dir / fmt.partial_index_name(rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: rank {rank} of {world_size} has not written its partial index")
        partial = read_partial_index(path, rank)
        if not partial.get("complete"):
            raise ValueError(f"{path}: rank {rank} has not finished (resume the build before merging)")
        if partials and partial["settings"] != partials[0]["settings"]:
            raise ValueError(f"{path}: rank {rank} was built with other settings than rank 0")
        partials.append(partial)
    return partials


@dataclass
class JoinedPartials:
    """The ranks' shards and samples (samples sorted by global position) and their summed statistics."""

    shards: dict[str, dict] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    sq_error: float = 0.0
    sq_reference: float = 0.0
    num_truncated: int = 0
    num_over_context: int = 0


def join_partials(out_dir: Path, partials: list[dict]) -> JoinedPartials:
    joined = JoinedPartials()
    for rank, partial in enumerate(partials):
        for k, entry in enumerate(partial["shards"]):
            fmt.check_shard_name(entry["file"], f"{out_dir / fmt.partial_index_name(rank)}: shards[{k}].file")
            joined.shards[entry["file"]] = {"sha256": entry["sha256"], "num_bytes": entry["num_bytes"],
                                            "num_tokens": entry["num_tokens"], "num_samples": len(entry["samples"]),
                                            "rank": partial["rank"]}
            joined.samples += [{**s, "shard": entry["file"]} for s in entry["samples"]]
            joined.sq_error += entry["fp8_sq_error"]
            joined.sq_reference += entry["fp8_sq_reference"]
        joined.skipped.update(partial["stats"]["skipped"])
        joined.problems += partial["stats"]["problems"]
        joined.num_truncated += partial["stats"]["num_truncated"]
        joined.num_over_context += partial["stats"].get("num_over_context", 0)
    joined.samples.sort(key=lambda s: s["position"])
    return joined


def _check_each_sample_once(out_dir: Path, samples: list[dict], partials: list[dict]) -> None:
    """Every rendered sample is in exactly one shard: no position twice, and as many as the ranks rendered (ranks
    that take their batches from a plan hold other positions than `position % world_size`)."""
    positions = [s["position"] for s in samples]
    twice = sorted({p for p, q in zip(positions, positions[1:]) if p == q})
    if twice:
        raise ValueError(f"{out_dir}: samples at positions {twice[:5]} are in more than one shard; rebuild the cache")
    rendered = [p["stats"].get("num_samples") for p in partials]
    if None not in rendered and sum(rendered) != len(samples):
        raise ValueError(f"{out_dir}: the shards hold {len(samples)} samples, the ranks rendered {sum(rendered)}; "
                         "rebuild the cache")


def cache_counts(samples: list[dict], joined: JoinedPartials, settings: dict) -> dict:
    """meta.json's `counts`: samples, tokens and loss tokens (also per split), skips (the loader's included),
    truncations, shards and bytes, the first problems."""
    skipped = Counter(joined.skipped)
    load_report = settings["source"].get("load_report") or {}
    for key in LOAD_REPORT_SKIPS:
        if load_report.get(key):
            skipped[f"input_{key.removeprefix('num_')}"] += load_report[key]
    per_split = {name: {"samples": sum(1 for s in samples if s["split"] == name),
                        "tokens": sum(s["length"] for s in samples if s["split"] == name)} for name in fmt.SPLITS}
    return {"samples": len(samples), "tokens": sum(s["length"] for s in samples),
            "loss_tokens": sum(s["num_loss_tokens"] for s in samples),
            "per_split": per_split, "skipped": dict(sorted(skipped.items())),
            "num_skipped": sum(skipped.values()), "truncated_to_max_length": joined.num_truncated,
            "longer_than_target_context": joined.num_over_context,
            "shards": len(joined.shards), "bytes_on_disk": sum(s["num_bytes"] for s in joined.shards.values()),
            "problems": joined.problems[:MAX_PROBLEMS_KEPT]}


def cache_meta(settings: dict, partials: list[dict], joined: JoinedPartials, counts: dict) -> fmt.CacheMeta:
    """meta.json of the merged cache, from the build's settings record (`finished_settings` reads it back)."""
    content = settings.get("content", fmt.CONTENT_HIDDEN)
    return fmt.CacheMeta(
        target=settings["target"], revision=settings["revision"], config_hash=settings["config_hash"],
        tokenizer_hash=settings["tokenizer_hash"], layer_ids=settings["layer_ids"],
        hidden_size=settings["hidden_size"], num_target_layers=settings["num_target_layers"],
        storage_dtype=settings["storage_dtype"], max_length=settings["max_length"], world_size=len(partials),
        system_prompt=settings["system_prompt"], source={**settings["source"], "data_hash": settings["data_hash"]},
        chat_template_kwargs=settings.get("chat_template_kwargs", {}),
        data_format=settings.get("data_format", "chat"), chat_template=settings.get("chat_template"),
        counts=counts,
        fp8_rel_error=(fmt.relative_l2(joined.sq_error, joined.sq_reference)
                       if settings["storage_dtype"] == "fp8" else None),
        content=content, top_k=settings.get("top_k"),
        vocab_size=partials[0].get("vocab_size"),
        bytes_per_token=fmt.bytes_per_token(settings["hidden_size"], len(settings["layer_ids"]),
                                            settings["storage_dtype"], content, settings.get("top_k")))
