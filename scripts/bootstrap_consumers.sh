#!/usr/bin/env bash
# Idempotent: add the consumer libraries of DeepSpec's exports (speculators, dflash, specforge) to the pinned
# environment made by scripts/bootstrap.sh (which runs this script last), for the interop tests in
# tests/export/consumers.
# All of requirements/consumers.txt goes in with --no-deps: the libraries' declared pins conflict with
# requirements/ci.txt, yet they import and run with our versions; the file lists the full closure of what they
# import beyond ci.txt, so nothing else is resolved or upgraded. Then every consumer must import.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DEEPSPEC_VENV:-.venv}
[ -x "$VENV/bin/python" ] || bash scripts/bootstrap.sh
stamp="$VENV/.deepspec-consumers-installed"
want=$(cat requirements/ci.txt requirements/consumers.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
"$VENV/bin/python" -m pip install -q --no-deps -r requirements/consumers.txt
# Fail here, not in the tests, when the closure above misses a module.
"$VENV/bin/python" - <<'PY'
import importlib, importlib.metadata as md
for module in ("speculators", "speculators.models.dflash", "speculators.models.dspark", "speculators.models.mtp",
               "speculators.utils.loading", "dflash.model", "specforge.modeling.auto", "specforge.modeling.draft"):
    importlib.import_module(module)
print("consumers:", {name: md.version(name) for name in ("speculators", "dflash", "specforge")})
PY
echo "$want" > "$stamp"
