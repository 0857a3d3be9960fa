#!/usr/bin/env bash
# Set up .venv if missing, then run the whole test suite. Extra arguments go to pytest.
#   ./scripts/test.sh [pytest args]              the suite (tests/integration skips: no vLLM here)
#   ./scripts/test.sh --with-vllm [pytest args]  also build .venv-vllm when missing and run the
#                                                real-vLLM integration tests in it
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_VLLM=0
if [ "${1:-}" = "--with-vllm" ]; then
  WITH_VLLM=1
  shift
fi
"$ROOT/scripts/setup_env.sh" test
cd "$ROOT"
"$ROOT/.venv/bin/python" -m pytest "$@"
if [ "$WITH_VLLM" = 1 ]; then
  "$ROOT/scripts/setup_vllm_env.sh"
  "$ROOT/.venv-vllm/bin/python" -m pytest tests/integration "$@"
fi
