"""Checkpoints: consolidated drafter + fp32 optimizer state in safetensors, trainer state in JSON; resume.

Layout of `<out_dir>/checkpoints/step-XXXXXXXX/`:
  drafter/                  config.json + model.safetensors (HF form, fp32, no target weights; load_drafter); with
                            trainer.ema_decay > 0 the average of the weights (deepspec.training.averaging)
  training_weights.safetensors  only with the average: the trained fp32 weights themselves, which resume continues
  optimizer.safetensors     full fp32 AdamW state: `exp_avg.<param>`, `exp_avg_sq.<param>`
  trainer_state.json        step, epoch, position in the epoch's batch order, AdamW step, RNG states,
                            world size / ZeRO stage it was written with
  checksums.json            sha256 and size of every file above (deepspec.utils.checksums), written last
  deepspeed/                optional (trainer.save_deepspeed_state): DeepSpeed's native pickled engine state,
                            for DeepSpeed tooling only; resume never reads it (not in checksums.json)

The folder is written as `step-XXXXXXXX.tmp` and renamed when complete (a save that finds the disk full removes
it and says which complete checkpoint is left). Resume takes the newest checkpoint
whose files all match checksums.json; a damaged one (flipped byte, truncated file, missing file) is
named in a warning and the next older valid one is used. Pruning (`keep_last`) never counts checkpoints
newer than the step being saved (a run resumed past a damaged checkpoint replaces it when it gets there).

Why consolidated rather than DeepSpeed's per-rank files: resume then works with any number of processes
and any ZeRO stage (parameters and optimizer states are gathered with `safe_get_full_*` and re-sharded
with `safe_set_full_*` into the new partition), and nothing is pickled. DeepSpeed's universal checkpoint
needs a separate conversion step (ds_to_universal) per world-size change; this needs none. The cost is
gathering the drafter's fp32 weights and two moments on rank 0 at each save (3 x 4 bytes per drafter
parameter), small for drafters. Resume is exact: the first steps after a resume equal an uninterrupted
run's to float tolerance (tests/training/test_resume.py).

Every rank must call `save_checkpoint` (the gathers are collective under ZeRO-3); rank 0 writes.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from deepspec.utils import faults
from deepspec.utils.checksums import MANIFEST_FILE, TRAINER_STATE_FILE, folder_manifest, manifest_problems
from deepspec.utils.io import atomic_write_json, give_ordinary_modes, read_json, reporting_disk_full, tree_bytes
from deepspec.utils.phases import phase

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_FILE = TRAINER_STATE_FILE
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINING_WEIGHTS_FILE = "training_weights.safetensors"  # with an average of the weights only (module docstring)
DRAFTER_DIR = "drafter"
DEEPSPEED_DIR = "deepspeed"
# What resume reads: each must be present and match the manifest.
REQUIRED_FILES = (STATE_FILE, OPTIMIZER_FILE, f"{DRAFTER_DIR}/config.json", f"{DRAFTER_DIR}/model.safetensors")
MOMENTS = ("exp_avg", "exp_avg_sq")
_STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps completed
    epoch: int = 0
    batch_in_epoch: int = 0  # next global batch of this epoch's order
    samples_seen: int = 0
    tokens_seen: int = 0
    train_cpu_s: float = 0.0  # CPU seconds of this process in training steps (validation and checkpoints excluded)
    world_size: int = 1
    zero_stage: int = 0
    rng: dict = field(default_factory=dict)


# -- RNG states as JSON (no pickle) ----------------------------------------------------------------
def capture_rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state().tolist(), "python": _python_state_to_json(random.getstate()),
             "numpy": {"name": np_state[0], "keys": np_state[1].tolist(), "pos": int(np_state[2]),
                       "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])}}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _python_state_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


# -- discovery -------------------------------------------------------------------------------------
def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints (trainer_state.json present), oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def checkpoint_step(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def checkpoint_problems(path: str | Path) -> list[str]:
    """Why a checkpoint cannot be resumed from (empty: every file resume reads matches checksums.json)."""
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing (no checksums recorded: damaged, or not a DeepSpec checkpoint)"]
    try:
        manifest = read_json(manifest_path)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{manifest_path}: unreadable ({err})"]
    problems = [f"{path / name}: missing (not recorded in {MANIFEST_FILE})"
                for name in REQUIRED_FILES if name not in files]
    return problems + manifest_problems(path, manifest)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest checkpoint whose files verify; each newer damaged one is named in a warning and skipped."""
    root = Path(out_dir) / CHECKPOINTS
    candidates = sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), reverse=True) if root.is_dir() else []
    damaged = {}  # path -> its problems, newest first
    for path in candidates:
        problems = checkpoint_problems(path)
        if not problems:
            if damaged:
                log.warning("resuming from %s, the newest valid checkpoint; skipped damaged %s",
                            path.name, ", ".join(p.name for p in damaged))
            return path
        damaged[path] = problems
        log.warning("checkpoint %s is damaged, falling back to an older one: %s", path, "; ".join(problems))
    if damaged:
        newest, problems = next(iter(damaged.items()))
        raise ValueError(f"{root}: no valid checkpoint to resume from (damaged: {', '.join(p.name for p in damaged)}; "
                         f"{newest.name}: {'; '.join(problems)}; see the warnings for the others). Use another "
                         "trainer.out_dir, or trainer.resume=false to start over (the damaged checkpoints are then "
                         "moved aside)")
    return None


