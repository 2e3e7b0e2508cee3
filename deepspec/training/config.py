"""Typed training configuration: dataclass schemas for every `conf/` group, their Hydra ConfigStore entries, and
the checks run before any weights load.

Defaults live once, in these dataclasses (and the drafter kinds' own `params_class` / `loss_class`):
`register_configs()` stores them in Hydra's ConfigStore (`train_schema`, `<group>/base_<group>`,
`drafter/base_<kind>`, `loss/<kind>`) and the YAML files under `deepspec/conf/` are deltas over them. So a
composed config is typed at composition: an unknown key (`drafter.bogus_key=3`) or a wrong type fails there.

`resolve_config(cfg)` merges a composed `DictConfig` (or a plain dict) into the schemas once more, with the
drafter kind's own dataclasses (struct mode: an unknown key - also one added with `+` - or a wrong type fails,
naming the key) and returns a `TrainConfig`; each section checks its own fields once, when it is built
(`__post_init__`: ranges, choices, ZeRO stage vs offload). `plan_training(cfg, world_size)` then runs the checks
that need the world size or at most the target's config.json, its tokenizer and the cache's meta.json:
drafter/target combination (layer ids in range, block size 4..16, kind-specific fields), batch sizes achievable
for the world size, the cache's existence and fingerprint (with `data.features=online|hybrid`: the
cache job's checks on `data.source` / `data.cache` instead, and a finished hybrid cache's fingerprint), and a
writable output folder. Each failure is a `ValueError` (or `FileNotFoundError`) naming the field.
"""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from deepspec.cache.config import (
    DEFAULT_CACHE_DIR,
    FEATURE_MODES,
    ONLINE_BATCH_MODES,
    ONLINE_OPTIONS,
    CacheDataSchema,
    CacheSchema,
    data_rendering,
)
from deepspec.calibration.config import CalibrationSchema
from deepspec.data.rendering import Rendering
from deepspec.drafters.params import DrafterParams, LossParams
from deepspec.drafters.spec import drafter_kinds, get_drafter_spec
from deepspec.targets.config import TargetSchema
from deepspec.utils.config import compose_config, merge_into_schema, register_resolvers
from deepspec.utils.dist import Launch
from deepspec.utils.errors import UsageError
from deepspec.utils.faults import FaultInjection
from deepspec.utils.io import check_output_folder

ZERO_STAGES = (1, 2, 3)
TARGET_SHARDINGS = ("none", "zero3")  # data.target_sharding
# The settings a cache's (or a regeneration's) recorded rendering is checked against, as training names them.
RENDERING_FIELDS = {"format": "data.source.format", "chat_template": "target.chat_template",
                    "chat_template_kwargs": "target.chat_template_kwargs"}


