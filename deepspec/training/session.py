"""Assemble a training session from the typed config: checks, placement, cache, target, drafter, engine, resume.

Order matters and is the point of this module: every check that needs no weights runs first (`plan_training`, the
train-split size), then the rank's placement is resolved once (deepspec.training.placement), then the target and
drafter load, then DeepSpeed wraps the drafter, then a checkpoint (if any) is restored into the new partition.
Each component is built from its own section: the checkpointer from `trainer`'s checkpoint fields, the data from
`data` (with the trainer's batch sizes), the engine from `deepspeed` and `optim` at the placement, the objective
from `loss`.
"""

from __future__ import annotations

import functools
import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from deepspec.data.rendering import Rendering
from deepspec.drafters.spec import capabilities_of, spec_of
from deepspec.targets.sharding import is_partitioned
from deepspec.training.averaging import WeightAverage
from deepspec.training.checkpoint import (
    Checkpointer,
    TrainerState,
    load_average,
    load_drafter_weights,
    read_trainer_state,
    restore_optimizer,
    restore_rng_state,
    set_aside_previous_run,
)
from deepspec.training.config import (
    TrainConfig,
    TrainPlan,
    plan_training,
    resolve_config,
)
from deepspec.training.data import TrainingData, feature_source_config
from deepspec.training.engine import build_engine, set_schedule_position
from deepspec.training.log import METRICS_FILE
from deepspec.training.objective import compute_training_loss
from deepspec.training.placement import Placement, resolve_placement
from deepspec.training.validation import decode_eval_prompt_count, heldout_prompts
from deepspec.utils.dist import Launch, init_distributed
from deepspec.utils.heap import keep_freed_memory
from deepspec.utils.locks import exclusive_lock

log = logging.getLogger(__name__)


