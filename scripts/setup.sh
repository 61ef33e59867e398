#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs kvtransport with its backends and test tools. Idempotent.
# Fails loudly when an install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
quiet() { "$@" 2> >(grep -v -i "warning: location" >&2); }  # drop one harmless pip warning, keep the status
quiet python -m pip install -q --upgrade pip
# torch: keep the one present (e.g. a CUDA build on a GPU host); else the CPU build
if ! python -c "import torch" 2>/dev/null; then
  quiet pip install -q "torch==2.13.0"
fi
quiet pip install -q -e ".[dev,bench]" -e backends/nccl -e backends/ucx -e backends/mscclpp
python -c "import kvtransport, kvtransport_nccl, kvtransport_ucx, kvtransport_mscclpp; [print('  ', r) for r in kvtransport.available_backends()]"
command -v ruff >/dev/null && command -v mypy >/dev/null
