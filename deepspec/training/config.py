"""Typed training configuration: dataclass schemas for every `conf/` group and the checks run before any weights load.

`resolve_config(cfg)` merges the Hydra-composed `DictConfig` into the schemas (struct mode: an unknown key or
a wrong type fails, naming the key) and returns a `TrainConfig`. `plan_training(cfg, world_size)` then runs
the cross-field checks that need at most the target's config.json, its tokenizer and the cache's meta.json:
drafter/target combination (layer ids in range, block size 4..16, kind-specific fields), batch sizes
achievable for the world size, ZeRO stage vs offload, the cache's existence and fingerprint, and a
writable output folder. Each failure is a `ValueError` (or `FileNotFoundError`) naming the field.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

BLOCK_KINDS = ("dspark", "dflash")  # drafters trained on anchor blocks; the others train on packed sequences
ZERO_STAGES = (1, 2, 3)  # stage 0 has no partitioned optimizer to consolidate checkpoints from


@dataclass
class TargetSchema:
    name: str = "smollm2-135m"  # embedded name, local dir, .gguf file or hub id
    dtype: str = "auto"
    device: Optional[str] = None
    revision: Optional[str] = None
    num_hidden_layers: Optional[int] = None  # declared depth (checked against config.json when available)
    layer_ids: Optional[List[int]] = None  # the cached feature layers (None: the 5-point default spread)


@dataclass
class DrafterSchema:
    kind: str = "dspark"
    num_draft_layers: int = 5
    block_size: Optional[int] = 7  # block drafters only
    target_layer_ids: Optional[List[int]] = None
    init_from_target: bool = False
    params: Dict[str, Any] = field(default_factory=dict)  # further fields of the drafter's HF config class


@dataclass
class LossSchema:
    ce_weight: Optional[float] = None
    tv_weight: Optional[float] = None
    conf_weight: Optional[float] = None
    gamma: float = 4.0
    chunk_rows: int = 512


@dataclass
class DataSchema:
    cache_dir: str = "outputs/cache/smollm2-135m"
    train_split: str = "train"
    val_split: str = "validation"
    max_anchors_per_seq: int = 512
    max_tokens_per_row: int = 4096


@dataclass
class DeepSpeedSchema:
    stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimSchema:
    lr: float = 6e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_fraction: float = 0.04
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0


@dataclass
class LoggerSchema:
    jsonl: bool = True
    tensorboard: bool = False
    wandb: bool = False
    project: str = "deepspec"
    wandb_mode: Optional[str] = None  # None: online with WANDB_API_KEY, else offline


@dataclass
class TrainerSchema:
    out_dir: Optional[str] = None
    epochs: int = 10
    max_steps: Optional[int] = None
    global_batch_size: int = 64
    micro_batch_size: int = 1
    seed: int = 0
    log_every: int = 10
    val_every: int = 500
    val_max_samples: Optional[int] = None
    save_every: int = 1000
    keep_last: int = 3
    resume: bool = True
    stop_after_steps: Optional[int] = None
    device: str = "auto"
    precision: str = "auto"
    progress_bar: bool = True
    save_deepspeed_state: bool = False
    calibrate_confidence: bool = True  # STS on the validation split after training (drafters with a confidence head)


@dataclass
class TrainConfig:
    target: TargetSchema = field(default_factory=TargetSchema)
    drafter: DrafterSchema = field(default_factory=DrafterSchema)
    loss: LossSchema = field(default_factory=LossSchema)
    data: DataSchema = field(default_factory=DataSchema)
    deepspeed: DeepSpeedSchema = field(default_factory=DeepSpeedSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    run_name: str = "run"


def resolve_config(cfg: DictConfig | dict | TrainConfig) -> TrainConfig:
    """Merge a composed config into the schema (unknown keys and wrong types fail) -> `TrainConfig`."""
    if isinstance(cfg, TrainConfig):
        return cfg
    schema = OmegaConf.structured(TrainConfig)
    OmegaConf.set_struct(schema, True)
    for free_form in (schema.drafter.params, schema.deepspeed.extra):  # checked by the drafter config / DeepSpeed
        OmegaConf.set_struct(free_form, False)
    user = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg)
    user.pop("hydra", None)
    try:
        merged = OmegaConf.merge(schema, user)
    except Exception as e:  # omegaconf's ConfigKeyError/ValidationError carry the full key
        key = getattr(e, "full_key", None)
        where = f"{key}: " if key else ""
        raise ValueError(f"invalid training config: {where}" + str(e).splitlines()[0]) from None
    return OmegaConf.to_object(merged)


@dataclass
class TrainPlan:
    """Everything derived from the config before weights load."""

    world_size: int
    grad_accum_steps: int
    cache_layer_ids: list[int]  # what the cache holds (or will hold)
    drafter_layer_ids: list[int]  # what the drafter reads (a subset for Eagle3, [] for MTP)
    num_target_layers: int
    target_fingerprint: dict | None  # None when checked by configuration alone
    out_dir: Path | None


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_scalars(cfg: TrainConfig, world_size: int) -> int:
    """Field-local and batch/ZeRO checks; returns the gradient-accumulation steps."""
    t, o, z = cfg.trainer, cfg.optim, cfg.deepspeed
    positive = {"trainer.epochs": t.epochs, "trainer.global_batch_size": t.global_batch_size,
                "trainer.micro_batch_size": t.micro_batch_size, "trainer.log_every": t.log_every,
                "trainer.val_every": t.val_every, "trainer.save_every": t.save_every, "trainer.keep_last": t.keep_last,
                "data.max_anchors_per_seq": cfg.data.max_anchors_per_seq, "loss.chunk_rows": cfg.loss.chunk_rows}
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    for name in ("max_steps", "stop_after_steps", "val_max_samples"):
        value = getattr(t, name)
        if value is not None and value < 1:
            raise ValueError(f"trainer.{name}={value} must be >= 1 or null")
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise ValueError(f"trainer.global_batch_size={t.global_batch_size} is not divisible by "
                         f"trainer.micro_batch_size={t.micro_batch_size} x world size {world_size} = {per_step}")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer.device={t.device!r} must be auto, cpu or cuda")
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"trainer.precision={t.precision!r} must be auto, fp32 or bf16")
    if not o.lr > 0:
        raise ValueError(f"optim.lr={o.lr} must be > 0")
    if not 0.0 <= o.warmup_fraction < 1.0:
        raise ValueError(f"optim.warmup_fraction={o.warmup_fraction} must be in [0, 1)")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if o.grad_clip < 0 or o.weight_decay < 0:
        raise ValueError(f"optim.grad_clip={o.grad_clip} and optim.weight_decay={o.weight_decay} must be >= 0")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ValueError(f"optim.betas={o.betas} must be two numbers in [0, 1)")
    if z.stage not in ZERO_STAGES:
        raise ValueError(f"deepspeed.stage={z.stage} must be one of {ZERO_STAGES}")
    if z.offload_param and z.stage != 3:
        raise ValueError(f"deepspeed.offload_param=true needs deepspeed.stage=3 (got stage {z.stage})")
    return t.global_batch_size // per_step


def check_drafter(cfg: TrainConfig, num_target_layers: int | None) -> None:
    """Build the drafter's HF config without a target: validates kind, block size and kind-specific fields."""
    from deepspec.drafters.base import drafter_classes

    d = cfg.drafter
    config_cls, _ = drafter_classes(d.kind)
    if d.kind in BLOCK_KINDS:
        if d.block_size is None:
            raise ValueError(f"drafter.block_size is required for drafter.kind={d.kind!r}")
        if not 4 <= d.block_size <= 16:
            raise ValueError(f"drafter.block_size={d.block_size} must lie in [4, 16]")
    elif d.block_size is not None:
        raise ValueError(f"drafter.block_size={d.block_size} applies to block drafters {BLOCK_KINDS} only; "
                         f"set it to null for drafter.kind={d.kind!r}")
    if num_target_layers is not None and d.init_from_target and d.num_draft_layers > num_target_layers:
        raise ValueError(f"drafter.num_draft_layers={d.num_draft_layers} exceeds the target's {num_target_layers} layers")
    try:
        config_cls(**drafter_overrides(cfg))
    except (TypeError, ValueError) as e:
        raise ValueError(f"drafter ({d.kind}): {e}") from None