class TrainingModule(torch.nn.Module):
    """The drafter and its objective in one forward: what DeepSpeed wraps.

    The objectives use some parameters outside their owning module's forward (DSpark's low-rank Markov
    bias factors, Eagle3's draft head): under ZeRO-3 such a parameter is already re-partitioned when
    the loss uses it. Running the objective inside this module's forward and registering the drafter's
    parameters as its external parameters makes ZeRO-3 keep them gathered for the whole step.
    """

    def __init__(self, drafter: torch.nn.Module, loss_cfg, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.drafter = drafter
        self.loss_cfg = loss_cfg
        self.autocast_dtype = autocast_dtype  # trainer.autocast: matmuls in bf16 over fp32 weights (engine.py)

    def register_for_zero3(self) -> None:
        from deepspeed.runtime.zero.partition_parameters import (
            register_external_parameter,
        )

        for param in self.drafter.parameters():
            if param.requires_grad:
                register_external_parameter(self, param)

    def forward(self, batch, with_metrics: bool = False):
        """(loss, StepResult). The loss comes first as a plain tensor: DeepSpeed hooks the tensors a forward
        returns to re-gather ZeRO-3 parameters before their backward (it cannot see inside a dataclass).
        `with_metrics`: also compute what validation's acceptance metrics need (deepspec.training.objective)."""
        device = next(self.drafter.parameters()).device.type
        with torch.autocast(device, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            result = compute_training_loss(self.drafter, batch, self.loss_cfg, with_metrics=with_metrics)
        return result.loss.total, result


@dataclass
class Session:
    cfg: TrainConfig
    plan: TrainPlan
    placement: Placement  # this rank's device, precision, dtypes, ZeRO stage, world size and rank
    data: TrainingData
    target: object
    drafter: torch.nn.Module
    engine: object  # DeepSpeed engine over a TrainingModule: engine(batch) -> (loss, StepResult)
    checkpointer: Checkpointer
    state: TrainerState
    total_steps: int
    out_dir: Path
    resumed_from: Path | None
    num_positions: int
    decode_prompts: list[list[int]] = field(default_factory=list)  # validation prompts decoded at validation time
    eos_token_ids: tuple[int, ...] = ()  # where decoding stops (end-of-turn tokens; the text format: end of sequence)
    on_train_end: list[Callable] = field(default_factory=list)
    average: WeightAverage | None = None  # trainer.ema_decay > 0: what validation scores and checkpoints hold
    lock: ExitStack = field(default_factory=ExitStack)  # this rank's lock on out_dir; closed when the run ends


def load_training_target(cfg: TrainConfig, device: torch.device):
    """The frozen target on `device`; with `data.target_sharding=zero3` its weights partitioned across the ranks
    (deepspec.targets.sharding: a checkpoint loads straight into the partitions; a target built in memory is
    partitioned once built)."""
    from deepspec.cache.pipeline import load_cache_target
    from deepspec.targets.load import parse_dtype
    from deepspec.targets.sharding import ZERO3, partition_target, zero3_loading
    from deepspec.targets.tiny import is_tiny_target

    target_cfg = {"name": cfg.target.name, "dtype": cfg.target.dtype, "device": str(device)}
    if cfg.data.target_sharding != ZERO3:
        target = load_cache_target(target_cfg)
        target.model.to(device)
        return target
    dtype = parse_dtype(cfg.target.dtype, device)
    if is_tiny_target(cfg.target.name):
        target = load_cache_target(target_cfg)
    else:
        with zero3_loading(dtype):
            target = load_cache_target(target_cfg)
    return partition_target(target, dtype)


def check_checkpoint_target(checkpoint: Path, target) -> None:
    """A resumed run must train for the target its checkpoint's drafter was trained for (with online features
    no cache fingerprint stands between them); the keys `load_drafter` compares."""
    import json

    config_file = Path(checkpoint) / "drafter" / "config.json"
    saved = json.loads(config_file.read_text()).get("target_fingerprint") or {}
    current = target.fingerprint()
    for key in ("config_hash", "tokenizer_hash"):
        if saved.get(key) and saved.get(key) != current.get(key):
            raise ValueError(f"{config_file}: target_fingerprint.{key}={saved.get(key)!r} does not match the "
                             f"training target {current.get('target')!r} ({current.get(key)!r}): this checkpoint was "
                             "trained for another target; use another trainer.out_dir or trainer.resume=false")


class TrainingSample:
    """A training sample as a kind's `prepare_for_training` sees it: its tokens, and on first use the target's
    argmax next token after each position (`target_next`, None where the source does not store the target's
    outputs: `reader.target_next_tokens`), so a kind that never asks pays nothing for it."""

    def __init__(self, reader, index: int, head_VH: torch.Tensor):
        self.input_ids, self.loss_mask = reader.tokens(index)
        self._reader, self._index, self._head_VH = reader, index, head_VH

    @functools.cached_property
    def target_next(self) -> torch.Tensor | None:
        return self._reader.target_next_tokens(self._index, self._head_VH)


def prepare_for_training(drafter, reader, sample_ids: list, tokenizer) -> None:
    """The kind's data-dependent initialisation (e.g. Eagle3's reduced vocabulary) from the training samples."""
    prepare = spec_of(drafter).prepare_for_training
    if prepare is not None:
        head_VH = drafter.target_parts.lm_head_weight.detach()
        prepare(drafter, (TrainingSample(reader, i, head_VH) for i in sample_ids), tokenizer)


def build_data_and_drafter(cfg: TrainConfig, plan: TrainPlan, device: torch.device, prepare: bool = True,
                           rank: int = 0, world: int = 1):
    """(TrainingData, target, drafter) of a run, no engine: the features (the cache, or the target computing them:
    `data.features`, deepspec.cache.source), the frozen target, the drafter built from the run's seed and
    (`prepare`, not on resume: a resumed run reloads what it computed, e.g. Eagle3's d2t/t2d) its kind's
    data-dependent initialisation. `deepspec bench train`'s bare loop uses it too."""
    from deepspec.drafters.build import build_drafter

    features = feature_source_config(cfg).prepare()  # no weights yet: a broken cache or conversations file fails here
    target = load_training_target(cfg, device)
    reader = features.open(target, plan.cache_layer_ids, rank, world, target_lse=plan.needs_target_lse)
    t = cfg.trainer
    data = TrainingData(cfg.data, reader, plan.cache_layer_ids, plan.drafter_layer_ids, seed=t.seed,
                        global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                        val_max_samples=t.val_max_samples)
    reader.vocab_size = int(target.config.vocab_size)  # every token id read is checked against it
    torch.manual_seed(t.seed)  # identical initial drafter on every rank
    drafter = build_drafter(cfg.drafter.kind, target, **plan.drafter_settings).to(device)
    if prepare:
        prepare_for_training(drafter, reader, data.train_ids, target.tokenizer)
    data.attach_drafter(drafter.config, target.tokenizer.pad_token_id)
    return data, target, drafter


def build_session(cfg_in, out_dir: str | None = None, on_train_end: list[Callable] | None = None,
                  launch: Launch | None = None) -> Session:
    """Checks, then the rank's lock on the output folder (held by the session until `run` ends), then the rest.
    `launch`: this process's place in the job (default: read from the launcher's variables, else one process)."""
    cfg = resolve_config(cfg_in)
    if cfg.trainer.out_dir is None and out_dir is not None:
        cfg.trainer.out_dir = str(out_dir)
    launch = launch or Launch.from_environ()
    plan = plan_training(cfg, world_size=launch.world_size)  # every check that needs no weights
    placement = resolve_placement(cfg.trainer, cfg.deepspeed, launch)
    with ExitStack() as lock:  # released here if the session cannot be built, else by the session's owner
        lock.enter_context(exclusive_lock(plan.out_dir / f".lock-train-r{placement.rank}",
                                          f"rank {placement.rank} of the training run in {plan.out_dir}"))
        session = _assemble_session(cfg, plan, placement, launch, on_train_end, lock)
        session.lock = lock.pop_all()
    return session


def _assemble_session(cfg: TrainConfig, plan: TrainPlan, placement: Placement, launch: Launch,
                      on_train_end: list[Callable] | None, lock: ExitStack | None = None) -> Session:
    """Each component from its own config section, in the order they need each other."""
    _start_process(launch, placement.device, cfg.trainer.reuse_cpu_memory)
    t = cfg.trainer
    checkpointer = Checkpointer(plan.out_dir, save_every=t.save_every, keep_last=t.keep_last,
                                save_deepspeed_state=t.save_deepspeed_state, resume=t.resume)
    if not t.resume and placement.rank == 0:  # rank 0 writes the checkpoints and the log
        set_aside_previous_run(plan.out_dir, also=(METRICS_FILE,))
    resumed_from = checkpointer.resume_point()
    data, target, drafter = build_data_and_drafter(cfg, plan, placement.device, prepare=resumed_from is None,
                                                   rank=placement.rank, world=placement.world_size)
    on_train_end = _hold_feature_source(data.reader, lock, list(on_train_end or []))
    total_steps = t.max_steps or t.epochs * data.steps_per_epoch
    state = TrainerState(world_size=placement.world_size, zero_stage=placement.zero_stage)
    if resumed_from is not None:
        state = _resume_drafter(resumed_from, target, drafter)
    engine = _wrap_in_engine(drafter, cfg, plan, placement, total_steps)
    average = WeightAverage(drafter, t.ema_decay) if t.ema_decay > 0 else None
    if resumed_from is not None:
        _resume_engine(resumed_from, engine, average, state, placement)
    return Session(cfg=cfg, plan=plan, placement=placement, data=data, target=target, drafter=drafter, engine=engine,
                   checkpointer=checkpointer, state=state, total_steps=total_steps, out_dir=plan.out_dir,
                   resumed_from=resumed_from, num_positions=capabilities_of(drafter).num_positions,
                   decode_prompts=decode_prompts(cfg, data, target),
                   eos_token_ids=tuple(Rendering.from_record(plan.rendering).stop_token_ids(target.tokenizer)),
                   on_train_end=on_train_end, average=average)


def _start_process(launch: Launch, device: torch.device, reuse_cpu_memory: bool) -> None:
    """This process's settings before anything loads: the heap (`trainer.reuse_cpu_memory`), the process group."""
    if device.type == "cpu" and reuse_cpu_memory:
        keep_freed_memory()  # before the target and the drafter load: every later block comes from the heap
    init_distributed(launch, device)


def _hold_feature_source(reader, lock: ExitStack | None, on_train_end: list[Callable]) -> list[Callable]:
    """The feature source for the whole run: it closes with the run's `lock`, a hybrid one holds its cache's lock and
    finishes its cache first thing after training (an offline cache's hooks do nothing). Returns the run's
    end-of-training hooks."""
    if lock is not None:
        lock.callback(reader.close)
    reader.acquire_lock()
    # A run that ends inside epoch 0 still leaves a finished hybrid cache (before calibration reads it).
    on_train_end.insert(0, lambda session, checkpoint: session.data.reader.finish())
    return on_train_end


def _resume_drafter(checkpoint: Path, target, drafter: torch.nn.Module) -> TrainerState:
    """The checkpoint's trainer state, and its weights loaded into the drafter before DeepSpeed wraps it (the
    module's own copy is right too)."""
    state = read_trainer_state(checkpoint)
    check_checkpoint_target(checkpoint, target)
    load_drafter_weights(drafter, checkpoint)
    return state


def _wrap_in_engine(drafter: torch.nn.Module, cfg: TrainConfig, plan: TrainPlan, placement: Placement,
                    total_steps: int):
    """The DeepSpeed engine over the drafter and its objective (`deepspeed`, `optim`, `loss`) at the placement."""
    if placement.autocast_dtype is not None:
        log.info("trainer.autocast=%s: the drafter's forward and loss run under %s autocast", cfg.trainer.autocast,
                 placement.autocast_dtype)
    module = TrainingModule(drafter, cfg.loss, placement.autocast_dtype)
    engine = build_engine(module, cfg.deepspeed, cfg.optim, placement, micro_batch_size=cfg.trainer.micro_batch_size,
                          grad_accum_steps=plan.grad_accum_steps, total_steps=total_steps)
    if placement.zero_stage == 3:
        module.register_for_zero3()
    return engine


def _resume_engine(checkpoint: Path, engine, average: WeightAverage | None, state: TrainerState,
                   placement: Placement) -> None:
    """The rest of a resume, into the new engine's partition: the weights' average, the optimizer states, the
    schedule's position and the RNG states; from here the state records this run's world size and ZeRO stage."""
    if average is not None:
        load_average(average, checkpoint)
    restore_optimizer(engine, checkpoint, state.step)
    set_schedule_position(engine, state.step)
    restore_rng_state(state.rng)
    log.info("resumed from %s (step %d, written by %d processes, now %d)", checkpoint, state.step, state.world_size,
             placement.world_size)
    state.world_size, state.zero_stage = placement.world_size, placement.zero_stage


def decode_prompts(cfg: TrainConfig, data: TrainingData, target) -> list[list[int]]:
    """The validation prompts decoded at each validation (`trainer.decode_eval_prompts`), none under ZeRO-3."""
    num = decode_eval_prompt_count(cfg.trainer.decode_eval_prompts, target.model)
    if num and is_partitioned(target):
        log.warning("trainer.decode_eval_prompts=%d ignored with data.target_sharding=%s (rank 0 would decode alone "
                    "with a target whose weights every rank holds a part of): no decoded tau at validation", num,
                    cfg.data.target_sharding)
        return []
    if num and cfg.deepspeed.stage == 3:
        log.warning("trainer.decode_eval_prompts=%d ignored under ZeRO-3 (rank 0 would need the whole drafter): "
                    "no decoded tau at validation", num)
        return []
    prompts = heldout_prompts(data.reader, data.val_ids, num, cfg.trainer.decode_eval_max_prompt_tokens)
    if num and len(prompts) < num:
        log.warning("trainer.decode_eval_prompts=%d but the validation split has %d prompts of at most "
                    "trainer.decode_eval_max_prompt_tokens=%d tokens", num, len(prompts),
                    cfg.trainer.decode_eval_max_prompt_tokens)
    return prompts
