#!/usr/bin/env bash
# One 8-GPU node, DeepSpeed launcher. Usage: recipes/train_qwen3_node_deepspeed.sh [4b|8b|14b] [dspark|dflash|eagle3] [overrides...]
set -euo pipefail
SIZE=${1:-4b}; DRAFTER=${2:-dspark}; shift $(( $# > 2 ? 2 : $# ))
deepspeed --num_gpus 8 train.py experiment=paper target=qwen3-${SIZE} drafter=${DRAFTER} "$@"
