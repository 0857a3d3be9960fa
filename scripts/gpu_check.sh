#!/usr/bin/env bash
# The CUDA path on a machine with a GPU, in stages that each have a time limit:
#   1. smoke     ../shared/tools/gpu_smoke.py when present (IPC mapping, one offload, one
#                layer-wise load, byte check)                               SMOKE_S (180 s)
#   2. tests     tests/gpu, each test under a thread-method timeout (a hung CUDA call cannot
#                be interrupted by a signal)                  TEST_S per test (120), TESTS_S (420)
#   3. probe     scripts/gpu_dma_probe.py: what limits the dma strategy    PROBE_S (90 s)
#   4. quick     kvcached bench transfer --device cuda:N --quick         QUICK_S (300 s)
#   5. bench     the same at full sizes (skipped with --quick)           BENCH_S (540 s)
#   ./scripts/gpu_check.sh [--quick] [--only smoke,tests,probe,quick,bench] [cuda:N]
# The whole run stays under TOTAL_S (560 s: a lent machine's commands end at 600 s): each stage's
# limit is cut to what is left, and a stage with under 20 s left is skipped (said in the log).
# --only runs the named stages alone. On an H100 (2026-11-27) smoke, tests, quick and bench took
# about 10 s, 183 s, 35 s and 60 s: all fit in one command (a lent machine's first call adds its
# start; the probe is newer, written for about 20 s).
# It uses the machine's own python3 and its CUDA build of PyTorch (never pip-installs torch) with
# this checkout on PYTHONPATH. Python packages the machine lacks (pyzmq, posix_ipc, ...) are
# installed into a temporary folder from ./.whl only (docs/cuda.md): when a wheel is
# missing there it stops at once and says which; it never reaches for a package index.
# Every stage writes its log under $OUT (else a temporary folder, printed) as it runs, so a
# stage killed at its limit leaves what it wrote; daemons keep their logs in $OUT/daemon-logs,
# packed into daemon-logs.tar.gz at the end. At most 8 files are left under $OUT (what a lent
# machine sends back): gpu_check.log, setup.log, smoke.log, tests.log, bench.log (probe, quick, full),
# the two bench JSONs and the daemons' logs.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0
ONLY="smoke,tests,probe,quick,bench"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --only) ONLY="$2"; shift 2 ;;
    *) break ;;
  esac
done
DEV="${1:-cuda:0}"
END_AT=$(( $(date +%s) + ${TOTAL_S:-560} ))
wanted() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
PY="${PYTHON:-python3}"
SITE="$(mktemp -d /tmp/kvcached-gpu.XXXXXX)"
LOGS="${OUT:-$SITE}"
mkdir -p "$LOGS/daemon-logs"
export KVCACHED_LOG_DIR="$LOGS/daemon-logs"
cd "$ROOT"
say() { echo "[gpu_check] $*" | tee -a "$LOGS/gpu_check.log"; }

