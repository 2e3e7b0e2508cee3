"""The typed config of the cache job (data_tools/cache_hiddens.py, `deepspec cache`): conf/cache_hiddens.yaml
is a delta over `CacheJobConfig`, stored in Hydra's ConfigStore as `cache_job_schema`.

`resolve_cache_config(cfg)` merges a composed config (or a plain dict) into the schema: an unknown key or a
wrong type fails naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, List, Optional

from omegaconf import DictConfig, OmegaConf

from deepspec.cache.format import check_content, check_storage_dtype
from deepspec.data.rendering import FORMATS, Rendering, RenderingOptions, resolve_chat_template
from deepspec.targets.config import TargetSchema
from deepspec.utils.config import compose_config, merge_into_schema
from deepspec.utils.faults import FaultInjection

# Where a training run's features come from (training's data.features; deepspec.cache.source): a finished cache,
# the target inside training, or the target in epoch 0 while writing the cache.
FEATURE_MODES = ("offline", "online", "hybrid")
ONLINE_BATCH_MODES = ("micro_batch", "sample")  # data.online_batch: one target forward per micro-batch, or per sample
# What runs the target's forward for a cache build: transformers in DeepSpec's process, or vLLM
# in its own environment (deepspec.cache.engine_source).
ENGINES = ("transformers", "vllm")
# The fixes a refusal of training's own rendering names, as training names its fields.
ONLINE_OPTIONS = RenderingOptions("data.source.format=text", "target.chat_template=<template text or file>",
                                  "data.cache.max_length")


@dataclass
class CacheDataSchema:
    # regenerated JSONL path (preferred: the target's own answers) | sharegpt | hf:<name>[:split]
    prompts: str = "sharegpt"
    limit: Optional[int] = None
    val_fraction: float = 0.01
    test_fraction: float = 0.0
    seed: int = 0
    system_prompt: Optional[str] = None  # same rule as regeneration/eval: nothing injected unless set
    # chat: the target's chat template renders conversations, the loss over the answers; text: plain text (a base
    # model), the loss over a record's text or completion (deepspec.data.rendering)
    format: str = "chat"

    where: ClassVar[str] = "data"  # how a message names these fields (training reads them as data.source)

    def __post_init__(self) -> None:
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 1):
            raise ValueError(f"{self.where}.limit={self.limit!r} reads no conversation: set a positive number of "
                             "conversations to read, or null for all of them")


# The default target's cache folder (cache.out_dir, data.cache_dir); the Hydra configs write
# outputs/cache/<target choice>.
DEFAULT_CACHE_DIR = "outputs/cache/smollm2-135m"


@dataclass
class CacheSchema:
    out_dir: str = DEFAULT_CACHE_DIR  # conf/cache_hiddens.yaml: outputs/cache/<target choice>
    layer_ids: Optional[List[int]] = None  # "output of decoder layer l" ids; null: target.layer_ids, else the spread;
    # [] = no layer features (final hidden only: MTP, standalone drafters)
    content: str = "hidden_states"  # hidden_states | top_k_logprobs (ids, mask, the target's top-k next tokens only)
    top_k: int = 64  # top_k_logprobs: entries kept per token
    num_feature_layers: int = 5  # the spread's size when no ids are given (DFlash/DSpark read 5, Eagle3 3 of them)
    max_length: Optional[int] = 2048
    storage_dtype: str = "bf16"  # bf16 | fp32 | fp8 (e4m3 layer features with per-row fp32 scale; final hidden bf16)
    shard_size_mb: float = 256
    batch_size: int = 8
    batch_tokens: Optional[int] = None  # optional cap on padded tokens per batch
    resume: bool = True
    progress: bool = True
    # transformers | vllm (the job's `vllm:` settings; deepspec.cache.engine_source)
    engine: str = "transformers"

    where: ClassVar[str] = "cache"  # how a message names these fields (training reads them as data.cache)

    def __post_init__(self) -> None:
        """The one validation of the cache options, whoever builds them (the cache job, training's data.cache, a
        `BuildJob`)."""
        try:
            check_storage_dtype(self.storage_dtype)
            check_content(self.content, self.layer_ids, self.top_k)
        except ValueError as e:  # the format's messages name cache.<field>
            raise ValueError(str(e).replace("cache.", f"{self.where}.", 1)) from None
        if not self.shard_size_mb > 0:
            raise ValueError(f"{self.where}.shard_size_mb={self.shard_size_mb} must be positive")
        if self.max_length is not None and self.max_length <= 0:
            raise ValueError(f"{self.where}.max_length={self.max_length} must be positive or null")
        if self.batch_size < 1:
            raise ValueError(f"{self.where}.batch_size={self.batch_size} must be positive")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError(f"{self.where}.batch_tokens={self.batch_tokens} must be positive or null")
        if self.num_feature_layers < 0:
            raise ValueError(f"{self.where}.num_feature_layers={self.num_feature_layers} must be >= 0")
        if self.engine not in ENGINES:
            raise ValueError(f"{self.where}.engine={self.engine!r} must be one of {list(ENGINES)}")


@dataclass
class VllmCaptureSchema:
    """How `cache.engine=vllm` runs vLLM (deepspec.cache.engine_source): one engine per cache
    rank."""

    # vLLM's python (null: $DEEPSPEC_VLLM_PYTHON, else .venv-vllm/bin/python)
    python: Optional[str] = None
    # GPUs one engine shards the target over (vLLM's --tensor-parallel-size)
    tensor_parallel_size: int = 1
    threads: int = 1  # CPU build: OpenMP threads of the engine
    kv_cache_gib: int = 4  # CPU build: KV cache memory (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = 0.9  # GPU build: share of each GPU's memory vLLM may take
    # samples the engine computes at once (cache.batch_size samples go in each request)
    max_num_seqs: int = 64
    max_num_batched_tokens: Optional[int] = None  # tokens per engine step (null: vLLM's default)
    start_timeout_s: float = 1800.0  # loading a large target takes minutes

    where: ClassVar[str] = "vllm"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "threads", "kv_cache_gib", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{self.where}.{name}={getattr(self, name)} must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{self.where}.gpu_memory_utilization="
                             f"{self.gpu_memory_utilization} must be in (0, 1]")


@dataclass
class CacheJobConfig:
    mode: str = "build"  # build | estimate (print size, exit) | verify (checksums) | merge (join rank indices)
    target: TargetSchema = field(default_factory=TargetSchema)
    data: CacheDataSchema = field(default_factory=CacheDataSchema)
    cache: CacheSchema = field(default_factory=CacheSchema)
    # read with cache.engine=vllm
    vllm: VllmCaptureSchema = field(default_factory=VllmCaptureSchema)
    faults: FaultInjection = field(default_factory=FaultInjection)  # tests only (deepspec.utils.faults)


def register_cache_configs() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="cache_job_schema", node=CacheJobConfig)
    store.store(group="target", name="base_target", node=TargetSchema)


def compose_cache_config(overrides: list[str] = (), config_dir: str | Path | None = None) -> DictConfig:
    """Compose `cache_hiddens.yaml` as the cache script would (deepspec.utils.config.compose_config)."""
    register_cache_configs()
    return compose_config("cache_hiddens", overrides, config_dir, what="cache job config")


def _schema(user: DictConfig) -> DictConfig:
    schema = OmegaConf.structured(CacheJobConfig)
    OmegaConf.set_struct(schema, True)
    OmegaConf.set_struct(schema.target.chat_template_kwargs, False)  # free-form: read by the chat template
    return schema


def resolve_cache_config(cfg: DictConfig | dict | CacheJobConfig) -> CacheJobConfig:
    """Merge a composed config into the schema (unknown keys and wrong types fail) -> `CacheJobConfig`."""
    if isinstance(cfg, CacheJobConfig):
        return cfg
    return merge_into_schema(cfg, _schema, what="cache job config")


def data_rendering(data_cfg: CacheDataSchema | Mapping, target_cfg: TargetSchema | Mapping,
                   prefix: str = "data") -> Rendering:
    """The rendering of a cache job's `data:` section and `target:` (training's data.source: prefix "data.source")."""
    def get(cfg: Any, key: str):
        return cfg.get(key) if isinstance(cfg, Mapping) else getattr(cfg, key)

    data_format, system_prompt = get(data_cfg, "format"), get(data_cfg, "system_prompt")
    if data_format not in FORMATS:
        raise ValueError(f"{prefix}.format={data_format!r} must be one of {list(FORMATS)}")
    if data_format == "text" and system_prompt is not None:
        raise ValueError(f"{prefix}.system_prompt is set but {prefix}.format=text renders no system prompt: "
                         "unset one of them")
    template = get(target_cfg, "chat_template") if data_format == "chat" else None
    return Rendering(format=data_format, chat_template=resolve_chat_template(template, "target.chat_template"),
                     chat_template_kwargs=dict(get(target_cfg, "chat_template_kwargs") or {}),
                     system_prompt=system_prompt)
