#!/usr/bin/env bash
# The GPU half, checked, in one call (deepspec/gpu_check/README.md): installs the wheels carried in .whl/
# (made here by scripts/fetch_gpu_wheels.sh), then runs every check and writes OUT_DIR/gpu_check.json
# (the same JSON object is the last line printed) and OUT_DIR/gpu_check.log. Exit 0 only if every check is ok.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [-- ARGS...]     # OUT_DIR defaults to $OUT; ARGS go to the checks,
#   bash scripts/gpu_check.sh /tmp/dry -- --device cpu    # e.g. the CPU dry run, or --only acceptance tv_loss
set -uo pipefail
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then OUT_DIR=$1; shift; else OUT_DIR=${OUT:-}; fi
[ "${1:-}" = "--" ] && shift
if [ -z "$OUT_DIR" ]; then echo "usage: $0 [OUT_DIR] [-- ARGS...] (OUT_DIR defaults to \$OUT)" >&2; exit 2; fi
OUT_DIR=$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd) || exit 2
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
WHEELS=${GPU_CHECK_WHEELS:-.whl}  # another folder, or one that does not exist to use this environment's packages
{
  echo "[gpu_check.sh] $(date -u +%FT%TZ) $(uname -m) $("$PY" --version 2>&1)"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    # The machine has no network: the carried wheels, exactly as given, into a folder put first on the path.
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
      || { echo "[gpu_check.sh] installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "[gpu_check.sh] installed $(ls "$WHEELS"/*.whl | wc -l) carried wheels into $SITE"
  else
    echo "[gpu_check.sh] no wheels in $WHEELS/: using the packages of this environment"
  fi
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # this checkout's deepspec, not an installed one
  "$PY" -m deepspec.gpu_check --out "$OUT_DIR" "$@"
} 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
