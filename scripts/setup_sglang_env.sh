#!/usr/bin/env bash
# Build .venv-sglang for the SGLang tests (./scripts/test.sh --with-sglang): torch first (the
# CPU wheel), sglang 0.5.23 without its dependencies (its pins ask for CUDA builds of torch,
# flashinfer and sgl-kernel), then only what its HiCache storage and host-pool modules import
# on CPU, then kvcached. Every install is constrained to torch==2.13.0, so nothing can pull a
# CUDA torch. torchvision is left out (PyPI's build does not load beside this torch): the tests
# stand in for it at import time (tests/sglang_hicache/torchvision_standin.py says what that replaces).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCACHED_SGLANG_VENV:-$ROOT/.venv-sglang}"
PY="${PYTHON:-python3}"
SGLANG_VERSION="${KVCACHED_SGLANG_VERSION:-0.5.23}"
STAMP="$VENV/.kvcached-sglang-installed"
if [ -f "$STAMP" ] && [ ! "$ROOT/pyproject.toml" -nt "$STAMP" ] && [ -z "$(find "$ROOT/kvcached/copy" "$ROOT/proto" \( -name "*.c" -o -name "*.h" \) -newer "$STAMP")" ] \
   && [ ! "${BASH_SOURCE[0]}" -nt "$STAMP" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || { echo "[setup-sglang] creating $VENV"; "$PY" -m venv "$VENV"; }
VPY="$VENV/bin/python"
CONSTRAINTS="$VENV/kvcached-constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"
echo "[setup-sglang] installing torch==2.13.0, sglang==$SGLANG_VERSION (no deps) and what its storage code imports"
"$VPY" -m pip install -q --upgrade pip packaging
"$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
# what `import sglang.srt.mem_cache.pool_host.mha` and the storage factory reach on CPU, and
# (openai ... fastapi) what its scheduler's weight updater does (the weight-update tests)
"$VPY" -m pip install -q -c "$CONSTRAINTS" orjson psutil pybase64 requests pillow starlette msgspec \
  aiohttp dill apache-tvm-ffi ipython sentencepiece compressed-tensors gguf triton \
  openai partial_json_parser setproctitle einops uvicorn fastapi
"$VPY" -m pip uninstall -q -y kvcached >/dev/null 2>&1 || true  # the distribution's old name
"$VPY" -m pip install -q -c "$CONSTRAINTS" -e "$ROOT[test]"
"$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" \
  || { echo "[setup-sglang] torch is not 2.13.0 in $VENV" >&2; exit 1; }
touch "$STAMP"
