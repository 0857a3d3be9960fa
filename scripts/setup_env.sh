#!/usr/bin/env bash
# Shared set-up for run.sh and test.sh: create .venv if missing, install torch (the CPU wheel
# pinned here, so a fresh machine does not resolve several GB of CUDA packages), then the project
# (distribution kvcached-sidecar; it compiles three small C extensions: kvcached/copy/*.c, proto/_keytable.c).
# Each step says what it does and how long it took: the first run takes a few minutes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCACHED_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvcached-installed"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$1" ] && [ ! "$ROOT/pyproject.toml" -nt "$STAMP" ] && [ -z "$(find "$ROOT/kvcached/copy" "$ROOT/proto" \( -name "*.c" -o -name "*.h" \) -newer "$STAMP")" ]; then
  exit 0
fi
START=$SECONDS
step() { echo "[setup] $1 ($((SECONDS - START)) s so far)"; }
if [ ! -x "$VENV/bin/python" ]; then
  step "1/4 creating $VENV"
  "$PY" -m venv "$VENV"
fi
step "2/4 upgrading pip"
"$VENV/bin/python" -m pip install -q --upgrade pip
step "3/4 installing torch==2.13.0 (the CPU wheel, a few hundred MB)"
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
step "4/4 installing kvcached-sidecar[$1] and its dependencies (editable)"
# a checkout installed before the distribution was renamed holds it as `kvcached`: drop that
"$VENV/bin/python" -m pip uninstall -q -y kvcached >/dev/null 2>&1 || true
"$VENV/bin/python" -m pip install -q -e "$ROOT[$1]"
echo "$1" > "$STAMP"  # the extras installed: another set installs again
step "done"
