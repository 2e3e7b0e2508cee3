"""Train a drafter on a target-feature cache (Hydra config in conf/, DeepSpeed ZeRO; see recipes/).

  python train.py target=smollm2-135m drafter=dspark data.cache_dir=outputs/cache/smollm2-135m
  torchrun --nproc_per_node 8 train.py experiment=dspark_qwen3-4b
  python train.py -m drafter.num_draft_layers=1,2          # a sweep, one run folder per job
"""

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    from deepspec.training import finish_process, run

    hydra_cfg = HydraConfig.get()
    run(cfg, out_dir=hydra_cfg.runtime.output_dir)
    if hydra_cfg.mode != RunMode.MULTIRUN:  # a sweep's later jobs still need the process
        finish_process(cfg.deepspeed.stage)


if __name__ == "__main__":
    main()
