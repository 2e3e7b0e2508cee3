"""Shard I/O of one rank: buffer stored samples and write each shard atomically (temp file + rename, fsynced), keep
the rank's partial index (`index-r{rank}.json`, sealed, rewritten after every shard) and, on resume, keep the shards
it lists whose sha256 verifies while deleting everything else the rank wrote (unlisted or corrupt shards, temp files).

A shard ends at a batch boundary once it holds `shard_size_mb` of payload, and its bytes are a function of its
samples alone (one metadata key: safetensors writes a metadata map in arbitrary order), so a resumed build writes
the same shards as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_save

from deepspec.cache import format as fmt
from deepspec.cache.capture import fp8_error_sums, stored_sample_tensors
from deepspec.cache.plan import PlannedSample
from deepspec.cache.settings import settings_differences
from deepspec.utils.io import atomic_path, atomic_write_json, read_json, sha256_file

log = logging.getLogger(__name__)


class ShardWriter:
    """Buffers stripped samples and writes one safetensors shard (temp + rename) per ~shard_size bytes."""

    def __init__(self, out_dir: Path, rank: int, storage_dtype: str, num_feature_layers: int,
                 shard_size_bytes: int, next_shard_idx: int, content: str = fmt.CONTENT_HIDDEN):
        self.out_dir, self.rank, self.storage_dtype = out_dir, rank, storage_dtype
        self.content = content
        self.num_feature_layers = num_feature_layers
        self.shard_size_bytes = shard_size_bytes
        self.next_shard_idx = next_shard_idx
        self._clear()

    def _clear(self) -> None:
        self.tensors: dict[str, list[torch.Tensor]] = {}
        self.entries: list[dict] = []
        self.num_tokens = 0
        self.num_bytes = 0
        self.fp8_sq_error = 0.0
        self.fp8_sq_reference = 0.0

    def add(self, sample: PlannedSample, features_TF: torch.Tensor, final_hidden_TH: torch.Tensor,
            target_lse_T: torch.Tensor | None = None, top_k: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Buffer one sample: its features, final hidden and target log-normaliser (hidden-state content), or
        `top_k` = (ids [T, K], log-probs [T, K]) of the target's next-token distribution (top-k content)."""
        stored = stored_sample_tensors(sample, features_TF, final_hidden_TH, target_lse_T, top_k,
                                       content=self.content, storage_dtype=self.storage_dtype,
                                       num_feature_layers=self.num_feature_layers)
        self.add_stored(sample, stored, *fp8_error_sums(features_TF, stored))

    def add_stored(self, sample: PlannedSample, stored: Mapping[str, torch.Tensor], fp8_sq_error: float = 0.0,
                   fp8_sq_reference: float = 0.0) -> None:
        """Buffer one sample already converted to its stored tensors (`stored_sample_tensors`): what `add` does
        after the conversion, and what a hybrid training run hands over from its staged samples."""
        self.fp8_sq_error += fp8_sq_error
        self.fp8_sq_reference += fp8_sq_reference
        for name, tensor in stored.items():
            self.tensors.setdefault(name, []).append(tensor.contiguous())
            self.num_bytes += tensor.numel() * tensor.element_size()
        self.entries.append({"position": sample.position, "id": sample.sample_id, "split": sample.split,
                             "offset": self.num_tokens, "length": sample.length,
                             "num_loss_tokens": int(sample.loss_mask.sum())})
        self.num_tokens += sample.length

    @property
    def full(self) -> bool:
        return self.num_bytes >= self.shard_size_bytes

    def flush(self) -> dict | None:
        """Write the buffered samples as one shard; return its partial-index entry (None if empty)."""
        if not self.entries:
            return None
        name = fmt.shard_name(self.rank, self.next_shard_idx)
        tensors = {}
        for key in list(self.tensors):  # free each list of pieces once concatenated: ~2x shard size peak, not 3x
            tensors[key] = torch.cat(self.tensors.pop(key), dim=0)
        # One metadata key: safetensors serialises the metadata map in arbitrary order, and resumed shards
        # must be byte-identical to those of an uninterrupted run.
        header = {"format_version": fmt.FORMAT_VERSION, "rank": self.rank, "storage_dtype": self.storage_dtype}
        # absent = hidden states (shards of earlier versions stay byte-identical)
        if self.content != fmt.CONTENT_HIDDEN:
            header["content"] = self.content
        metadata = {"deepspec_cache": json.dumps(header, sort_keys=True)}
        payload = safetensors_save(tensors, metadata=metadata)
        del tensors
        with atomic_path(self.out_dir / name, len(payload)) as tmp, open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        entry = {"file": name, "sha256": hashlib.sha256(payload).hexdigest(), "num_bytes": len(payload),
                 "num_tokens": self.num_tokens, "fp8_sq_error": self.fp8_sq_error,
                 "fp8_sq_reference": self.fp8_sq_reference, "samples": self.entries}
        self.next_shard_idx += 1
        self._clear()
        return entry


