"""The on-disk contract of the target-feature cache: names, dtypes, index and metadata schema, fingerprint.

Everything a writer, reader, verifier or merger must agree on lives here (see FORMAT.md, which documents
the same contract for people). The writer writes FORMAT_VERSION and a reader refuses any other version.

Shape legend: T = tokens (of one sample or of a whole shard), H = target hidden size,
M = number of cached feature layers, F = M * H, K = top-k entries per token (top-k content).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deepspec.targets.layers import LAYER_ID_CONVENTION
from deepspec.utils.io import atomic_write_json, atomic_write_text, read_json, read_json_with_sha256, sha256_json

FORMAT_VERSION = 2
META_NAME = "meta.json"
INDEX_NAME = "index.json"
FINAL_HIDDEN_NORM = "post_norm"  # final_hidden is taken after the target's final norm

# Tensor names inside every shard; samples are concatenated along the token axis (dim 0).
TENSOR_INPUT_IDS = "input_ids"  # int32 [T]
TENSOR_LOSS_MASK = "loss_mask"  # uint8 [T]
TENSOR_FEATURES = "features"  # storage dtype [T, F]
TENSOR_FEATURES_SCALE = "features_scale"  # fp32 [T, M], fp8 only: dequantised = fp8 * scale per layer row
TENSOR_FINAL_HIDDEN = "final_hidden"  # bf16 (bf16/fp8 modes) or fp32 (fp32 mode) [T, H]
TENSOR_TARGET_LSE = "target_lse"  # fp32 [T]: logsumexp of the target's full-vocabulary logits
TENSOR_TOP_K_IDS = "top_k_ids"  # int32 [T, K], top-k content only: the target's K most likely next tokens
TENSOR_TOP_K_LOGPROBS = "top_k_logprobs"  # fp16 (bf16/fp8 modes) or fp32 (fp32 mode) [T, K], their log-probs

# What a cache stores per token besides ids and loss mask (`CacheMeta.content`):
CONTENT_HIDDEN = "hidden_states"  # features of `layer_ids` (none when empty) + the final hidden state (+ target_lse)
CONTENT_TOP_K = "top_k_logprobs"  # the target's top-k next-token ids and log-probs only (no hidden states)
CONTENTS = (CONTENT_HIDDEN, CONTENT_TOP_K)

STORAGE_DTYPES = ("bf16", "fp32", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value: a row's amax maps onto it
SPLITS = ("train", "validation", "test")
STAGE_DIR = ".online-stage"  # inside a cache folder: samples computed before a build shards them (stage.py)
# In meta.json, a partial index and the stage's settings: the sha256 of the record's other fields (`sealed`).
RECORD_SEAL = "record_sha256"


def shard_name(rank: int, shard_idx: int) -> str:
    return f"shard-r{rank:02d}-{shard_idx:05d}.safetensors"


def partial_index_name(rank: int) -> str:
    return f"index-r{rank}.json"


def lock_name(rank: int) -> str:
    """Lock file held by the process writing rank `rank` (deepspec.utils.locks)."""
    return f".lock-r{rank}"


# Exactly what shard_name() writes: a plain file name, so an index can never point outside its cache folder.
SHARD_NAME_PATTERN = re.compile(r"shard-r\d{2,}-\d{5,}\.safetensors")


def shard_name_problem(name: Any, where: str) -> str | None:
    """None for a name shard_name() could have written; else the problem, naming `where` (file and entry)."""
    if isinstance(name, str) and SHARD_NAME_PATTERN.fullmatch(name):
        return None
    return (f"{where}: shard name {name!r} is not a shard file name of this cache (shard-rRR-NNNNN.safetensors, "
            f"inside the cache folder); refusing to read it")


def check_shard_name(name: Any, where: str) -> str:
    problem = shard_name_problem(name, where)
    if problem:
        raise ValueError(problem)
    return name


def index_problems(index: Any, where: str) -> list[str]:
    """Structural problems of a parsed index.json: version, shard names, every sample's shard listed."""
    if not isinstance(index, dict):
        return [f"{where}: expected a JSON object"]
    if index.get("format_version") != FORMAT_VERSION:
        return [f"{where}: format_version={index.get('format_version')!r}, "
                f"this DeepSpec reads version {FORMAT_VERSION}"]
    shards, samples = index.get("shards"), index.get("samples")
    if not isinstance(shards, dict) or not isinstance(samples, list):
        return [f"{where}: needs a 'shards' object and a 'samples' list"]
    problems = [p for name in shards if (p := shard_name_problem(name, f"{where}: shards")) is not None]
    for k, sample in enumerate(samples):
        shard = sample.get("shard") if isinstance(sample, dict) else None
        problem = shard_name_problem(shard, f"{where}: samples[{k}].shard")
        if problem is None and shard not in shards:
            problem = f"{where}: samples[{k}].shard {shard!r} is not listed in 'shards'"
        if problem:
            problems.append(problem)
    return problems


