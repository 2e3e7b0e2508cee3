#!/usr/bin/env bash
# One 8-GPU node, DeepSpeed launcher.
# Usage: recipes/train_qwen3_node_deepspeed.sh [4b|8b|14b] [dspark|dflash|eagle3] [overrides...]
# --no_local_rank: the launcher would append --local_rank=N, which train.py's Hydra command line refuses; each
# process reads its rank from the environment the launcher sets.
set -euo pipefail
SIZE=${1:-4b}; DRAFTER=${2:-dspark}; shift $(( $# > 2 ? 2 : $# ))
deepspeed --no_local_rank --num_gpus 8 train.py experiment=paper target=qwen3-${SIZE} drafter=${DRAFTER} "$@"
