#!/usr/bin/env bash
# Several nodes with torchrun's c10d rendezvous: run this same line on every node.
#   NNODES=2 RDZV_HOST=node1 recipes/train_multinode_torchrun.sh [target] [drafter] [overrides...]
set -euo pipefail
TARGET=${1:-qwen3-14b}; DRAFTER=${2:-dspark}; shift $(( $# > 2 ? 2 : $# ))
torchrun --nnodes "${NNODES:-2}" --nproc_per_node "${NPROC_PER_NODE:-8}" \
  --rdzv_backend c10d --rdzv_endpoint "${RDZV_HOST:?set RDZV_HOST}:${RDZV_PORT:-29400}" \
  --rdzv_id "${RDZV_ID:-deepspec}" \
  train.py experiment=paper target=${TARGET} drafter=${DRAFTER} "$@"
