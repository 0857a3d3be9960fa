#!/usr/bin/env bash
# The CUDA path on a machine with a GPU: runs tests/gpu/, then
# `kvcached bench transfer --device cuda:N --json`, and prints a short table last.
#   ./scripts/gpu_check.sh [cuda:N]
# It uses the machine's own python3 and its CUDA build of PyTorch (never pip-installs torch) with
# this checkout on PYTHONPATH. Python packages the machine lacks (pyzmq, posix_ipc, ...) are
# installed into a temporary folder: from ./.whl when such a folder of wheels is present
# (machines without a package index; see README "CUDA path"), else from the index.
# Logs and the JSON result go to $OUT when set, else to the temporary folder (printed).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEV="${1:-cuda:0}"
PY="${PYTHON:-python3}"
SITE="$(mktemp -d /tmp/kvcached-gpu.XXXXXX)"
LOGS="${OUT:-$SITE}"
cd "$ROOT"

# the three import names, as pyproject.toml maps them, without installing the project
ln -s "$ROOT/kvcached" "$SITE/kvcached"
ln -s "$ROOT/client" "$SITE/kvcached_client"
ln -s "$ROOT/proto" "$SITE/kvcached_proto"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"zmq": "pyzmq", "posix_ipc": "posix_ipc", "msgpack": "msgpack", "xxhash": "xxhash",
        "prometheus_client": "prometheus-client", "pytest": "pytest",
        "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  echo "[gpu_check] installing into $SITE: $missing"
  if [ -d "$ROOT/.whl" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$ROOT"/.whl/*.whl || exit 1
  else
    "$PY" -m pip install -q --target "$SITE" $missing || exit 1
  fi
fi

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "[gpu_check] this python's torch sees no CUDA device"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "[gpu_check] tests/gpu"
"$PY" -m pytest tests/gpu -v -p no:cacheprovider -o addopts="" --timeout 600 2>&1 | tee "$LOGS/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "[gpu_check] kvcached bench transfer --device $DEV --json"
"$PY" -m kvcached bench transfer --device "$DEV" --json --out "$LOGS/bench_transfer_cuda.json" \
  > "$LOGS/bench_transfer_cuda.out" 2>&1
bench_rc=$?
tail -n 20 "$LOGS/bench_transfer_cuda.out"

echo
echo "== gpu_check ($DEV) =="
grep -E "^(=+ .*(passed|failed|error|skipped).* =+)$" "$LOGS/gpu_tests.log" | tail -n 1
if [ "$bench_rc" -eq 0 ]; then
  "$PY" -c "import json, sys; from kvcached.bench.transfer_cuda import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$LOGS/bench_transfer_cuda.json"
else
  echo "bench failed (exit $bench_rc): see $LOGS/bench_transfer_cuda.out"
fi
echo "tests exit $tests_rc, bench exit $bench_rc; logs in $LOGS"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
