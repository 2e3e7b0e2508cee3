"""One logging interface over metrics.jsonl, TensorBoard and wandb, plus the rank-0 progress bar.

Only rank 0 writes. wandb runs offline automatically when WANDB_API_KEY is unset (runs sync later
with `wandb sync`); tests set WANDB_MODE=disabled. The resolved config is saved as `config.yaml` in the
run folder so a run folder alone says how it was produced.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

from omegaconf import OmegaConf

from deepspec.training.checkpoint import surviving_checkpoint_note
from deepspec.training.config import LoggerSchema, TrainConfig
from deepspec.utils.io import append_all, atomic_write_text, reporting_disk_full

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def _plain(value):
    """JSON-able scalars/lists from tensors and numbers (NaN -> None)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def flatten_metrics(metrics: dict) -> dict[str, float]:
    """Per-position lists become `name/k` scalars (for TensorBoard/wandb charts)."""
    flat = {}
    for key, value in metrics.items():
        value = _plain(value)
        if isinstance(value, list):
            for k, item in enumerate(value):
                if item is not None:
                    flat[f"{key}/{k}"] = item
        elif isinstance(value, (int, float)) and value is not None:
            flat[key] = value
    return flat


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the records of steps <= `last_step` (the step a run starts from); returns how many were dropped.

    A run resumed from checkpoint step s logs steps s+1.. again: the records a killed run wrote
    after its checkpoint (and a line cut off mid-write) would otherwise repeat those steps. A
    damaged line (not UTF-8, not a record) is dropped too, named in a warning: a log line never
    stops a resume.
    """
    if not path.is_file():
        return 0
    kept, dropped, damaged = [], 0, []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            keep = json.loads(line)["step"] <= last_step
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            keep = False  # cut off mid-write by a kill, or damaged
            damaged.append(number)
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if damaged:
        log.warning("%s: dropped %d line(s) that are no metrics record (cut off by a kill, or "
                    "damaged): line %s", path, len(damaged),
                    ", ".join(map(str, damaged[:5])) + (" ..." if len(damaged) > 5 else ""))
    if dropped:
        atomic_write_text(path, "".join(kept))
    return dropped


class MetricLogger:
    def __init__(self, cfg: LoggerSchema, run_dir: Path, rank: int, run_config: dict, run_name: str, resume: bool,
                 first_step: int = 0):
        self.enabled = rank == 0
        self.jsonl = None
        self.tensorboard = None
        self.wandb_run = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            dropped = truncate_metrics(run_dir / METRICS_FILE, first_step)
            if dropped:
                log.info("%s: dropped %d records after step %d (this run logs those steps again)",
                         run_dir / METRICS_FILE, dropped, first_step)
            self.jsonl = open(run_dir / METRICS_FILE, "ab", buffering=0)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if cfg.wandb:
            import wandb

            mode = (cfg.wandb_mode or os.environ.get("WANDB_MODE")
                    or ("online" if os.environ.get("WANDB_API_KEY") else "offline"))
            self.wandb_run = wandb.init(project=cfg.project, name=run_name, dir=str(run_dir), config=run_config,
                                        mode=mode, tags=["resumed"] if resume else None)

    def log(self, metrics: dict, step: int, split: str) -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, "time": round(time.time(), 3)}
        record.update({k: _plain(v) for k, v in metrics.items()})
        if self.jsonl is not None:
            path = Path(self.jsonl.name)
            # A line cut off here is dropped when a resumed run reopens the file (truncate_metrics).
            with reporting_disk_full(path, survives=lambda: f"{path.name} holds the records before step {step}; "
                                     + surviving_checkpoint_note(path.parent)):
                append_all(self.jsonl, (json.dumps(record) + "\n").encode("utf-8"))
        flat = {f"{split}/{k}": v for k, v in flatten_metrics(metrics).items()}
        if self.tensorboard is not None:
            for key, value in flat.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(flat, step=step)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def read_metrics(run_dir: str | Path, split: str | None = None) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if split is None or r["split"] == split]


def save_resolved_config(cfg: TrainConfig, run_dir: Path, rank: int) -> None:
    if rank == 0:
        atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))


class ProgressBar:
    """Rank-0 tqdm over optimizer steps showing loss, tokens/s and anchors/s (tqdm shows the ETA)."""

    def __init__(self, total_steps: int, initial_step: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", dynamic_ncols=True)

    def update(self, loss: float, tokens_per_s: float, anchors_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:.0f}", anchors_s=f"{anchors_per_s:.0f}")
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