def read_index(cache_dir: str | Path, expected_sha256: str | None = None) -> dict:
    """index.json of a finished cache, refused (naming the file and entries) unless index_problems() is empty and,
    given `expected_sha256` (meta.json's `index_sha256`), the bytes read have that digest."""
    path = Path(cache_dir) / INDEX_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: cache index missing")
    index, digest = read_json_with_sha256(path)
    problems = index_problems(index, str(path))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError("; ".join(problems[:5]) + more)
    problem = index_digest_problem(path, digest, expected_sha256)
    if problem:
        raise ValueError(problem)
    return index


def index_digest_problem(path: Path, digest: str, expected_sha256: str | None) -> str | None:
    if expected_sha256 is None or digest == expected_sha256:
        return None
    return (f"{path}: sha256 {digest[:16]}... differs from the one {path.parent / META_NAME} records "
            f"({str(expected_sha256)[:16]}...): the index is damaged. {REMERGE_HINT.format(path.parent)}")


REMERGE_HINT = ("`deepspec cache mode=merge cache.out_dir={}` writes index.json and meta.json again from the "
                "partial indices")


def sealed(record: dict) -> dict:
    """`record` with `RECORD_SEAL`: the sha256 of its other fields, so that a flipped byte which changes any value
    (and still parses) is found when it is read (`seal_problem`)."""
    body = {k: v for k, v in record.items() if k != RECORD_SEAL}
    return {**body, RECORD_SEAL: sha256_json(body)}