def set_aside_previous_run(out_dir: str | Path, also: tuple[str, ...] = ()) -> Path | None:
    """A fresh start (trainer.resume=false) in a folder an earlier run trained in: move its
    checkpoints (and the files named in `also`, its metrics log) into `<out_dir>/previous-<time>/`,
    saying so, so that a later resume never takes that run's weights for this one's. Returns the
    folder they went to (None: nothing to move)."""
    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS
    earlier = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    moved = [out_dir / name for name in also if (out_dir / name).is_file()]
    if not earlier and not moved:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = (f"previous-{stamp}" + (f"-{k}" if k else "") for k in range(1000))
    aside = next(out_dir / name for name in names if not (out_dir / name).exists())
    aside.mkdir()
    for path in ([root] if root.is_dir() else []) + moved:
        os.rename(path, aside / path.name)
    shown = [f"checkpoints ({', '.join(earlier)})" if earlier else None] + [p.name for p in moved]
    log.warning("trainer.resume=false: the earlier run's %s moved to %s, where no resume takes "
                "them for this run's; delete it when no longer needed",
                " and ".join(filter(None, shown)), aside)
    return aside


# -- save ------------------------------------------------------------------------------------------
def _unwrap(engine):
    """The drafter inside the engine (session.TrainingModule wraps it with its objective)."""
    return getattr(engine.module, "drafter", engine.module)


