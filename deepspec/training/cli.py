"""`deepspec train` / train.py: the Hydra entry point of training (configs packaged in deepspec/conf)."""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from deepspec.training.config import register_configs
from deepspec.utils.config import CONFIG_MODULE
from deepspec.utils.hydra_command import HydraCommand
from deepspec.utils.termination import TERMINATED_EXIT

COMMAND = HydraCommand("deepspec train", run_dir_keys=("trainer.out_dir",))  # train.yaml: hydra.run.dir


@hydra.main(version_base="1.3", config_path=f"pkg://{CONFIG_MODULE}", config_name="train")
def _train(cfg: DictConfig) -> None:
    from deepspec.training import finish_process, run

    hydra_cfg = HydraConfig.get()
    try:
        with COMMAND.job():
            run(cfg, out_dir=hydra_cfg.runtime.output_dir, on_start=[lambda session: _record_run(session, cfg)])
    except SystemExit as stopped:  # a SIGTERM: every rank stopped after the same step and saved it
        if stopped.code == TERMINATED_EXIT and hydra_cfg.mode != RunMode.MULTIRUN:
            finish_process(cfg.deepspeed.stage, exit_code=TERMINATED_EXIT)
        raise
    if hydra_cfg.mode != RunMode.MULTIRUN:  # a sweep's later jobs still need the process
        finish_process(cfg.deepspeed.stage)


def _record_run(session, cfg: DictConfig) -> None:
    """Hydra's run record, written once this run holds its folder's lock (train.yaml: hydra.output_subdir)."""
    if session.placement.rank == 0:
        COMMAND.write_run_record(session.out_dir, cfg)


def main() -> None:
    """Hydra reads the overrides from sys.argv (`python train.py a=b ...`, `deepspec train a=b ...`)."""
    register_configs()
    COMMAND.run(_train)
