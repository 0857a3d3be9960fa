#!/usr/bin/env bash
# Set up .venv if missing, then run the whole test suite. Extra arguments go to pytest.
#   ./scripts/test.sh [pytest args]              the suite (tests/integration and tests/sglang_hicache
#                                                skip: no vLLM, no SGLang here)
#   ./scripts/test.sh --with-vllm [pytest args]  also build .venv-vllm when missing and run the
#                                                real-vLLM integration tests in it
#   ./scripts/test.sh --with-sglang [...]        also build .venv-sglang when missing and run the
#                                                SGLang HiCache backend tests in it
# (both flags may be given, in either order). The main suite runs on KVCACHED_TEST_WORKERS
# pytest-xdist workers (default 3, on 2 cores too: most of its time is spent waiting on daemons;
# 6.9-7.3 min on 2 cores with 3 on the 2026-12-05 VM, 8.2-8.9 on the one before (8.5-10.1 before
# a stop took 0.03 s), 9-10.7 with 2; 0 runs it
# in one process), the vLLM suite on
# KVCACHED_VLLM_WORKERS (default 0, one process: 6-7 min on 2 cores, its engines started from a
# process that imported vLLM meanwhile and stopped in the background; 2 took 7.6 min, the two
# cores oversubscribed). Paths among the
# arguments choose what runs where: those under tests/integration run in .venv-vllm, those under
# tests/sglang_hicache in .venv-sglang (each with its flag), the others in .venv; with no path,
# each runs its whole part.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WITH_VLLM=0 WITH_SGLANG=0
while [ "${1:-}" = "--with-vllm" ] || [ "${1:-}" = "--with-sglang" ]; do
  [ "$1" = "--with-vllm" ] && WITH_VLLM=1
  [ "$1" = "--with-sglang" ] && WITH_SGLANG=1
  shift
done
OPTS=() MAIN=() INTEGRATION=() SGLANG=()
for arg in "$@"; do
  path="${arg%%::*}"  # a node id names its file
  if [ "${arg#-}" = "$arg" ] && [ -e "$path" ]; then
    case "$(realpath -m "$path")/" in
      "$ROOT/tests/integration/"*) INTEGRATION+=("$arg") ;;
      "$ROOT/tests/sglang_hicache/"*) SGLANG+=("$arg") ;;
      *) MAIN+=("$arg") ;;
    esac
  else
    OPTS+=("$arg")
  fi
done
RUN_MAIN=1 RUN_VLLM=$WITH_VLLM RUN_SGLANG=$WITH_SGLANG
if [ $(( ${#MAIN[@]} + ${#INTEGRATION[@]} + ${#SGLANG[@]} )) -gt 0 ]; then  # paths: only their parts
  [ ${#MAIN[@]} -gt 0 ] || RUN_MAIN=0
  [ ${#INTEGRATION[@]} -gt 0 ] || RUN_VLLM=0
  [ ${#SGLANG[@]} -gt 0 ] || RUN_SGLANG=0
  if [ ${#INTEGRATION[@]} -gt 0 ] && [ "$WITH_VLLM" = 0 ]; then
    echo "tests/integration runs in .venv-vllm: ./scripts/test.sh --with-vllm $*" >&2
    exit 2
  fi
  if [ ${#SGLANG[@]} -gt 0 ] && [ "$WITH_SGLANG" = 0 ]; then
    echo "tests/sglang_hicache runs in .venv-sglang: ./scripts/test.sh --with-sglang $*" >&2
    exit 2
  fi
fi
[ ${#INTEGRATION[@]} -gt 0 ] || INTEGRATION=(tests/integration)
[ ${#SGLANG[@]} -gt 0 ] || SGLANG=(tests/sglang_hicache)
"$ROOT/scripts/setup_env.sh" test,mooncake  # the mooncake extra: its tier's tests run
cd "$ROOT"
NO_TESTS=5  # pytest's exit status when its selection collected nothing
main_rc=$NO_TESTS vllm_rc=$NO_TESTS sglang_rc=$NO_TESTS
check() {  # a part's status: nothing collected is fine here (judged at the end), else it must pass
  [ "$1" = "$NO_TESTS" ] || [ "$1" = 0 ] || exit "$1"
}
if [ "$RUN_MAIN" = 1 ]; then
  main_rc=0
  "$ROOT/.venv/bin/python" -m pytest -n "${KVCACHED_TEST_WORKERS:-3}" ${OPTS[@]+"${OPTS[@]}"} \
    ${MAIN[@]+"${MAIN[@]}"} || main_rc=$?
  check "$main_rc"
fi
if [ "$RUN_VLLM" = 1 ]; then
  "$ROOT/scripts/setup_vllm_env.sh"
  vllm_rc=0
  "$ROOT/.venv-vllm/bin/python" -m pytest -n "${KVCACHED_VLLM_WORKERS:-0}" ${OPTS[@]+"${OPTS[@]}"} \
    "${INTEGRATION[@]}" || vllm_rc=$?
  check "$vllm_rc"
fi
if [ "$RUN_SGLANG" = 1 ]; then
  "$ROOT/scripts/setup_sglang_env.sh"
  sglang_rc=0
  "$ROOT/.venv-sglang/bin/python" -m pytest ${OPTS[@]+"${OPTS[@]}"} "${SGLANG[@]}" || sglang_rc=$?
  check "$sglang_rc"
fi
# a selection that one environment has nothing of is fine; one that none has is not
if [ "$main_rc" = "$NO_TESTS" ] && [ "$vllm_rc" = "$NO_TESTS" ] && [ "$sglang_rc" = "$NO_TESTS" ]; then
  echo "no test matched these arguments in .venv, .venv-vllm or .venv-sglang" >&2
  exit "$NO_TESTS"
fi
