"""Cache target features for drafter training: prompts/answers -> sharded safetensors cache (deepspec.cache).

  python data_tools/cache_hiddens.py data.prompts=answers.jsonl cache.out_dir=cache/smollm2   # build
  python data_tools/cache_hiddens.py mode=estimate ...   # print the size estimate and exit
  python data_tools/cache_hiddens.py mode=verify cache.out_dir=...   # checksums; exit 1 on problems
  torchrun --nproc_per_node 2 data_tools/cache_hiddens.py ...   # each rank writes its own shards
"""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from deepspec.cache.pipeline import run_cache_job


@hydra.main(version_base=None, config_path="../conf", config_name="cache_hiddens")
def main(cfg: DictConfig) -> None:
    exit_code = run_cache_job(OmegaConf.to_container(cfg, resolve=True))
    if exit_code:
        sys.exit(exit_code)


if __name__ == "__main__":
    main()
