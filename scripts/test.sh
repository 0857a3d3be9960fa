#!/usr/bin/env bash
# Set up .venv if missing, then run the whole test suite. Extra arguments go to pytest.
#   ./scripts/test.sh [pytest args]              the suite (tests/integration skips: no vLLM here)
#   ./scripts/test.sh --with-vllm [pytest args]  also build .venv-vllm when missing and run the
#                                                real-vLLM integration tests in it
# The main suite runs on KVCACHED_TEST_WORKERS pytest-xdist workers (default 2: most of its
# time is spent waiting on daemons; 0 runs it in one process).
# Paths among the arguments choose what runs where: those under tests/integration run in
# .venv-vllm (with --with-vllm), the others in .venv; with no path, each runs its whole part.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_VLLM=0
if [ "${1:-}" = "--with-vllm" ]; then
  WITH_VLLM=1
  shift
fi
OPTS=() MAIN=() INTEGRATION=()
for arg in "$@"; do
  path="${arg%%::*}"  # a node id names its file
  if [ "${arg#-}" = "$arg" ] && [ -e "$path" ]; then
    case "$(realpath -m "$path")/" in
      "$ROOT/tests/integration/"*) INTEGRATION+=("$arg") ;;
      *) MAIN+=("$arg") ;;
    esac
  else
    OPTS+=("$arg")
  fi
done
RUN_MAIN=1 RUN_VLLM=$WITH_VLLM
if [ ${#MAIN[@]} -eq 0 ] && [ ${#INTEGRATION[@]} -gt 0 ]; then
  RUN_MAIN=0
  if [ "$WITH_VLLM" = 0 ]; then
    echo "tests/integration runs in .venv-vllm: ./scripts/test.sh --with-vllm $*" >&2
    exit 2
  fi
elif [ ${#INTEGRATION[@]} -eq 0 ] && [ ${#MAIN[@]} -gt 0 ]; then
  RUN_VLLM=0
fi
[ ${#INTEGRATION[@]} -gt 0 ] || INTEGRATION=(tests/integration)
"$ROOT/scripts/setup_env.sh" test
cd "$ROOT"
NO_TESTS=5  # pytest's exit status when its selection collected nothing
main_rc=$NO_TESTS vllm_rc=$NO_TESTS
if [ "$RUN_MAIN" = 1 ]; then
  main_rc=0
  "$ROOT/.venv/bin/python" -m pytest -n "${KVCACHED_TEST_WORKERS:-2}" ${OPTS[@]+"${OPTS[@]}"} \
    ${MAIN[@]+"${MAIN[@]}"} || main_rc=$?
  [ "$main_rc" != "$NO_TESTS" ] || [ "$RUN_VLLM" = 1 ] || exit "$NO_TESTS"
  [ "$main_rc" = "$NO_TESTS" ] || [ "$main_rc" = 0 ] || exit "$main_rc"
fi
if [ "$RUN_VLLM" = 1 ]; then
  "$ROOT/scripts/setup_vllm_env.sh"
  vllm_rc=0
  "$ROOT/.venv-vllm/bin/python" -m pytest ${OPTS[@]+"${OPTS[@]}"} "${INTEGRATION[@]}" || vllm_rc=$?
  [ "$vllm_rc" = "$NO_TESTS" ] || [ "$vllm_rc" = 0 ] || exit "$vllm_rc"
fi
# a selection that one environment has nothing of is fine; one that neither has is not
if [ "$main_rc" = "$NO_TESTS" ] && [ "$vllm_rc" = "$NO_TESTS" ]; then
  echo "no test matched these arguments in .venv or .venv-vllm" >&2
  exit "$NO_TESTS"
fi