def check_at_least_one(section: str, **values: int | None) -> None:
    """Each value (None: not set, allowed) is >= 1; else a ValueError naming `section.name`."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{section}.{name}={value} must be >= 1")


@dataclass
class OnlineCacheSchema(CacheSchema):
    """The cache job's `cache:` options as training's `data.cache` (messages name data.cache.<field>)."""

    where: ClassVar[str] = "data.cache"


@dataclass
class OnlineDataSchema(CacheDataSchema):
    """The cache job's `data:` section as training's `data.source` (messages name data.source.<field>)."""

    where: ClassVar[str] = "data.source"


@dataclass
class DataSchema:
    cache_dir: str = DEFAULT_CACHE_DIR  # conf/data/cache.yaml: outputs/cache/<target choice>
    # Where the target features come from (deepspec.cache.source): offline = the finished cache in cache_dir;
    # online = the frozen target computes each micro-batch inside training, no cache; hybrid = online in epoch 0
    # while writing the cache into cache_dir, offline after.
    features: str = "offline"
    # online/hybrid: one target forward per micro-batch (micro_batch: right-padded as the cache writer pads its
    # batches), or per sample (sample: the computation of `deepspec cache cache.batch_size=1`, bit for bit)
    online_batch: str = "micro_batch"
    # online/hybrid: the frozen target whole on every rank (none), or partitioned across the ranks with DeepSpeed
    # ZeRO-3 (zero3: each rank holds 1/world of its weights and gathers a layer's for its own forwards)
    target_sharding: str = "none"
    # online/hybrid: the conversations and their splits, the cache job's `data:` section (conf/cache_hiddens.yaml)
    source: OnlineDataSchema = field(default_factory=OnlineDataSchema)
    # online/hybrid: the cache job's `cache:` options (max_length, layer_ids, storage_dtype, content, shard_size_mb);
    # out_dir is not read (hybrid writes cache_dir), batch_size/batch_tokens neither (data.online_batch decides).
    cache: OnlineCacheSchema = field(default_factory=OnlineCacheSchema)
    train_split: str = "train"
    val_split: str = "validation"
    max_anchors_per_seq: int = 512  # block drafters: anchors sampled per sequence, resampled each epoch
    # block drafters: validation's anchors per sequence (null: max_anchors_per_seq); more anchors, a less noisy
    # validation at no cost to training (its blocks are fixed: epoch 0's draw)
    val_anchors_per_seq: Optional[int] = None
    max_tokens_per_row: int = 4096  # chain drafters (Eagle3, MTP): packed row length

    def __post_init__(self) -> None:
        if self.features not in FEATURE_MODES:
            raise ValueError(f"data.features={self.features!r} must be one of {list(FEATURE_MODES)}")
        if self.online_batch not in ONLINE_BATCH_MODES:
            raise ValueError(f"data.online_batch={self.online_batch!r} must be one of {list(ONLINE_BATCH_MODES)}")
        if self.target_sharding not in TARGET_SHARDINGS:
            raise ValueError(f"data.target_sharding={self.target_sharding!r} must be one of {list(TARGET_SHARDINGS)}")
        if self.target_sharding != "none" and self.features == "offline":
            raise ValueError(f"data.target_sharding={self.target_sharding} needs data.features=online or hybrid "
                             "(offline training runs the target for decoded tau only)")
        check_at_least_one("data", max_anchors_per_seq=self.max_anchors_per_seq)
        if self.val_anchors_per_seq is not None:
            check_at_least_one("data", val_anchors_per_seq=self.val_anchors_per_seq)


@dataclass
class DeepSpeedSchema:
    stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    extra: Dict[str, Any] = field(default_factory=dict)  # further zero_optimization keys, passed to DeepSpeed
    # One fp32 process with stage 1/2 and no offload has nothing to partition: run DeepSpeed's engine without
    # ZeRO (stage 0) and skip its gradient all-reduce, so none of ZeRO's flat-buffer copies are paid
    # (deepspec/training/engine.py). Checkpoints are the same consolidated files either way.
    single_process_engine: bool = True

    def __post_init__(self) -> None:
        if self.stage not in ZERO_STAGES:
            raise ValueError(f"deepspeed.stage={self.stage} must be one of {ZERO_STAGES}")
        if self.offload_param and self.stage != 3:
            raise ValueError(f"deepspeed.offload_param=true needs deepspeed.stage=3 (got stage {self.stage})")


@dataclass
class OptimSchema:
    """AdamW (torch implementation: no fused-Adam compile), linear warmup then cosine decay (paper settings)."""

    lr: float = 6e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_fraction: float = 0.04  # of the total optimizer steps
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"optim.warmup_fraction={self.warmup_fraction} must be in [0, 1)")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise ValueError(f"optim.grad_clip={self.grad_clip} and optim.weight_decay={self.weight_decay} must be "
                             ">= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")


@dataclass
class LoggerSchema:
    jsonl: bool = True  # metrics.jsonl in the run folder
    tensorboard: bool = False
    wandb: bool = False
    project: str = "deepspec"
    wandb_mode: Optional[str] = None  # None: online with WANDB_API_KEY, else offline


@dataclass
class TrainerSchema:
    out_dir: Optional[str] = None  # null: Hydra's run dir (outputs/train/<run_name>; one folder per multirun job)
    epochs: int = 10
    max_steps: Optional[int] = None  # stop earlier than `epochs` (null: train all epochs)
    global_batch_size: int = 64  # sequences per optimizer step, whatever the number of processes
    micro_batch_size: int = 1  # sequences per forward per process; accumulation = global / (micro x world)
    seed: int = 0
    log_every: int = 10
    val_every: int = 500
    val_at_start: bool = False  # also validate before the first step (a learning curve's step-0 point); not on resume
    val_max_samples: Optional[int] = None
    save_every: int = 1000
    keep_last: int = 3
    # An exponential moving average of the weights, average = d * average + (1 - d) * weights after each step
    # (deepspec/training/averaging.py): validation scores it and checkpoints' drafter/ hold it. 0: off; ZeRO-1/2 only.
    ema_decay: float = 0.0
    resume: bool = True  # continue from the newest checkpoint in out_dir if there is one
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (fp32 on CPU, bf16 on GPU) | fp32 | bf16
    # bf16 autocast of the drafter's forward and loss over fp32 weights (deepspec/training/placement.py): none | bf16 |
    # auto (bf16 where the CPU has bf16 matmul units, AMX or AVX512-BF16; none elsewhere and on GPUs, which train
    # in bf16 already)
    autocast: str = "none"
    progress_bar: bool = True
    # Also write DeepSpeed's native (pickled) engine checkpoint; resume never needs it.
    save_deepspeed_state: bool = False
    # Decoded tau at every validation: the real decoding loop (deepspec.decoding.loop) on the prompts of the first
    # validation samples, logged next to the simulated tau (deepspec.training.validation). null: 4 prompts on
    # targets under 1B parameters, 0 (off) on larger ones, where each validation would cost minutes of decoding.
    decode_eval_prompts: Optional[int] = None
    decode_eval_max_new_tokens: int = 64
    decode_eval_temperatures: List[float] = field(default_factory=lambda: [0.0, 1.0])
    decode_eval_max_prompt_tokens: int = 512  # validation samples with longer prompts are passed over
    # Log each step's CPU seconds per phase (data, target, forward, loss, backward, optimizer, guards, logging:
    # deepspec/utils/phases.py) as `phase_cpu_s` in metrics.jsonl; each timed phase costs two clock reads.
    phase_times: bool = False
    # Training on CPU: keep the memory a step frees for the next step instead of returning it to the kernel, which
    # zeroes it again at the next touch (deepspec/utils/heap.py: less CPU time per step for a higher peak RSS)
    reuse_cpu_memory: bool = True

    def __post_init__(self) -> None:
        check_at_least_one("trainer", epochs=self.epochs, global_batch_size=self.global_batch_size,
                           micro_batch_size=self.micro_batch_size, log_every=self.log_every, val_every=self.val_every,
                           save_every=self.save_every, keep_last=self.keep_last, max_steps=self.max_steps,
                           val_max_samples=self.val_max_samples,
                           decode_eval_max_new_tokens=self.decode_eval_max_new_tokens,
                           decode_eval_max_prompt_tokens=self.decode_eval_max_prompt_tokens)
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"trainer.ema_decay={self.ema_decay} must be in [0, 1) (0: no average)")
        if self.decode_eval_prompts is not None and self.decode_eval_prompts < 0:
            raise ValueError(f"trainer.decode_eval_prompts={self.decode_eval_prompts} must be >= 0 or null")
        if any(not (math.isfinite(x) and x >= 0) for x in self.decode_eval_temperatures):
            raise ValueError(f"trainer.decode_eval_temperatures={list(self.decode_eval_temperatures)} must be finite "
                             "and >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"trainer.device={self.device!r} must be auto, cpu or cuda")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"trainer.precision={self.precision!r} must be auto, fp32 or bf16")
        if self.autocast not in ("none", "bf16", "auto"):
            raise ValueError(f"trainer.autocast={self.autocast!r} must be none, bf16 or auto")

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro steps per optimizer step on each of `world_size` processes: global / (micro x world), which must
        divide exactly (the same optimisation on any number of processes)."""
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(f"trainer.global_batch_size={self.global_batch_size} is not divisible by "
                             f"trainer.micro_batch_size={self.micro_batch_size} x world size {world_size} = {per_step}")
        return self.global_batch_size // per_step