def seal_problem(record: Any, required: bool) -> str | None:
    """None for a record whose seal matches, or that has none and need not (written before records were sealed);
    else what is wrong with it."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if RECORD_SEAL not in record:
        return f"its {RECORD_SEAL} is missing" if required else None
    digest = sha256_json({k: v for k, v in record.items() if k != RECORD_SEAL})
    if digest != record[RECORD_SEAL]:
        recorded = str(record[RECORD_SEAL])
        return f"the sha256 of its fields, {digest[:16]}..., is not its {RECORD_SEAL} {recorded[:16]}..."
    return None


def check_storage_dtype(storage_dtype: str) -> str:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"cache.storage_dtype={storage_dtype!r} is not one of {list(STORAGE_DTYPES)}")
    return storage_dtype


def feature_torch_dtype(storage_dtype: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": FP8_DTYPE}[check_storage_dtype(storage_dtype)]


def final_hidden_torch_dtype(storage_dtype: str) -> torch.dtype:
    # fp8 is for the bulky layer features only; the final hidden feeds the target's LM head (TV loss).
    return torch.float32 if check_storage_dtype(storage_dtype) == "fp32" else torch.bfloat16


def top_k_logprobs_torch_dtype(storage_dtype: str) -> torch.dtype:
    # fp16, not bf16: log-probabilities lie in [-65504, 0] and fp16's 10-bit mantissa keeps p to ~0.05%.
    return torch.float32 if check_storage_dtype(storage_dtype) == "fp32" else torch.float16


def check_content(content: str, layer_ids, top_k: int | None) -> str:
    """A valid (content, layer ids, top_k) combination, or a ValueError naming the cache.* field."""
    if content not in CONTENTS:
        raise ValueError(f"cache.content={content!r} is not one of {list(CONTENTS)}")
    if content == CONTENT_TOP_K:
        if top_k is None or int(top_k) < 1:
            raise ValueError(f"cache.top_k={top_k!r} must be an int >= 1 with cache.content={CONTENT_TOP_K}")
        if list(layer_ids or []):
            raise ValueError(f"cache.layer_ids={list(layer_ids)}: a {CONTENT_TOP_K} cache stores no hidden states "
                             "(leave the layer ids empty)")
    return content


def bytes_per_token(hidden_size: int, num_feature_layers: int, storage_dtype: str, content: str = CONTENT_HIDDEN,
                    top_k: int | None = None) -> int:
    """Exact payload bytes per cached token: ids (4) + mask (1) + features (+ fp8 scales) + final hidden + the
    fp32 target log-normaliser (4), or, for top-k content, ids (4) + mask (1) + top_k x (id int32 + log-prob)."""
    if content == CONTENT_TOP_K:
        return 4 + 1 + int(top_k) * (4 + top_k_logprobs_torch_dtype(storage_dtype).itemsize)
    feature_bytes = feature_torch_dtype(storage_dtype).itemsize * hidden_size * num_feature_layers
    if storage_dtype == "fp8":
        feature_bytes += 4 * num_feature_layers  # one fp32 scale per token per layer
    final_bytes = final_hidden_torch_dtype(storage_dtype).itemsize * hidden_size
    return 4 + 1 + feature_bytes + final_bytes + 4


def shard_tensor_shapes(num_tokens: int, hidden_size: int, num_feature_layers: int, storage_dtype: str,
                        content: str = CONTENT_HIDDEN, top_k: int | None = None) -> dict[str, list[int]]:
    """The tensors a shard of `num_tokens` tokens holds and their shapes (FORMAT.md, "Shards")."""
    shapes = {TENSOR_INPUT_IDS: [num_tokens], TENSOR_LOSS_MASK: [num_tokens]}
    if content == CONTENT_TOP_K:
        shapes[TENSOR_TOP_K_IDS] = [num_tokens, int(top_k)]
        shapes[TENSOR_TOP_K_LOGPROBS] = [num_tokens, int(top_k)]
        return shapes
    if num_feature_layers:  # a final-hidden-only cache (no layer ids) stores no features tensor
        shapes[TENSOR_FEATURES] = [num_tokens, hidden_size * num_feature_layers]
        if storage_dtype == "fp8":
            shapes[TENSOR_FEATURES_SCALE] = [num_tokens, num_feature_layers]
    shapes[TENSOR_FINAL_HIDDEN] = [num_tokens, hidden_size]
    shapes[TENSOR_TARGET_LSE] = [num_tokens]
    return shapes


def quantize_fp8(features_TF: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn with one fp32 scale per (token, layer) row: scale = amax / 448."""
    num_tokens = features_TF.shape[0]
    rows_TMH = features_TF.float().reshape(num_tokens, num_layers, -1)
    amax_TM = rows_TMH.abs().amax(dim=-1)
    scale_TM = torch.where(amax_TM > 0, amax_TM / FP8_MAX, torch.ones_like(amax_TM))
    quantized_TMH = (rows_TMH / scale_TM.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized_TMH.reshape(num_tokens, -1), scale_TM


def dequantize_fp8(quantized_TF: torch.Tensor, scale_TM: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    num_tokens, num_layers = scale_TM.shape
    rows_TMH = quantized_TF.to(torch.float32).reshape(num_tokens, num_layers, -1) * scale_TM.unsqueeze(-1)
    return rows_TMH.reshape(num_tokens, -1).to(dtype)


@dataclass
class CacheMeta:
    """Contents of meta.json: what was cached, from what, and how to interpret it."""

    target: str
    revision: str
    config_hash: str
    tokenizer_hash: str
    layer_ids: list[int]
    hidden_size: int
    num_target_layers: int
    storage_dtype: str
    max_length: int | None
    world_size: int
    system_prompt: str | None
    source: dict[str, Any] = field(default_factory=dict)  # data spec, split fractions/seed, loader report
    counts: dict[str, Any] = field(default_factory=dict)  # samples, tokens, per split, skipped by reason
    fp8_rel_error: float | None = None  # relative L2 error of the dequantised features (fp8 only)
    bytes_per_token: int = 0  # expected payload bytes per token (bytes_per_token())
    layer_id_convention: str = LAYER_ID_CONVENTION
    final_hidden_norm: str = FINAL_HIDDEN_NORM
    content: str = CONTENT_HIDDEN  # what is stored per token besides ids and mask (CONTENTS)
    top_k: int | None = None  # top-k content: entries per token
    vocab_size: int | None = None  # the target's: every input and top-k id lies in [0, vocab_size) (None: not recorded)
    index_sha256: str | None = None  # of index.json's bytes (None: a cache written before it was recorded)
    system_prompt_rule: str = "deepspec.data.chat.render_conversation: nothing injected unless system_prompt is set"
    # template options every sample was rendered with
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    data_format: str = "chat"  # chat | text (deepspec.data.rendering); caches built before it was recorded are chat
    chat_template: str | None = None  # the template given in the target config (None: the tokenizer's own)
    format_version: int = FORMAT_VERSION

    @property
    def num_feature_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def tensor_names(self) -> list[str]:
        return list(shard_tensor_shapes(0, self.hidden_size, self.num_feature_layers, self.storage_dtype,
                                        self.content, self.top_k))

    def fingerprint(self) -> dict:
        return {"target": self.target, "revision": self.revision, "config_hash": self.config_hash,
                "tokenizer_hash": self.tokenizer_hash, "layer_ids": list(self.layer_ids)}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = META_NAME) -> CacheMeta:
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{where}: cache format_version={version!r}, this DeepSpec reads version "
                             f"{FORMAT_VERSION}: rebuild the cache with it")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(n for n in names if n not in data and
                         cls.__dataclass_fields__[n].default is dataclasses.MISSING and
                         cls.__dataclass_fields__[n].default_factory is dataclasses.MISSING)
        if missing:
            raise ValueError(f"{where}: missing fields {missing}")
        return cls(**{k: v for k, v in data.items() if k in names})


