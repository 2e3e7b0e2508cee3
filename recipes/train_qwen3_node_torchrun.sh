#!/usr/bin/env bash
# One 8-GPU node, torchrun.
# Usage: recipes/train_qwen3_node_torchrun.sh [4b|8b|14b] [dspark|dflash|eagle3] [overrides...]
# Prerequisite: the target's feature cache (data_tools/cache_hiddens.py target=qwen3-<size>, see recipes/README.md).
set -euo pipefail
SIZE=${1:-4b}; DRAFTER=${2:-dspark}; shift $(( $# > 2 ? 2 : $# ))
torchrun --standalone --nproc_per_node 8 train.py experiment=paper target=qwen3-${SIZE} drafter=${DRAFTER} "$@"