@dataclass
class TrainConfig:
    target: TargetSchema = field(default_factory=TargetSchema)
    drafter: DrafterParams = field(default_factory=DrafterParams)  # a kind's params_class once composed
    loss: LossParams = field(default_factory=LossParams)  # the kind's loss_class once composed
    data: DataSchema = field(default_factory=DataSchema)
    deepspeed: DeepSpeedSchema = field(default_factory=DeepSpeedSchema)
    optim: OptimSchema = field(default_factory=OptimSchema)
    logger: LoggerSchema = field(default_factory=LoggerSchema)
    trainer: TrainerSchema = field(default_factory=TrainerSchema)
    calibration: CalibrationSchema = field(default_factory=CalibrationSchema)
    faults: FaultInjection = field(default_factory=FaultInjection)  # tests only (deepspec.utils.faults)
    run_name: str = "run"


GROUP_SCHEMAS = {"target": TargetSchema, "data": DataSchema, "deepspeed": DeepSpeedSchema, "optim": OptimSchema,
                 "logger": LoggerSchema}


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent; call again after registering a drafter kind)."""
    from hydra.core.config_store import ConfigStore

    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    for group, schema in GROUP_SCHEMAS.items():
        store.store(group=group, name=f"base_{group}", node=schema)
    for kind in drafter_kinds():
        spec = get_drafter_spec(kind)
        store.store(group="drafter", name=f"base_{kind}", node=spec.params_class)
        store.store(group="loss", name=kind, node=spec.loss_class)


def compose_train_config(overrides: list[str] = (), config_dir: str | Path | None = None) -> DictConfig:
    """Compose `train.yaml` as `python train.py` would (deepspec.utils.config.compose_config)."""
    register_configs()
    return compose_config("train", overrides, config_dir, what="training config")


def _schema_for(user: DictConfig) -> DictConfig:
    """The structured schema with the drafter kind's own params/loss dataclasses in place."""
    schema = OmegaConf.structured(TrainConfig)
    kind = OmegaConf.select(user, "drafter.kind", default=None)
    if kind is None:
        raise ValueError("invalid training config: drafter.kind is missing (choose drafter=<kind>)")
    try:
        spec = get_drafter_spec(str(kind))
    except ValueError as e:
        raise ValueError(f"invalid training config: drafter.kind: {e}") from None
    schema.drafter = OmegaConf.structured(spec.params_class)
    schema.loss = OmegaConf.structured(spec.loss_class)
    OmegaConf.set_struct(schema, True)
    OmegaConf.set_struct(schema.deepspeed.extra, False)  # free-form: checked by DeepSpeed
    OmegaConf.set_struct(schema.target.chat_template_kwargs, False)  # free-form: read by the chat template
    return schema


