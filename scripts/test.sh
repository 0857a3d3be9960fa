#!/usr/bin/env bash
# Set up .venv when missing, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup_env.sh" test
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
