#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs kvtransport with its backends and test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v -i "warning: location" || true
# torch: keep the one present (e.g. a CUDA build on a GPU host); else the CPU build
if ! python -c "import torch" 2>/dev/null; then
  pip install -q "torch==2.13.0" 2>&1 | grep -v -i "warning: location" || true
fi
pip install -q -e ".[dev,bench]" -e backends/nccl -e backends/ucx 2>&1 | grep -v -i "warning: location" || true
python -c "import kvtransport; [print('  ', r) for r in kvtransport.available_backends()]"