def resolve_config(cfg: DictConfig | dict | TrainConfig) -> TrainConfig:
    """Merge a composed config into the schema (unknown keys and wrong types fail) -> `TrainConfig`."""
    if isinstance(cfg, TrainConfig):
        return cfg
    return merge_into_schema(cfg, _schema_for, what="training config")


@dataclass
class TrainPlan:
    """Everything derived from the config before weights load."""

    world_size: int
    grad_accum_steps: int  # cfg.trainer.grad_accum_steps(world_size)
    cache_layer_ids: list[int]  # what the cache holds (or will hold)
    drafter_layer_ids: list[int]  # what the drafter reads (all cached layers by default, [] for MTP)
    num_target_layers: int
    target_fingerprint: dict | None  # None when checked by configuration alone
    out_dir: Path | None
    needs_target_lse: bool = False  # the drafter reads the target's log-normaliser (online computes it only then)
    # How the training data were rendered (`Rendering.record()`: the cache's with offline features, else the
    # configured data.source's): the drafter records it, and decoding at validation stops where it says.
    rendering: dict = field(default_factory=lambda: Rendering().record())
    # The drafter's build keywords (`drafter_overrides` with drafter_layer_ids and the rendering): `build_drafter`'s.
    drafter_settings: dict = field(default_factory=dict)


