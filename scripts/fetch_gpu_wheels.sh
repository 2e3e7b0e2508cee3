#!/usr/bin/env bash
# For a GPU machine without network access: on a machine with network, fill WHEEL_DIR with the wheels the GPU
# check needs beyond a CUDA torch stack, for manylinux x86_64; copy WHEEL_DIR there and run
# `bash scripts/gpu_check.sh OUT_DIR --wheels WHEEL_DIR`, which installs them with `pip install --no-index --no-deps`.
# A machine that can reach a package index needs none of this: `pip install -e .[test]` installs everything.
#
#   bash scripts/fetch_gpu_wheels.sh WHEEL_DIR [--python-version X.Y]
#
#   WHEEL_DIR                 required: a new or wheels-only folder, replaced when the download succeeds
#   --python-version X.Y      the GPU machine's Python (default: the Python running this script)
#
# What the GPU machine is assumed to have already: torch, triton, transformers, accelerate, safetensors,
# tokenizers, numpy, PyYAML, packaging, einops, msgpack, ninja, psutil, py-cpuinfo, tqdm, matplotlib. What the
# GPU check imports beyond that (train.py, data_tools/cache_hiddens.py, deepspec.training): hydra-core ->
# omegaconf, antlr4-python3-runtime; deepspeed -> hjson, pydantic -> pydantic-core, annotated-types,
# typing-inspection, typing-extensions (pydantic needs >= 4.16.0; the machine's version is unknown, so the
# pinned one goes along and shadows it). datasets, wandb, gguf are imported lazily by paths the check does not
# take: they stay behind. Versions: requirements/ci.txt where it pins one, else the CI environment's resolved one.
set -euo pipefail
usage="usage: $0 WHEEL_DIR [--python-version X.Y]"
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then echo "$usage" >&2; exit 2; fi
WHEEL_DIR=$1
shift
PYVER=
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; PYVER=$2; shift 2 ;;
    *) echo "$0: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
# The folder is replaced: refuse one that holds anything but wheels, so a mistyped path loses nothing.
if [ -e "$WHEEL_DIR" ] && [ -n "$(find "$WHEEL_DIR" -mindepth 1 -maxdepth 1 ! -name '*.whl' | head -1)" ]; then
  echo "$0: $WHEEL_DIR holds more than wheels; give a new or a wheels-only folder" >&2; exit 2
fi
WHEEL_DIR=$(mkdir -p "$WHEEL_DIR" && cd "$WHEEL_DIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
PYVER=${PYVER:-$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}

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

rm -rf "$WHEEL_DIR.tmp"
mkdir -p "$WHEEL_DIR.tmp"
# Binary wheels for the GPU machine's interpreter and platform (pydantic-core is the only compiled one).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEEL_DIR.tmp" "${BINARY[@]}"
# Source-only on the registry: build pure-Python wheels here. DS_BUILD_OPS=0: no compiled op is put in
# the wheel; DeepSpeed picks the CUDA accelerator at run time and JIT-compiles an op only if one is used
# (the training config avoids them: torch AdamW, no offload).
"$PY" -m pip wheel -q --no-deps -w "$WHEEL_DIR.tmp" "$ANTLR"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps -w "$WHEEL_DIR.tmp" "$DEEPSPEED"

# One version of each distribution (two would stop the whole install there).
dupes=$(ls "$WHEEL_DIR.tmp" | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then echo "two versions of: $dupes" >&2; exit 1; fi
rm -rf "$WHEEL_DIR"
mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
total=$(du -cb "$WHEEL_DIR"/*.whl | tail -1 | cut -f1)
ls -l "$WHEEL_DIR" | tail -n +2 | awk '{printf "%10d  %s\n", $5, $9}'
echo "total $total bytes ($(( total / 1024 )) KiB) in $(ls "$WHEEL_DIR" | wc -l) wheels for Python $PYVER, in $WHEEL_DIR"
