"""`deepspec cache` / data_tools/cache_hiddens.py: the Hydra entry point of the cache job (conf/cache_hiddens.yaml)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from deepspec.cache.config import register_cache_configs
from deepspec.utils.config import CONFIG_MODULE
from deepspec.utils.hydra_command import HydraCommand

COMMAND = HydraCommand("deepspec cache")


@hydra.main(version_base=None, config_path=f"pkg://{CONFIG_MODULE}", config_name="cache_hiddens")
def _cache(cfg: DictConfig) -> None:
    from deepspec.cache.pipeline import run_cache_job

    with COMMAND.job():
        exit_code = run_cache_job(cfg)
    if exit_code:
        sys.exit(exit_code)


def main() -> None:
    """Hydra reads the overrides from sys.argv."""
    register_cache_configs()
    COMMAND.run(_cache)
