"""Train a drafter on a target-feature cache (Hydra config in deepspec/conf/, DeepSpeed ZeRO; see recipes/).

  python train.py target=smollm2-135m drafter=dspark data.cache_dir=outputs/cache/smollm2-135m
  torchrun --nproc_per_node 8 train.py experiment=paper target=qwen3-4b drafter=dspark
  python train.py -m drafter.num_draft_layers=1,2          # a sweep, one run folder per job
The same as `deepspec train ...` (deepspec.training.cli).
"""

from deepspec.training.cli import main

if __name__ == "__main__":
    main()
