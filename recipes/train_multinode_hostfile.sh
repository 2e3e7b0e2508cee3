#!/usr/bin/env bash
# Several nodes with the DeepSpeed launcher and a hostfile ("node1 slots=8" per line; passwordless ssh,
# same repo path and cache path on every node). Usage: HOSTFILE=hostfile recipes/train_multinode_hostfile.sh \
#   [target] [drafter] [overrides...]. With N nodes keep trainer.global_batch_size divisible by 8 x N x micro batch.
# --no_local_rank: the launcher would append --local_rank=N, which train.py's Hydra command line refuses; each
# process reads its rank from the environment the launcher sets.
set -euo pipefail
TARGET=${1:-qwen3-14b}; DRAFTER=${2:-dspark}; shift $(( $# > 2 ? 2 : $# ))
deepspeed --no_local_rank --hostfile "${HOSTFILE:-hostfile}" --master_port "${MASTER_PORT:-29500}" \
  train.py experiment=paper target=${TARGET} drafter=${DRAFTER} "$@"