def read_meta(cache_dir: str | Path) -> CacheMeta:
    path = Path(cache_dir) / META_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a finished DeepSpec cache (no {META_NAME}; a build may still be "
                                f"running or need its merge step)")
    data = read_json(path)
    meta = CacheMeta.from_dict(data, where=str(path))
    # A meta.json that records the index digest was sealed too: a flip in either key's name is damage, not age.
    problem = seal_problem(data, required="index_sha256" in data)
    if problem:
        raise ValueError(f"{path}: damaged ({problem}). {REMERGE_HINT.format(path.parent)}")
    return meta


def write_index_and_meta(cache_dir: str | Path, index: dict, meta: CacheMeta) -> CacheMeta:
    """index.json, then meta.json (last: its presence marks a finished cache) recording the index's sha256 and
    sealed; returns the meta written."""
    text = json.dumps(index, indent=1) + "\n"
    atomic_write_text(Path(cache_dir) / INDEX_NAME, text)
    meta = dataclasses.replace(meta, index_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())
    atomic_write_json(Path(cache_dir) / META_NAME, sealed(meta.to_dict()))
    return meta


def check_cache_compatible(meta: CacheMeta, fingerprint: dict, layer_ids: list[int] | None = None,
                           where: str = "cache") -> None:
    """Refuse a cache built for another target/tokenizer/layer choice, naming every differing field.

    `fingerprint` is `LoadedTarget.fingerprint()` (target, revision, config_hash, tokenizer_hash), optionally
    with `layer_ids`; only the keys it holds are compared (e.g. leave out `revision` to accept a re-download).
    """
    expected = dict(fingerprint)
    if layer_ids is not None:
        expected["layer_ids"] = list(layer_ids)
    cached = meta.fingerprint()
    unknown = sorted(set(expected) - set(cached))
    if unknown:
        raise ValueError(f"expected fingerprint has unknown fields {unknown}; known: {sorted(cached)}")
    differences = [f"{key}: cache has {cached[key]!r}, configured {expected[key]!r}"
                   for key in expected if (list(expected[key]) if key == "layer_ids" else expected[key]) != cached[key]]
    if differences:
        raise ValueError(f"{where} does not match the configured target (rebuild the cache or fix the config): "
                         + "; ".join(differences))


def relative_l2(sum_sq_error: float, sum_sq_reference: float) -> float:
    return math.sqrt(sum_sq_error / sum_sq_reference) if sum_sq_reference > 0 else 0.0