def gather_full_state(engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(fp32 weights, fp32 AdamW moments) of every trainable parameter, full size on every rank.

    Collective under ZeRO-3: all ranks call it in the same order.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    weights, moments = {}, {}
    if _without_zero(engine):  # the single-process engine: the parameters and their AdamW state are the full ones
        for name, param in _unwrap(engine).named_parameters():
            if param.requires_grad:
                weights[name] = param.detach().float().cpu().clone()
                state = engine.optimizer.state.get(param, {})
                for key in MOMENTS:
                    value = state.get(key)
                    moments[f"{key}.{name}"] = (torch.zeros_like(weights[name]) if value is None
                                                else value.detach().float().cpu().clone())
        return weights, moments
    for name, param in _unwrap(engine).named_parameters():
        if not param.requires_grad:
            continue
        weights[name] = safe_get_full_fp32_param(param).detach().float().cpu().clone()
        for key in MOMENTS:
            value = safe_get_full_optimizer_state(param, key)
            if value is None:
                raise RuntimeError(f"optimizer state {key!r} of {name} is missing (ZeRO stage without AdamW state?)")
            moments[f"{key}.{name}"] = value.detach().float().cpu().clone()
    return weights, moments


def save_checkpoint(engine, state: TrainerState, out_dir: str | Path, keep_last: int,
                    save_deepspeed_state: bool = False, average=None) -> Path:
    """Write checkpoint `state.step` (all ranks call; rank 0 writes) and prune to the newest `keep_last`.
    `average`: a `WeightAverage`, whose weights drafter/ then holds (the trained ones go to TRAINING_WEIGHTS_FILE)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = checkpoint_dir(out_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    weights, moments = gather_full_state(engine)
    if save_deepspeed_state:
        engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=f"step{state.step}")
    if rank == 0:
        module = _unwrap(engine)
        full_state = {k: v for k, v in module.state_dict().items() if k not in weights}
        full_state.update(weights if average is None else average.state_dict())
        needed = sum(t.numel() * t.element_size() for t in (*full_state.values(), *moments.values()))
        with reporting_disk_full(final, needed, lambda: f"the partial {tmp.name} was removed; "
                                 + surviving_checkpoint_note(out_dir)):
            try:
                tmp.mkdir(parents=True, exist_ok=True)
                module.save_pretrained(tmp / DRAFTER_DIR, state_dict=full_state, safe_serialization=True)
                save_file({k: v.contiguous() for k, v in moments.items()}, str(tmp / OPTIMIZER_FILE))
                if average is not None:
                    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / TRAINING_WEIGHTS_FILE))
                atomic_write_json(tmp / STATE_FILE, asdict(state))
                atomic_write_json(tmp / MANIFEST_FILE, folder_manifest(tmp, exclude=(DEEPSPEED_DIR, MANIFEST_FILE)))
                faults.claim_space(final, tree_bytes(tmp))
            except Exception:
                shutil.rmtree(tmp, ignore_errors=True)  # never resumed from; gone, it gives its space back
                raise
        give_ordinary_modes(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        # Newer checkpoints can only be damaged ones a resume skipped: they are replaced when the run gets there.
        older = [p for p in list_checkpoints(out_dir) if checkpoint_step(p) <= state.step]
        for old in older[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def surviving_checkpoint_note(out_dir: str | Path) -> str:
    """What a run that stops now leaves to resume from (for a failure's message)."""
    complete = list_checkpoints(out_dir)
    if not complete:
        return "no checkpoint was complete yet (rerunning the same command starts over)"
    return (f"the last complete checkpoint is {complete[-1].name}, unchanged (rerunning the same command "
            "resumes from it)")


@dataclass(frozen=True)
class Checkpointer:
    """One run's checkpoints (`trainer.out_dir`, `save_every`, `keep_last`, `save_deepspeed_state`, `resume`): where a
    rerun resumes from, when to save, and the save itself with the RNG state of that moment."""

    out_dir: Path
    save_every: int
    keep_last: int
    save_deepspeed_state: bool = False
    resume: bool = True

    def resume_point(self) -> Path | None:
        """The newest valid checkpoint when resuming (`resume`), else None."""
        return latest_checkpoint(self.out_dir) if self.resume else None

    def due(self, step: int) -> bool:
        return step % self.save_every == 0

    def save(self, engine, state: TrainerState, average=None) -> Path:
        """`save_checkpoint` of `state.step` (every rank calls it)."""
        state.rng = capture_rng_state()
        with phase("checkpoint"):
            return save_checkpoint(engine, state, self.out_dir, self.keep_last, self.save_deepspeed_state, average)


# -- resume ----------------------------------------------------------------------------------------
def read_trainer_state(path: str | Path) -> TrainerState:
    data = read_json(Path(path) / STATE_FILE)
    known = TrainerState.__dataclass_fields__
    return TrainerState(**{k: v for k, v in data.items() if k in known})


def training_weights_file(path: str | Path) -> Path:
    """The weights training continues from: TRAINING_WEIGHTS_FILE where the run kept an average, else drafter/'s."""
    own = Path(path) / TRAINING_WEIGHTS_FILE
    return own if own.is_file() else Path(path) / DRAFTER_DIR / "model.safetensors"


def load_drafter_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Load the consolidated fp32 weights training continues from into the (not yet
    DeepSpeed-wrapped) drafter. A checkpoint of another drafter shape is refused naming the settings
    that differ (`_shape_mismatch`)."""
    file = training_weights_file(path)
    weights = load_file(str(file))
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    own = module.state_dict()
    missing = sorted(trainable - set(weights))
    unexpected = sorted(set(weights) - set(own))
    resized = sorted(n for n in set(weights) & set(own) if weights[n].shape != own[n].shape)
    if resized or unexpected:
        raise ValueError(_shape_mismatch(module, Path(path), weights, own, resized, unexpected))
    if missing:
        raise ValueError(f"{file} lacks trainable parameters {missing[:5]}")
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value.to(own[name].dtype))


# Drafter config fields not compared (the target's: checked by its fingerprint first; provenance,
# calibration, serialisation).
_UNSHAPED_FIELDS = ("target_config", "target_fingerprint", "target_name", "target_revision",
                    "transformers_version", "_name_or_path", "architectures", "dtype",
                    "torch_dtype", "calibration_temperatures", "calibration_label_kind",
                    "prompt_lookup_acceptance")


def _shape_mismatch(module: torch.nn.Module, path: Path, weights: dict, own: dict,
                    resized: list[str], unexpected: list[str]) -> str:
    """One line: the drafter settings the checkpoint was trained with that differ from this run's,
    and a tensor that does not fit."""
    config_file = path / DRAFTER_DIR / "config.json"
    saved = read_json(config_file) if config_file.is_file() else {}
    ours = json.loads(json.dumps(module.config.to_dict(), default=str))  # as saved: str keys
    # The fields both record (a saved config leaves out transformers' defaults).
    differ = [f"drafter.{key}={saved[key]!r} there, {ours[key]!r} here"
              for key in sorted(set(saved) & set(ours))
              if key not in _UNSHAPED_FIELDS and saved[key] != ours[key]]
    if resized:
        name = resized[0]
        tensor = f"{name}: {list(weights[name].shape)} there, {list(own[name].shape)} here"
    else:
        tensor = f"{unexpected[0]}: not in this run's drafter"
    settings = "; ".join(differ[:6]) + (f"; and {len(differ) - 6} more" if len(differ) > 6 else "")
    settings = settings or "its config.json records no differing setting"
    return (f"{path}: this checkpoint's drafter has another shape than this run's ({settings}; "
            f"e.g. {tensor}): resume with the checkpoint's drafter settings, or start over with "
            "trainer.resume=false (the earlier checkpoints are moved aside) or another "
            "trainer.out_dir")


def load_average(average, path: str | Path) -> None:
    """Resume a `WeightAverage` from drafter/ (a checkpoint written without one: the average starts at its weights)."""
    file = Path(path) / DRAFTER_DIR / "model.safetensors"
    average.load_state_dict(load_file(str(file)), str(file))


def _without_zero(engine) -> bool:
    """True for DeepSpeed's engine without ZeRO (engine.zero_stage: one fp32 process): a plain torch optimizer."""
    return engine.zero_optimization_stage() == 0


def _restore_plain_optimizer(engine, weights: dict, moments: dict, optimizer_step: int) -> None:
    optimizer = engine.optimizer
    with torch.no_grad():
        for name, param in _unwrap(engine).named_parameters():
            if not param.requires_grad:
                continue
            param.copy_(weights[name].to(param.dtype))
            state = optimizer.state[param]
            for key in MOMENTS:
                state[key] = moments[f"{key}.{name}"].to(param.device, torch.float32).clone()
            state["step"] = torch.tensor(float(optimizer_step))


def _flat_fp32_partitions(optimizer) -> list[torch.Tensor]:
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None)  # ZeRO-1/2
    if flats is None:
        flats = optimizer.fp32_partitioned_groups_flat  # ZeRO-3
    return list(flats)


def _ensure_optimizer_state(optimizer) -> None:
    """AdamW creates its moments lazily at the first step; create them with a no-op step (zero grads,
    lr 0) so they can be overwritten, then link them to the parameters (ZeRO-1/2 bookkeeping)."""
    base = optimizer.optimizer
    flats = _flat_fp32_partitions(optimizer)
    if any(len(base.state.get(flat, {})) == 0 for flat in flats):
        saved_lrs = [group["lr"] for group in base.param_groups]
        for group in base.param_groups:
            group["lr"] = 0.0
        for flat in flats:
            flat.grad = torch.zeros_like(flat)
        stage3 = hasattr(optimizer, "_set_fp32_optimizer_param_groups")
        if stage3:  # ZeRO-3 attaches its flat partitions to the torch optimizer only around a step
            optimizer._set_fp32_optimizer_param_groups()
        try:
            base.step()
        finally:
            if stage3:
                optimizer._clear_fp32_optimizer_param_groups()
            for flat in flats:
                flat.grad = None
            for group, lr in zip(base.param_groups, saved_lrs):
                group["lr"] = lr
    if hasattr(optimizer, "_lazy_init_hp_params_optimizer_state"):
        optimizer._lazy_init_hp_params_optimizer_state()


def restore_optimizer(engine, path: str | Path, optimizer_step: int) -> None:
    """Re-shard the consolidated fp32 master weights and AdamW moments into this engine's partition."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    weights = load_file(str(training_weights_file(path)))
    moments = load_file(str(Path(path) / OPTIMIZER_FILE))
    if _without_zero(engine):
        _restore_plain_optimizer(engine, weights, moments, optimizer_step)
        return
    optimizer = engine.optimizer
    _ensure_optimizer_state(optimizer)
    for name, param in _unwrap(engine).named_parameters():
        if not param.requires_grad:
            continue
        safe_set_full_fp32_param(param, weights[name].float())
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, moments[f"{key}.{name}"], key)
    for flat in _flat_fp32_partitions(optimizer):
        flat_state = optimizer.optimizer.state[flat]
        step = flat_state.get("step")
        flat_state["step"] = torch.tensor(float(optimizer_step)) if torch.is_tensor(step) else optimizer_step