def check_drafter(cfg: TrainConfig, num_target_layers: int | None, target_model_type: str | None = None):
    """Build the drafter's HF config without a target: validates the kind-specific fields (block size, heads) and,
    with the target's model_type, the draft layers' family against it. Returns the kind's capabilities."""
    from deepspec.drafters.base import checked_layer_family

    d = cfg.drafter
    spec = get_drafter_spec(d.kind)
    if num_target_layers is not None and d.init_from_target and d.num_draft_layers > num_target_layers:
        raise ValueError(f"drafter.num_draft_layers={d.num_draft_layers} exceeds the target's "
                         f"{num_target_layers} layers")
    if d.init_from_target and cfg.data.target_sharding != "none":
        raise ValueError(f"drafter.init_from_target=true copies whole target layers, which "
                         f"data.target_sharding={cfg.data.target_sharding} keeps partitioned across the ranks: "
                         "set drafter.init_from_target=false")
    try:
        config = spec.config_class(**drafter_overrides(cfg))
        checked_layer_family(d.layer_family, target_model_type, d.init_from_target)
    except (TypeError, ValueError) as e:
        message = str(e)
        # Config errors start with the field ("block_size=3 must ..."): name it as the config key.
        # A setting the drafter cannot have is a usage error (exit 2), as an unknown key is.
        raise UsageError(f"drafter.{message}" if re.match(r"\w+=", message)
                         else f"drafter ({d.kind}): {message}") from None
    return spec.capabilities(config)


def drafter_overrides(cfg: TrainConfig, layer_ids: list[int] | None = None, rendering: dict | None = None) -> dict:
    """Keyword arguments for `build_drafter` / the drafter config class, with the rendering the training data were
    rendered with (`TrainPlan.rendering`; by default the configured one: `plan_training` checks they agree)."""
    overrides = cfg.drafter.to_config_kwargs()
    overrides.update(rendering if rendering is not None else configured_rendering(cfg).record())
    if layer_ids is not None:
        overrides["target_layer_ids"] = list(layer_ids)
    return overrides


def drafter_layer_ids(cfg: TrainConfig, cache_layer_ids: list[int]) -> list[int]:
    """The layers the drafter reads from the cache: explicit `drafter.target_layer_ids` (or a named choice among
    the cached layers, e.g. Eagle3's `drafter.feature_layers`), else its kind's choice (all cached layers for
    block drafters and Eagle3, none for MTP)."""
    spec = get_drafter_spec(cfg.drafter.kind)
    try:
        return spec.select_cache_layers(list(cache_layer_ids), cfg.drafter.requested_layer_ids(cache_layer_ids))
    except ValueError as e:
        raise ValueError(f"{e} (data.cache_dir={cfg.data.cache_dir})") from None


