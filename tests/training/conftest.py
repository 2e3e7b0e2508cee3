"""Training fixtures: config helpers over the shared tiny feature cache (`tiny_cache`, tests/conftest.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "deepspec" / "conf"
TINY_TARGET = "tiny-random-llama"


DRAFTER_OVERRIDES = {
    "dspark": ["drafter.block_size=4", "drafter.markov_rank=8"],
    "dflash": ["drafter.block_size=4"],
    "eagle3": ["drafter.ttt_steps=2"],
    "mtp": ["drafter.num_mtp_modules=2"],
    "standalone": ["drafter.num_speculative_tokens=3", "loss.tv_weight=0.5"],
}


def train_overrides(cache: Path, out_dir: Path | None, *extra: str, drafter: str = "dspark") -> list[str]:
    """A tiny CPU run: 1-layer drafter (DSpark block 4), 4 sequences per step, 4 steps, no progress bar."""
    out = [f"trainer.out_dir={out_dir}"] if out_dir is not None else []
    return [f"target={TINY_TARGET}", f"drafter={drafter}", *DRAFTER_OVERRIDES[drafter], f"data.cache_dir={cache}",
            *out, "drafter.num_draft_layers=1", "data.max_anchors_per_seq=8", "data.max_tokens_per_row=64",
            "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
            "trainer.max_steps=4", "trainer.log_every=1", "trainer.val_every=100", "trainer.save_every=100",
            "trainer.progress_bar=false", "optim.lr=3e-3", "optim.warmup_fraction=0.0", "logger=jsonl", *extra]


def compose(overrides: list[str]):
    from deepspec.training.config import compose_train_config

    return compose_train_config(overrides)


def subprocess_env() -> dict:
    """The test process's environment without the single-process rendezvous it may have set for itself."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *args: str) -> list[str]:
    # An explicit free port: torchrun's --master_port=0 leaves the workers waiting on this machine.
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            str(REPO / "train.py"), *args]


def train_losses(run_dir: Path) -> list[float]:
    from deepspec.training.log import read_metrics

    return [r["loss"] for r in read_metrics(run_dir, "train")]


@pytest.fixture(scope="session")
def reference_run(tiny_cache, tmp_path_factory) -> Path:
    """An uninterrupted single-process 4-step DSpark run (ZeRO-2), in this process."""
    from deepspec.training import run

    out = tmp_path_factory.mktemp("reference_run")
    run(compose(train_overrides(tiny_cache, out)))
    return out


@pytest.fixture(scope="session")
def tt(conversations_factory):
    """The helpers above, for test modules (pytest's importlib mode keeps conftest out of their imports)."""
    from types import SimpleNamespace

    return SimpleNamespace(compose=compose, train_overrides=train_overrides, subprocess_env=subprocess_env,
                           torchrun=torchrun, train_losses=train_losses, make_conversations=conversations_factory,
                           REPO=REPO, CONF_DIR=CONF_DIR)
