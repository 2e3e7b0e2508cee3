#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels the GPU machine lacks, for its Python 3.12 on manylinux x86_64;
# they travel with the checkout (copy .whl/ along; at most 64 MiB together) and scripts/gpu_check.sh
# installs them there with `pip install --no-index --no-deps --target /tmp/site .whl/*.whl`.
#
# What a GPU machine without network access is assumed to have already: torch, triton,
# transformers, accelerate, safetensors, tokenizers, numpy, PyYAML, packaging, einops, msgpack, ninja,
# psutil, py-cpuinfo, tqdm, matplotlib. What the GPU check imports beyond that (train.py,
# data_tools/cache_hiddens.py, deepspec.training): hydra-core -> omegaconf, antlr4-python3-runtime;
# deepspeed -> hjson, pydantic -> pydantic-core, annotated-types, typing-inspection, typing-extensions
# (pydantic needs >= 4.16.0; the machine's version is unknown, so the pinned one travels and shadows it).
# datasets, wandb, gguf are imported lazily by paths the check does not take: they stay behind.
# Versions: requirements/ci.txt where it pins one, else the CI environment's resolved version.
#
#   bash scripts/fetch_gpu_wheels.sh            # then check: ls -la .whl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=.whl
LIMIT_MIB=64

pinned() {  # the version requirements/ci.txt pins for $1 (empty when it pins none)
  sed -n "s/^$1==\([^ #]*\).*/\1/p" requirements/ci.txt
}
DEEPSPEED=deepspeed==$(pinned deepspeed)
HYDRA=hydra-core==$(pinned hydra-core)
OMEGACONF=omegaconf==$(pinned omegaconf)
# Not pinned by ci.txt: the versions its resolution installs (hydra 1.3 requires antlr4 4.9.*).
ANTLR=antlr4-python3-runtime==4.9.3
BINARY=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing-extensions==4.16.0 "$HYDRA" "$OMEGACONF")

rm -rf "$OUT.tmp"
mkdir -p "$OUT.tmp"
# Binary wheels for the GPU machine's interpreter and platform (pydantic-core is the only compiled one).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT.tmp" "${BINARY[@]}"
# Source-only on the registry: build pure-Python wheels here. DS_BUILD_OPS=0: no compiled op is put in
# the wheel; DeepSpeed picks the CUDA accelerator at run time and JIT-compiles an op only if one is used
# (the training config avoids them: torch AdamW, no offload).
"$PY" -m pip wheel -q --no-deps -w "$OUT.tmp" "$ANTLR"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$OUT.tmp" "$DEEPSPEED"

# One version of each distribution (two would stop the whole install there).
dupes=$(ls "$OUT.tmp" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then echo "two versions of: $dupes" >&2; exit 1; fi
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
ls -l "$OUT" | tail -n +2 | awk '{printf "%10d  %s\n", $5, $9}'
echo "total $total bytes ($(( total / 1024 )) KiB) in $(ls "$OUT" | wc -l) wheels"
if [ "$total" -gt $(( LIMIT_MIB * 1024 * 1024 / 4 )) ]; then
  echo "the wheels take over a quarter of the ${LIMIT_MIB} MiB that travels with the checkout" >&2
  exit 1
fi