def _remove_leftovers(out_dir: Path, rank: int) -> None:
    """Temp files of this rank from a killed run (atomic_path names them '.<final name>.<random>.tmp')."""
    for pattern in (f".shard-r{rank:02d}-*.tmp", f".{fmt.partial_index_name(rank)}.*.tmp"):
        for path in out_dir.glob(pattern):
            path.unlink()


def kept_after_failure(out_dir: Path, rank: int) -> str:
    """What a build of this rank that stops now leaves for a rerun: the shards its partial index lists."""
    path = out_dir / fmt.partial_index_name(rank)
    try:
        shards = read_json(path)["shards"]
    except (OSError, ValueError, KeyError, TypeError):
        shards = []
    if not shards:
        return f"no shard of rank {rank} was complete yet (rerunning the same command starts over)"
    num_samples = sum(len(entry["samples"]) for entry in shards)
    return (f"the {len(shards)} complete shard(s) listed in {path.name} ({num_samples} samples) are kept (rerunning "
            "the same command resumes after them)")


# The fields a partial index has ever had: one without a seal but with another field had its seal's name damaged.
PARTIAL_INDEX_FIELDS = frozenset({"format_version", "rank", "world_size", "settings", "vocab_size", "complete",
                                  "stats", "shards"})


def read_partial_index(path: Path, rank: int) -> dict:
    """The partial index of `rank`, refused (naming it, before anything is deleted) when its seal fails: the shards
    it lists and where each sample lies in them are what resume keeps and the merge writes into index.json."""
    partial = read_json(path)
    required = isinstance(partial, dict) and bool(set(partial) - PARTIAL_INDEX_FIELDS)
    problem = fmt.seal_problem(partial, required)
    if problem:
        raise ValueError(f"{path}: damaged ({problem}): the shards it lists cannot be trusted; delete it and build "
                         f"again (rank {rank}'s samples are then computed again)")
    return partial


def load_resume_state(out_dir: Path, rank: int, settings: dict, resume: bool) -> list[dict]:
    """Verified shard entries of an earlier run of this rank; deletes everything else this rank wrote."""
    partial_path = out_dir / fmt.partial_index_name(rank)
    partial = read_partial_index(partial_path, rank) if resume and partial_path.is_file() else None
    _remove_leftovers(out_dir, rank)
    kept: list[dict] = []
    if partial is not None:
        if partial.get("settings") != settings:
            differing = settings_differences(partial.get("settings") or {}, settings)
            raise ValueError(f"{out_dir}: an earlier build of rank {rank} used different settings "
                             f"({'; '.join(differing)}); use another cache.out_dir or resume=False to rebuild")
        for k, entry in enumerate(partial["shards"]):
            shard_path = out_dir / fmt.check_shard_name(entry["file"], f"{partial_path}: shards[{k}].file")
            if shard_path.is_file() and sha256_file(shard_path) == entry["sha256"]:
                kept.append(entry)
            else:
                log.warning("rank %d: shard %s is missing or fails its checksum; its samples are redone",
                            rank, entry["file"])
    elif partial_path.is_file():
        partial_path.unlink()
    kept_files = {e["file"] for e in kept}
    for path in out_dir.glob(f"shard-r{rank:02d}-*.safetensors"):
        if path.name not in kept_files:
            path.unlink()
    if rank == 0:  # the merged view is rewritten by the merge at the end of this build
        for name in (fmt.META_NAME, fmt.INDEX_NAME):
            if (out_dir / name).is_file():
                (out_dir / name).unlink()
    return kept


def write_partial_index(out_dir: Path, rank: int, settings: dict, shards: list[dict],
                         stats: dict | None, vocab_size: int) -> None:
    # vocab_size beside the settings, not in them: the config hash already pins it, and a partial build of an
    # earlier version (without it) still resumes.
    atomic_write_json(out_dir / fmt.partial_index_name(rank),
                      fmt.sealed({"format_version": fmt.FORMAT_VERSION, "rank": rank,
                                  "world_size": settings["world_size"], "settings": settings, "vocab_size": vocab_size,
                                  "complete": stats is not None, "stats": stats, "shards": shards}), indent=1)