# the three import names, as pyproject.toml maps them, without installing the project
ln -s "$ROOT/kvcached" "$SITE/kvcached"
ln -s "$ROOT/client" "$SITE/kvcached_client"
ln -s "$ROOT/proto" "$SITE/kvcached_proto"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$PY" - <<'PYEOF'
import importlib.util
need = {"zmq": "pyzmq", "posix_ipc": "posix_ipc", "msgpack": "msgpack", "xxhash": "xxhash",
        "prometheus_client": "prometheus_client", "pytest": "pytest",
        "pytest_timeout": "pytest_timeout"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [ -n "$missing" ]; then
  absent=""
  for pkg in $missing; do
    ls "$ROOT"/.whl/"$pkg"-*.whl >/dev/null 2>&1 || ls "$ROOT"/.whl/"${pkg//_/-}"-*.whl >/dev/null 2>&1 \
      || absent="$absent $pkg"
  done
  if [ -n "$absent" ]; then
    say "missing and not in $ROOT/.whl:$absent - download them on a machine with an index for this"
    say "machine's python (docs/cuda.md: pip download --only-binary=:all: ...) and carry .whl"
    exit 3
  fi
  say "installing from .whl into $SITE: $missing"
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    "$ROOT"/.whl/*.whl >> "$LOGS/setup.log" 2>&1 || { say "pip from .whl failed: $LOGS/setup.log"; exit 3; }
fi

# the C extensions (kvcached/copy/*.c: the SIGBUS guard, the native CPU copies; proto/_keytable.c:
# the key table) are built at install; without an install, build them here for this python when
# a C compiler is there (the daemon maps engine shared memory - CPU KV and the order words of CUDA
# KV - only with the guard)
for src in kvcached/copy/_sigbus.c kvcached/copy/_blockcopy.c proto/_keytable.c; do
  mod=$(basename "$src" .c)
  pkg=$([ "${src%%/*}" = proto ] && echo kvcached_proto || echo kvcached.copy)
  if ! "$PY" -c "import $pkg.$mod" 2>/dev/null && command -v cc >/dev/null; then
    ext=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
    inc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
    timeout 60 cc -O2 -shared -fPIC -I"$inc" "$src" -o "${src%.c}$ext" \
      >> "$LOGS/setup.log" 2>&1 && say "built ${src%.c}$ext" \
      || say "$pkg.$mod not built ($LOGS/setup.log)"
  fi
done

timeout 120 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  say "this python's torch sees no CUDA device"; exit 1; }
timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
  2>&1 | tee -a "$LOGS/gpu_check.log" || true

# stage NAME LIMIT_S CMD...: runs CMD under `timeout`, its output appended to $LOGS/NAME.log as it
# comes (probe, quick and bench share bench.log: a lent machine sends back at most 8 files)
stage() {
  local name="$1" limit="$2"; shift 2
  local logname="$name"; { [ "$name" = quick ] || [ "$name" = probe ]; } && logname=bench
  local left=$(( END_AT - $(date +%s) ))
  if ! wanted "$name"; then say "$name not asked for (--only $ONLY)"; return 200; fi
  if [ "$left" -lt 20 ]; then say "$name skipped: ${left} s left of TOTAL_S"; return 201; fi
  [ "$limit" -gt "$left" ] && limit="$left"
  say "$name (limit ${limit} s): $*"
  echo "== $name: $*" >> "$LOGS/$logname.log"
  timeout --kill-after=15 "$limit" "$@" >> "$LOGS/$logname.log" 2>&1
  local rc=$?
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && say "$name ran past its ${limit} s limit (exit $rc)"
  say "$name exit $rc; log $LOGS/$logname.log"
  return "$rc"
}

smoke_rc=skipped
SMOKE="$ROOT/../shared/tools/gpu_smoke.py"
# ../shared does not travel to a lent device machine: a copy carried in ./.gpu (ignored) is used
[ -f "$SMOKE" ] || SMOKE="$ROOT/.gpu/gpu_smoke.py"
if [ -f "$SMOKE" ]; then
  # the smoke predates the daemon's layer folders: it imports the host pool by its old name
  sed 's/kvcached\.host_pool/kvcached.host.pool/' "$SMOKE" > "$SITE/gpu_smoke.py"
  SMOKE="$SITE/gpu_smoke.py"
  OUT="$LOGS/daemon-logs" SMOKE_DEV="$DEV" stage smoke "${SMOKE_S:-180}" "$PY" -u "$SMOKE"; smoke_rc=$?
  tail -n 20 "$LOGS/smoke.log"
fi

stage tests "${TESTS_S:-420}" "$PY" -m pytest tests/gpu -v -p no:cacheprovider -o addopts="" \
  --timeout "${TEST_S:-120}" --timeout-method thread
tests_rc=$?
tail -n 5 "$LOGS/tests.log" 2>/dev/null

stage probe "${PROBE_S:-90}" "$PY" -u scripts/gpu_dma_probe.py --device "$DEV"
probe_rc=$?
stage quick "${QUICK_S:-300}" "$PY" -u -m kvcached bench transfer --device "$DEV" --quick \
  --json --out "$LOGS/bench_transfer_cuda_quick.json"
quick_rc=$?
bench_rc=skipped
if [ "$QUICK" = 0 ] && { [ "$quick_rc" -eq 0 ] || [ "$quick_rc" -eq 200 ]; }; then
  stage bench "${BENCH_S:-540}" "$PY" -u -m kvcached bench transfer --device "$DEV" --json \
    --out "$LOGS/bench_transfer_cuda.json"
  bench_rc=$?
fi

echo
echo "== gpu_check ($DEV) =="
grep -E "^(=+ .*(passed|failed|error|skipped).* =+)$" "$LOGS/tests.log" 2>/dev/null | tail -n 1
for result in bench_transfer_cuda.json bench_transfer_cuda_quick.json; do
  if [ -s "$LOGS/$result" ]; then
    timeout 60 "$PY" -c "import json, sys; from kvcached.bench.transfer_cuda import format_result; print(format_result(json.load(open(sys.argv[1]))))" "$LOGS/$result"
    break
  fi
done
# the daemons' logs as one file: what comes back from a lent machine is at most 8 files
if [ -n "$(ls -A "$LOGS/daemon-logs" 2>/dev/null)" ]; then
  timeout 60 tar -czf "$LOGS/daemon-logs.tar.gz" -C "$LOGS" daemon-logs && rm -rf "$LOGS/daemon-logs"
else
  rmdir "$LOGS/daemon-logs" 2>/dev/null
fi
say "smoke $smoke_rc, tests $tests_rc, probe $probe_rc, quick bench $quick_rc, bench $bench_rc (200: not asked for, 201: no time left); logs in $LOGS"
ok() { [ "$1" = 0 ] || [ "$1" = 200 ] || [ "$1" = skipped ]; }
ok "$tests_rc" && ok "$probe_rc" && ok "$quick_rc" && ok "$bench_rc"
