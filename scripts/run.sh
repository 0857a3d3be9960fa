#!/usr/bin/env bash
# The main job. Sets up .venv when missing, then starts a kvcached daemon on the embedded
# default (CPU device, RAM host tier, disk tier under var/disk) and runs the demo engine on it:
# a small transformer (random weights, no download) whose PrefixCacheManager drives the daemon.
# It prints time-to-first-token for recompute vs GPU hit vs host hit vs disk hit (after a daemon
# restart), checks the continuations equal the recompute's, prints the status table and stops
# the daemon, leaving nothing behind but the disk tier's files.
#   ./scripts/run.sh [demo_engine.py options]   the demo engine (--help lists them)
#   ./scripts/run.sh --serve-only               keep the daemon in the foreground until Ctrl-C
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh" test,mooncake  # the same install as test.sh (one .venv)
PY="$ROOT/.venv/bin/python"
INSTANCE="${KVCACHED_INSTANCE:-demo}"
RUN_DIR="${KVCACHED_RUN_DIR:-$ROOT/var/run}"
DISK="${KVCACHED_DISK:-disk://$ROOT/var/disk?capacity_gb=4}"
mkdir -p "$ROOT/var"
if [ "${1:-}" = "--serve-only" ]; then
  shift
  exec "$PY" -m kvcached serve --instance "$INSTANCE" --run-dir "$RUN_DIR" --device cpu \
    --host-cache-gb "${KVCACHED_HOST_CACHE_GB:-1}" --storage "$DISK" "$@"
fi
exec "$PY" "$ROOT/scripts/demo_engine.py" --instance "$INSTANCE" --run-dir "$RUN_DIR" \
  --storage "$DISK" --status "$@"
