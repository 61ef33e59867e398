#!/usr/bin/env bash
# Sets everything up, then runs lint, type checks and the whole test suite (GPU tests skip with the reason).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
. .venv/bin/activate
ruff check kvtransport backends tests benchmarks integration
mypy
HYPOTHESIS_PROFILE=ci python -m pytest -q "$@"