def drafter_overrides(cfg: TrainConfig, layer_ids: list[int] | None = None) -> dict:
    """Keyword arguments for `build_drafter` / the drafter config class."""
    d = cfg.drafter
    overrides = dict(d.params)
    overrides["num_draft_layers"] = d.num_draft_layers
    overrides["init_from_target"] = d.init_from_target
    if d.block_size is not None:
        overrides["block_size"] = d.block_size
    if layer_ids is not None:
        overrides["target_layer_ids"] = list(layer_ids)
    return overrides


def drafter_layer_ids(cfg: TrainConfig, cache_layer_ids: list[int]) -> list[int]:
    """The layers the drafter reads: explicit ids; else all cached layers (DSpark/DFlash), low/mid/high of
    them (Eagle3), none (MTP). They must be cached; block drafters read the cached layers exactly."""
    d = cfg.drafter
    if d.target_layer_ids is not None:
        ids = [int(i) for i in d.target_layer_ids]
    elif d.kind == "mtp":
        ids = []
    elif d.kind == "eagle3" and len(cache_layer_ids) > 3:
        ids = [cache_layer_ids[0], cache_layer_ids[len(cache_layer_ids) // 2], cache_layer_ids[-1]]
    else:
        ids = list(cache_layer_ids)
    missing = [i for i in ids if i not in cache_layer_ids]
    if missing:
        raise ValueError(f"drafter.target_layer_ids={ids}: layers {missing} are not in the cache's layer ids "
                         f"{cache_layer_ids} (data.cache_dir={cfg.data.cache_dir})")
    if d.kind in BLOCK_KINDS and ids != list(cache_layer_ids):
        raise ValueError(f"drafter.target_layer_ids={ids} must equal the cache's layer ids {cache_layer_ids} for "
                         f"drafter.kind={d.kind!r} (the block context uses every cached layer)")
    return ids


def target_fingerprint_and_config(target_cfg: TargetSchema):
    """(fingerprint, text config) of the target from its config.json and tokenizer only (no weights;
    tiny test targets are simply built)."""
    from deepspec.targets.family import text_config
    from deepspec.targets.load import (
        load_target,
        load_target_config,
        load_tokenizer,
        resolve_target,
        target_fingerprint,
    )

    from deepspec.targets.tiny import is_tiny_target

    if is_tiny_target(target_cfg.name):
        target = load_target(target_cfg.name, device="cpu")
        return target.fingerprint(), target.config
    _, _, revision = resolve_target(target_cfg.name, target_cfg.revision)
    config = load_target_config(target_cfg.name, target_cfg.revision)
    tokenizer = load_tokenizer(target_cfg.name, target_cfg.revision)
    return target_fingerprint(target_cfg.name, revision, config, tokenizer), text_config(config)


def check_out_dir(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"trainer.out_dir={str(out_dir)!r} is not writable: {e.strerror or e}") from None


def plan_training(cfg: TrainConfig, world_size: int | None = None, check_files: bool = True) -> TrainPlan:
    """All checks before loading weights. `check_files=False` validates by configuration alone
    (declared target depth and layer ids; no config.json, tokenizer, cache or output folder)."""
    from deepspec.cache.format import check_cache_compatible, read_meta
    from deepspec.targets.layers import spread_layer_ids, validate_layer_ids

    world_size = world_size_from_env() if world_size is None else world_size
    grad_accum = check_scalars(cfg, world_size)
    fingerprint = None
    num_layers = cfg.target.num_hidden_layers
    if check_files:
        fingerprint, text_config = target_fingerprint_and_config(cfg.target)
        actual = int(text_config.num_hidden_layers)
        if num_layers is not None and num_layers != actual:
            raise ValueError(f"target.num_hidden_layers={num_layers} but {cfg.target.name}'s config.json has {actual}")
        num_layers = actual
    if num_layers is None:
        raise ValueError(f"target.num_hidden_layers is required to validate {cfg.target.name!r} by configuration alone")
    check_drafter(cfg, num_layers)
    cache_layer_ids = (list(cfg.target.layer_ids) if cfg.target.layer_ids is not None
                       else spread_layer_ids(num_layers, 5))
    validate_layer_ids(cache_layer_ids, num_layers, "target.layer_ids")
    out_dir = None
    if check_files:
        cache_dir = Path(cfg.data.cache_dir)
        if not (cache_dir / "meta.json").is_file():
            raise FileNotFoundError(f"data.cache_dir={str(cache_dir)!r}: no finished cache there (no meta.json); "
                                    f"build it with data_tools/cache_hiddens.py target={cfg.target.name}")
        meta = read_meta(cache_dir)
        check_cache_compatible(meta, fingerprint, where=f"data.cache_dir={str(cache_dir)!r}")
        if cfg.target.layer_ids is not None and list(cfg.target.layer_ids) != list(meta.layer_ids):
            raise ValueError(f"target.layer_ids={list(cfg.target.layer_ids)} but the cache at data.cache_dir holds "
                             f"layers {list(meta.layer_ids)}")
        cache_layer_ids = list(meta.layer_ids)
        out_dir = Path(cfg.trainer.out_dir) if cfg.trainer.out_dir else None
        if out_dir is None:
            raise ValueError("trainer.out_dir is not set (train.py sets it to Hydra's run dir)")
        check_out_dir(out_dir)
    layer_ids = drafter_layer_ids(cfg, cache_layer_ids)
    validate_layer_ids(layer_ids, num_layers, "drafter.target_layer_ids")
    return TrainPlan(world_size=world_size, grad_accum_steps=grad_accum, cache_layer_ids=cache_layer_ids,
                     drafter_layer_ids=layer_ids, num_target_layers=num_layers, target_fingerprint=fingerprint,
                     out_dir=out_dir)
