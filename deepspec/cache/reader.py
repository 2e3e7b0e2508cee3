"""Random access to a finished feature cache, fingerprint checks, and whole-cache verification.

Shards are opened with `safetensors.safe_open(framework="pt")` (memory-mapped); a sample is read with
`get_slice(name)[offset:offset + length]`, which touches only that sample's bytes, never a whole shard.
Shard handles are opened lazily per process, so a reader can be handed to DataLoader workers.

Trust: meta.json is sealed and records index.json's sha256 (`deepspec.cache.format.read_meta`, `read_index`): a
flipped byte in either (an offset that would hand training another sample's rows, a layer id) is refused before a
sample is read. Before a shard is first used in a process its sha256 is checked against index.json (once per
shard file per process: a flipped byte never trains silently), and every input id and top-k id read is
checked to lie in [0, vocab_size) (the reader's `vocab_size`, else the one meta.json records), naming the
shard, sample and position: a shard written with the right checksum but wrong ids (another target's, a bug)
stops here, not inside a loss.

Shape legend: T = tokens of one sample, H = target hidden size, M = feature layers, F = M * H,
K = top-k entries per token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from deepspec.cache import format as fmt
from deepspec.utils.io import read_json_with_sha256, sha256_file

log = logging.getLogger(__name__)

UNKNOWN_NEXT = -1  # `target_next_tokens` at positions whose next token is not supervised
MAX_ID_PROBLEMS_PER_SHARD = 3  # samples with out-of-range ids named per shard (the rest counted as "more")
# Shard files whose checksum this process has verified: (real path, expected sha256, size, mtime_ns).
_VERIFIED_SHARDS: set[tuple[str, str, int, int]] = set()


def verify_shard_checksum(shard_path: Path, info: dict, index_path: Path) -> None:
    """Raise unless the shard's size and sha256 are the ones index.json records; each file once per process."""
    stat = shard_path.stat()
    key = (str(shard_path.resolve()), info["sha256"], stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED_SHARDS:
        return
    digest = sha256_file(shard_path) if stat.st_size == info["num_bytes"] else None
    if digest != info["sha256"]:
        found = f"sha256 {digest[:16]}..." if digest else f"size {stat.st_size} B (index: {info['num_bytes']} B)"
        raise ValueError(f"{shard_path}: {found} differs from {index_path} (sha256 {info['sha256'][:16]}...): the "
                         f"shard is corrupt. Run `deepspec cache mode=verify cache.out_dir="
                         f"{shard_path.parent}` and rebuild (a resumed build redoes corrupt shards)")
    _VERIFIED_SHARDS.add(key)


@dataclass
class CachedSample:
    sample_id: str
    input_ids: torch.Tensor  # long [T]
    loss_mask: torch.Tensor  # bool [T]
    # [T, F]: float32 by default; the stored dtype with CacheReader(dtype=None); F = 0 without layers
    features: torch.Tensor
    final_hidden: torch.Tensor | None  # [T, H], after the target's final norm; None in a top-k cache
    features_scale: torch.Tensor | None = None  # fp32 [T, M]: only for raw fp8 features (dtype=None)
    target_lse: torch.Tensor | None = None  # fp32 [T]: the target's log-normaliser (None in a top-k cache)
    top_k_ids: torch.Tensor | None = None  # long [T, K]: top-k cache only, the target's most likely next tokens
    top_k_logprobs: torch.Tensor | None = None  # [T, K] their log-probs (float32 by default)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


def sample_from_stored(sample_id: str, length: int, read: Callable[[str], torch.Tensor], stored: set[str],
                       dtype: torch.dtype | None, input_ids: Callable[[torch.Tensor], torch.Tensor],
                       top_k_ids: Callable[[torch.Tensor], torch.Tensor] | None = None) -> CachedSample:
    """A `CachedSample` from one sample's stored tensors (`read(name)`; `stored`: the names the content holds),
    converted to `dtype` (None: as stored). The one conversion from stored bytes to what training sees: the
    reader and online training (deepspec.cache.online) both use it, so both give the same tensors.
    `input_ids` / `top_k_ids` turn the stored ids into long tensors (the reader range-checks them there)."""
    input_ids_T = input_ids(read(fmt.TENSOR_INPUT_IDS))
    float_dtype = dtype or torch.float32
    if fmt.TENSOR_FEATURES in stored:
        features_TF = read(fmt.TENSOR_FEATURES)
    else:  # no cached layers: an empty feature matrix, so consumers need no special case
        features_TF = torch.zeros(length, 0, dtype=float_dtype)
    final_hidden_TH = read(fmt.TENSOR_FINAL_HIDDEN) if fmt.TENSOR_FINAL_HIDDEN in stored else None
    scale_TM = read(fmt.TENSOR_FEATURES_SCALE) if fmt.TENSOR_FEATURES_SCALE in stored else None
    lse_T = read(fmt.TENSOR_TARGET_LSE) if fmt.TENSOR_TARGET_LSE in stored else None
    top_k_ids_TK = ((top_k_ids or torch.Tensor.long)(read(fmt.TENSOR_TOP_K_IDS)) if fmt.TENSOR_TOP_K_IDS in stored
                    else None)
    top_k_logprobs_TK = read(fmt.TENSOR_TOP_K_LOGPROBS) if fmt.TENSOR_TOP_K_LOGPROBS in stored else None
    if dtype is not None:
        if scale_TM is not None:
            features_TF, scale_TM = fmt.dequantize_fp8(features_TF, scale_TM, dtype), None
        else:
            features_TF = features_TF.to(dtype)
        final_hidden_TH = None if final_hidden_TH is None else final_hidden_TH.to(dtype)
        top_k_logprobs_TK = None if top_k_logprobs_TK is None else top_k_logprobs_TK.to(dtype)
    return CachedSample(sample_id=sample_id, input_ids=input_ids_T, loss_mask=read(fmt.TENSOR_LOSS_MASK).bool(),
                        features=features_TF, final_hidden=final_hidden_TH, features_scale=scale_TM,
                        target_lse=lse_T, top_k_ids=top_k_ids_TK, top_k_logprobs=top_k_logprobs_TK)


class SampleIndex:
    """Sample bookkeeping over `self.samples` (the index's records: length, split) and the defaults of the
    `FeatureSource` interface (deepspec.cache.source): what the cache reader and the online and hybrid feature
    sources answer alike."""

    samples: list[dict]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(s["length"] for s in self.samples)

    def split(self, name: str) -> list[int]:
        if name not in fmt.SPLITS:
            raise ValueError(f"split {name!r} is not one of {list(fmt.SPLITS)}")
        return [i for i, s in enumerate(self.samples) if s["split"] == name]

    def lengths(self) -> list[int]:
        return [s["length"] for s in self.samples]

    def target_next_tokens(self, i: int, head_VH: torch.Tensor) -> torch.Tensor | None:
        """The target's argmax next token after each position of sample i whose next token is supervised [T]
        (UNKNOWN_NEXT elsewhere), where the source stores the target's outputs; None here (online features: they
        exist only once training computes them)."""
        return None

    # What training asks of every source (deepspec.training.data); a cache answers from its shards.
    def batch(self, ids: list[int]) -> list[CachedSample]:
        """Samples `ids` (one micro-batch), in order; an online source computes them in one target forward."""
        return [self[i] for i in ids]

    def expect_batches(self, train_batches: list[list[int]], val_batches: list[list[int]]) -> None:
        """The micro-batches training will ask for: epoch 0's (in order) and validation's (every validation). An
        online source keeps validation's samples once computed; hybrid plans its cache's batches with them."""
        return None

    def start_epoch(self, epoch: int) -> None:
        """Training calls it as each epoch starts (hybrid finishes its cache when epoch 1 starts)."""
        return None

    def acquire_lock(self) -> None:
        """Training calls it once the source is open: a source that writes its cache holds the writer's lock."""
        return None

    def finish(self) -> None:
        """Training calls it when training ends (also inside epoch 0): hybrid writes the rest of its cache."""
        return None

    def close(self) -> None:
        """Training calls it when the run ends: a source releases what `acquire_lock` took."""
        return None


@torch.no_grad()
def argmax_next_tokens(final_hidden_TH: torch.Tensor, head_VH: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """The target's argmax next token after every position: its frozen LM head on the final hidden state [T]."""
    out = [(final_hidden_TH[i:i + chunk_rows].to(head_VH.dtype) @ head_VH.T).argmax(dim=-1)
           for i in range(0, final_hidden_TH.shape[0], chunk_rows)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


class CacheReader(SampleIndex):
    """`reader[i]` is the i-th cached sample in global order (train, validation, test as cached)."""

    def __init__(self, cache_dir: str | Path, expected_fingerprint: dict | None = None,
                 dtype: torch.dtype | None = torch.float32, vocab_size: int | None = None,
                 verify_checksums: bool = True):
        self.path = Path(cache_dir)
        self.meta = fmt.read_meta(self.path)
        if expected_fingerprint is not None:
            fmt.check_cache_compatible(self.meta, expected_fingerprint, where=f"cache {self.path}")
        index = fmt.read_index(self.path, expected_sha256=self.meta.index_sha256)
        self.samples: list[dict] = index["samples"]
        self.shards: dict[str, dict] = index["shards"]
        self._stored_tensors = set(self.meta.tensor_names)  # what this cache's content stores per token
        self.dtype = dtype
        # token ids read are checked against it (training passes the target's; else the cache's record)
        self.vocab_size = vocab_size if vocab_size is not None else self.meta.vocab_size
        self.verify_checksums = verify_checksums
        self._handles: dict[str, object] = {}


    def _handle(self, shard: str):
        if shard not in self._handles:
            if self.verify_checksums:
                verify_shard_checksum(self.path / shard, self.shards[shard], self.path / fmt.INDEX_NAME)
            self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return self._handles[shard]

    def _checked_ids(self, i: int, entry: dict, ids: torch.Tensor, what: str) -> torch.Tensor:
        """`ids` ([T] input ids or [T, K] top-k ids of sample i), refused when one lies outside the vocabulary."""
        problem = id_range_problem(ids, self.vocab_size, what)
        if problem:
            raise ValueError(f"{self.path / entry['shard']}: sample {i} (id {entry['id']!r}) {problem}: corrupt or "
                             f"built for another target (`deepspec cache mode=verify cache.out_dir={self.path}` "
                             "checks every shard)")
        return ids.long()

    def _input_ids(self, i: int, entry: dict, ids_T: torch.Tensor) -> torch.Tensor:
        return self._checked_ids(i, entry, ids_T, "input")

    def __getitem__(self, i: int) -> CachedSample:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for a cache of {len(self)} samples")
        entry = self.samples[i]
        handle = self._handle(entry["shard"])
        rows = slice(entry["offset"], entry["offset"] + entry["length"])

        def read(name: str) -> torch.Tensor:
            return handle.get_slice(name)[rows]

        return sample_from_stored(entry["id"], entry["length"], read, self._stored_tensors, self.dtype,
                                  lambda ids_T: self._input_ids(i, entry, ids_T),
                                  lambda ids_TK: self._checked_ids(i, entry, ids_TK, "top-k"))

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T], loss_mask [T]) of sample i without reading its features (token statistics)."""
        entry = self.samples[i]
        handle = self._handle(entry["shard"])
        rows = slice(entry["offset"], entry["offset"] + entry["length"])
        return (self._input_ids(i, entry, handle.get_slice(fmt.TENSOR_INPUT_IDS)[rows]),
                handle.get_slice(fmt.TENSOR_LOSS_MASK)[rows].bool())

    def target_next_tokens(self, i: int, head_VH: torch.Tensor) -> torch.Tensor:
        """The target's argmax next token after each position of sample i whose next token is supervised [T]
        (UNKNOWN_NEXT elsewhere): the LM head `head_VH` on the stored final hidden state (computed at those
        positions only), or a top-k cache's first id; reads neither the features nor the other tensors."""
        entry = self.samples[i]
        handle = self._handle(entry["shard"])
        rows = slice(entry["offset"], entry["offset"] + entry["length"])
        counted_T = torch.zeros(entry["length"], dtype=torch.bool)
        counted_T[:-1] = handle.get_slice(fmt.TENSOR_LOSS_MASK)[rows].bool()[1:]
        next_T = torch.full((entry["length"],), UNKNOWN_NEXT, dtype=torch.long)
        if fmt.TENSOR_FINAL_HIDDEN in self._stored_tensors:
            final_hidden_TH = handle.get_slice(fmt.TENSOR_FINAL_HIDDEN)[rows]
            next_T[counted_T] = argmax_next_tokens(final_hidden_TH[counted_T], head_VH)
        else:
            top_k_TK = self._checked_ids(i, entry, handle.get_slice(fmt.TENSOR_TOP_K_IDS)[rows], "top-k")
            next_T[counted_T] = top_k_TK[counted_T, 0]
        return next_T

    def __getstate__(self):  # open shard handles are per process (DataLoader workers reopen them)
        state = dict(self.__dict__)
        state["_handles"] = {}
        return state


def id_range_problem(ids: torch.Tensor, vocab_size: int | None, what: str) -> str | None:
    """Where `ids` ([T] or [T, K]) first leaves [0, vocab_size) (only `>= 0` without a vocab_size), or None."""
    if not ids.numel():
        return None
    bad = ids < 0 if vocab_size is None else (ids < 0) | (ids >= vocab_size)
    if not bool(bad.any()):
        return None
    where = [int(x) for x in bad.nonzero()[0]]
    value = int(ids[tuple(where)])
    position = f"token {where[0]}" + (f" top-k entry {where[1]}" if len(where) > 1 else "")
    bounds = f"[0, {vocab_size})" if vocab_size is not None else "ids >= 0"
    return (f"{position} has {what} id {value}, outside the target vocabulary {bounds} (out of range: "
            f"{int(bad.sum())} of its {ids.numel()} {what} ids)")


def verify_cache(cache_dir: str | Path) -> list[str]:
    """Every problem found (empty list = OK): checksums, sizes, tensor shapes, token ids in the vocabulary,
    index/shard consistency."""
    cache_dir = Path(cache_dir)
    try:
        meta = fmt.read_meta(cache_dir)
        index, index_sha256 = read_json_with_sha256(cache_dir / fmt.INDEX_NAME)
    except (FileNotFoundError, ValueError) as err:
        return [str(err)]
    problems = fmt.index_problems(index, str(cache_dir / fmt.INDEX_NAME))
    if problems:  # a bad version, or a name that could point outside the cache folder: nothing is read
        return problems
    digest_problem = fmt.index_digest_problem(cache_dir / fmt.INDEX_NAME, index_sha256, meta.index_sha256)
    if digest_problem:  # the shards are still checked: a damaged index alone is rewritten by a merge
        problems.append(digest_problem)
    shards: dict[str, dict] = index["shards"]
    samples: list[dict] = index["samples"]
    verified: set[str] = set()
    for name, info in shards.items():
        shard_path = cache_dir / name
        if not shard_path.is_file():
            problems.append(f"{name}: shard file missing")
            continue
        size = shard_path.stat().st_size
        if size != info["num_bytes"]:
            problems.append(f"{name}: size {size} B, index says {info['num_bytes']} B")
        digest = sha256_file(shard_path)
        if digest != info["sha256"]:
            problems.append(f"{name}: sha256 mismatch (corrupt shard): file {digest[:16]}..., "
                            f"index {info['sha256'][:16]}...")
            continue
        shape_problems = _check_shard_tensors(shard_path, info["num_tokens"], meta)
        problems += shape_problems
        if not shape_problems:
            verified.add(name)
    for shard_file in sorted(cache_dir.glob("shard-r*.safetensors")):
        if shard_file.name not in shards:
            problems.append(f"{shard_file.name}: shard on disk is not in {fmt.INDEX_NAME}")

    by_shard: dict[str, list[dict]] = {}
    for sample in samples:  # index_problems() checked that every sample's shard is listed
        by_shard.setdefault(sample["shard"], []).append(sample)
    for name, info in shards.items():
        spans = sorted((s["offset"], s["length"]) for s in by_shard.get(name, []))
        covered = 0
        for offset, length in spans:
            if offset != covered or length <= 0:
                problems.append(f"{name}: samples do not tile the shard (gap or overlap at token {offset})")
                break
            covered += length
        else:
            if covered != info["num_tokens"]:
                problems.append(f"{name}: samples cover {covered} tokens, shard holds {info['num_tokens']}")
        if len(spans) != info["num_samples"]:
            problems.append(f"{name}: index lists {len(spans)} samples, shard entry says {info['num_samples']}")
        if name in verified:
            problems += _check_shard_ids(cache_dir / name, samples, by_shard.get(name, []), meta)
    num_tokens = sum(s["length"] for s in samples)
    if meta.counts.get("samples") != len(samples) or meta.counts.get("tokens") != num_tokens:
        problems.append(f"{fmt.META_NAME} counts ({meta.counts.get('samples')} samples, {meta.counts.get('tokens')} "
                        f"tokens) differ from {fmt.INDEX_NAME} ({len(samples)} samples, {num_tokens} tokens)")
    return problems


def _check_shard_ids(shard_path: Path, samples: list[dict], shard_samples: list[dict], meta: fmt.CacheMeta
                     ) -> list[str]:
    """Input and top-k ids of one shard outside the vocabulary, each sample named (index and id) with its position."""
    problems = []
    global_index = {id(s): i for i, s in enumerate(samples)}
    with safe_open(str(shard_path), framework="pt") as handle:
        for tensor, what in ((fmt.TENSOR_INPUT_IDS, "input"), (fmt.TENSOR_TOP_K_IDS, "top-k")):
            if tensor not in meta.tensor_names:
                continue
            ids = handle.get_tensor(tensor)
            found = []
            for sample in sorted(shard_samples, key=lambda s: s["offset"]):
                problem = id_range_problem(ids[sample["offset"]:sample["offset"] + sample["length"]],
                                           meta.vocab_size, what)
                if problem:
                    found.append(f"{shard_path.name}: sample {global_index[id(sample)]} (id {sample['id']!r}) "
                                 f"{problem}")
            problems += found[:MAX_ID_PROBLEMS_PER_SHARD]
            if len(found) > MAX_ID_PROBLEMS_PER_SHARD:
                problems.append(f"{shard_path.name}: {len(found) - MAX_ID_PROBLEMS_PER_SHARD} more samples with {what} "
                                "ids outside the vocabulary")
    return problems


def _check_shard_tensors(shard_path: Path, num_tokens: int, meta: fmt.CacheMeta) -> list[str]:
    expected = fmt.shard_tensor_shapes(num_tokens, meta.hidden_size, meta.num_feature_layers, meta.storage_dtype,
                                       meta.content, meta.top_k)
    problems = []
    try:
        with safe_open(str(shard_path), framework="pt") as handle:
            for name, shape in expected.items():
                if name not in handle.keys():  # safe_open has no __contains__
                    problems.append(f"{shard_path.name}: tensor {name!r} missing")
                elif list(handle.get_slice(name).get_shape()) != shape:
                    problems.append(f"{shard_path.name}: tensor {name!r} has shape "
                                    f"{handle.get_slice(name).get_shape()}, expected {shape}")
    except Exception as err:  # any parse failure of a shard is a finding, not a crash
        problems.append(f"{shard_path.name}: unreadable safetensors file ({err})")
    return problems
