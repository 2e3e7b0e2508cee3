#!/usr/bin/env bash
# CPU only: DSpark on the embedded SmolLM2-135M with 2 processes (gloo), the quickstart's preset (experiment=cpu)
# with half its micro batch per process. Builds a small cache first.
set -euo pipefail
python data_tools/cache_hiddens.py target=smollm2-135m data.prompts=sharegpt data.limit=${LIMIT:-200} \
  cache.max_length=512 cache.out_dir=outputs/cache/smollm2-135m
torchrun --standalone --nproc_per_node 2 train.py experiment=cpu trainer.micro_batch_size=2 "$@"