def target_fingerprint_and_config(target_cfg: TargetSchema):
    """(fingerprint, text config, tokenizer) of the target from its config.json and tokenizer only (no weights;
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
        return target.fingerprint(), target.config, target.tokenizer
    _, _, revision = resolve_target(target_cfg.name, target_cfg.revision)
    config = load_target_config(target_cfg.name, target_cfg.revision)
    tokenizer = load_tokenizer(target_cfg.name, target_cfg.revision)
    return target_fingerprint(target_cfg.name, revision, config, tokenizer), text_config(config), tokenizer


def check_out_dir(out_dir: Path) -> None:
    check_output_folder(out_dir, "trainer.out_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"trainer.out_dir={str(out_dir)!r} is not writable: {e.strerror or e}") from None


def check_cache(cfg: TrainConfig, fingerprint: dict, expected_layer_ids: list[int] | None = None
                ) -> tuple[list[int], dict]:
    """The finished cache in data.cache_dir fits the target, the drafter and the configured rendering (offline its
    format is the data's; hybrid: data.source.format); returns its layer ids and its rendering record."""
    from deepspec.cache.format import check_cache_compatible, read_meta

    cache_dir = Path(cfg.data.cache_dir)
    if not (cache_dir / "meta.json").is_file():
        raise FileNotFoundError(f"data.cache_dir={str(cache_dir)!r}: no finished cache there (no meta.json); "
                                f"build it with `deepspec cache target={cfg.target.name} cache.out_dir=...`, or train "
                                "without one: data.features=online (or hybrid) "
                                "with data.source.prompts=<conversations>")
    meta = read_meta(cache_dir)
    check_cache_compatible(meta, fingerprint, where=f"data.cache_dir={str(cache_dir)!r}")
    wanted, field_name = ((expected_layer_ids, "data.cache.layer_ids (or target.layer_ids)")
                          if expected_layer_ids is not None else (cfg.target.layer_ids, "target.layer_ids"))
    if wanted is not None and list(wanted) != list(meta.layer_ids):
        raise ValueError(f"{field_name}={list(wanted)} but the cache at data.cache_dir holds layers "
                         f"{list(meta.layer_ids)}")
    cache_rendering = Rendering.from_record(meta)
    # Offline, the cache's format is the data's; a chat cache's template settings are the target config's.
    configured = configured_rendering(cfg, meta.data_format if cfg.data.features == "offline" else None)
    configured.check_recorded(meta, f"the cache at data.cache_dir={str(cache_dir)!r}", RENDERING_FIELDS)
    spec = get_drafter_spec(cfg.drafter.kind)
    if meta.content not in spec.cache_contents:
        raise ValueError(f"data.cache_dir={str(cache_dir)!r} stores {meta.content} (cache.content), but a "
                         f"{cfg.drafter.kind} drafter trains from {list(spec.cache_contents)}: rebuild the cache "
                         f"with cache.content={spec.cache_contents[0]}")
    return list(meta.layer_ids), cache_rendering.record()


def configured_rendering(cfg: TrainConfig, data_format: str | None = None) -> Rendering:
    """The rendering of data.source (its format, or `data_format`) with the target config's template settings."""
    source = cfg.data.source if data_format is None else {"format": data_format,
                                                           "system_prompt": cfg.data.source.system_prompt}
    return data_rendering(source, cfg.target, prefix="data.source")


def check_online_data(cfg: TrainConfig, num_layers: int) -> list[int]:
    """data.features=online|hybrid: the cache job's own checks on data.cache / data.source; returns the layer
    ids the target's features are taken from (data.cache.layer_ids, else target.layer_ids, else the spread)."""
    from dataclasses import asdict

    from deepspec.cache.pipeline import resolve_layer_ids

    c, d = cfg.data.cache, cfg.data
    if c.out_dir not in (DEFAULT_CACHE_DIR, d.cache_dir):
        why = "hybrid writes its cache into data.cache_dir" if d.features == "hybrid" else "online writes no cache"
        raise ValueError(f"data.cache.out_dir={c.out_dir!r} is not used by data.features={d.features}: {why}")
    if not d.source.prompts:
        raise ValueError(f"data.source.prompts must name the conversations with data.features={d.features}")
    if c.engine != "transformers":
        raise ValueError(f"data.cache.engine={c.engine}: data.features={d.features} computes the "
                         f"features with the target inside training; build the cache with "
                         f"`deepspec cache cache.engine={c.engine}` and train offline on it "
                         "(data.features=offline)")
    spec = get_drafter_spec(cfg.drafter.kind)
    if c.content not in spec.cache_contents:
        raise ValueError(f"data.cache.content={c.content}, but drafter kind {cfg.drafter.kind!r} trains from "
                         f"{list(spec.cache_contents)}")
    from deepspec.data.regenerate import check_regenerated_rendering

    check_regenerated_rendering(d.source.prompts, configured_rendering(cfg), RENDERING_FIELDS)
    return resolve_layer_ids(asdict(c), asdict(cfg.target), num_layers)


def plan_training(cfg: TrainConfig, world_size: int | None = None, check_files: bool = True) -> TrainPlan:
    """All checks before loading weights. `check_files=False` validates by configuration alone
    (declared target depth and layer ids; no config.json, tokenizer, cache or output folder)."""
    from deepspec.targets.layers import spread_layer_ids, validate_layer_ids
    from deepspec.training.averaging import check_weight_average

    if world_size is None:
        world_size = Launch.from_environ().world_size
    grad_accum = cfg.trainer.grad_accum_steps(world_size)
    check_weight_average(cfg.trainer.ema_decay, cfg.deepspeed.stage)
    fingerprint = None
    num_layers = cfg.target.num_hidden_layers
    if check_files:
        fingerprint, text_config, tokenizer = target_fingerprint_and_config(cfg.target)
        if cfg.data.features != "offline":  # a tokenizer without a chat template fails before any weights load
            configured_rendering(cfg).check_tokenizer(tokenizer, ONLINE_OPTIONS)
        actual = int(text_config.num_hidden_layers)
        if num_layers is not None and num_layers != actual:
            raise ValueError(f"target.num_hidden_layers={num_layers} but {cfg.target.name}'s config.json has {actual}")
        num_layers = actual
    if num_layers is None:
        raise ValueError(f"target.num_hidden_layers is required to validate {cfg.target.name!r} by configuration alone")
    capabilities = check_drafter(cfg, num_layers, text_config.model_type if check_files else None)
    cache_layer_ids = (list(cfg.target.layer_ids) if cfg.target.layer_ids is not None
                       else spread_layer_ids(num_layers, 5))
    validate_layer_ids(cache_layer_ids, num_layers, "target.layer_ids")
    rendering = configured_rendering(cfg).record()
    if cfg.data.features != "offline":
        cache_layer_ids = check_online_data(cfg, num_layers)
    out_dir = None
    if check_files:
        if cfg.data.features == "offline":
            cache_layer_ids, rendering = check_cache(cfg, fingerprint)
        elif cfg.data.features == "hybrid" and (Path(cfg.data.cache_dir) / "meta.json").is_file():
            check_cache(cfg, fingerprint, expected_layer_ids=cache_layer_ids)  # a finished one: reused
        out_dir = Path(cfg.trainer.out_dir) if cfg.trainer.out_dir else None
        if out_dir is None:
            raise ValueError("trainer.out_dir is not set (train.py sets it to Hydra's run dir)")
        check_out_dir(out_dir)
    layer_ids = drafter_layer_ids(cfg, cache_layer_ids)
    validate_layer_ids(layer_ids, num_layers, "drafter.target_layer_ids")
    return TrainPlan(world_size=world_size, grad_accum_steps=grad_accum, cache_layer_ids=cache_layer_ids,
                     drafter_layer_ids=layer_ids, num_target_layers=num_layers, target_fingerprint=fingerprint,
                     out_dir=out_dir, rendering=rendering, needs_target_lse=capabilities.needs_target_lse,
                     drafter_settings=drafter_overrides(cfg, layer_ids, rendering))
