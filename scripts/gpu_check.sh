#!/usr/bin/env bash
# The GPU half, checked, in one call (deepspec/gpu_check/README.md): runs every check with this environment's
# packages and writes OUT_DIR/gpu_check.json (the same JSON object is the last line printed) and
# OUT_DIR/gpu_check.log. Exit 0 only if every check is ok.
#
#   bash scripts/gpu_check.sh OUT_DIR [--wheels DIR] [--time-limit SECONDS] [-- ARGS...]
#
#   OUT_DIR                required: where the report and the log go
#   --wheels DIR           for a machine without network access: first install the wheels in DIR (made elsewhere
#                          by scripts/fetch_gpu_wheels.sh) into a scratch folder put first on the path
#   --time-limit SECONDS   the whole run's limit (default: the profile's, see `python -m deepspec.gpu_check --help`)
#   ARGS                   go to the checks, e.g. `--device cpu` (the CPU dry run) or `--only acceptance tv_loss`
#
#   bash scripts/gpu_check.sh outputs/gpu-check
#   bash scripts/gpu_check.sh /tmp/dry -- --device cpu
set -uo pipefail
usage="usage: $0 OUT_DIR [--wheels DIR] [--time-limit SECONDS] [-- ARGS...]"
if [ $# -eq 0 ] || [ "${1#-}" != "$1" ]; then echo "$usage" >&2; exit 2; fi
OUT_DIR=$1
shift
WHEELS=
LIMIT=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; WHEELS=$2; shift 2 ;;
    --time-limit) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; LIMIT=(--time-limit "$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "$0: unknown option $1 (arguments for the checks go after --)" >&2; echo "$usage" >&2; exit 2 ;;
  esac
done
if [ -n "$WHEELS" ] && ! compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "$0: no wheels in $WHEELS (scripts/fetch_gpu_wheels.sh $WHEELS makes them)" >&2; exit 2
fi
if [ -n "$WHEELS" ]; then WHEELS=$(cd "$WHEELS" && pwd) || exit 2; fi
OUT_DIR=$(mkdir -p "$OUT_DIR" && cd "$OUT_DIR" && pwd) || exit 2
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
{
  echo "[gpu_check.sh] $(date -u +%FT%TZ) $(uname -m) $("$PY" --version 2>&1)"
  if [ -n "$WHEELS" ]; then
    # Exactly the given wheels, without an index, into a folder of this run that shadows the environment's copies.
    SITE=$(mktemp -d "${TMPDIR:-/tmp}/deepspec-gpu-check-site.XXXXXX") || exit 3
    trap 'rm -rf "$SITE"' EXIT
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
      || { echo "[gpu_check.sh] installing the wheels of $WHEELS failed" >&2; exit 3; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    echo "[gpu_check.sh] installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
  fi
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"  # this checkout's deepspec, not an installed one
  "$PY" -m deepspec.gpu_check --out "$OUT_DIR" ${LIMIT[@]+"${LIMIT[@]}"} "$@"
} 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
