#!/usr/bin/env bash
# Sets everything up, then runs lint, type checks and the whole test suite: the core, every backend's
# conformance suite, the benchmarks' smoke run, and the vLLM integration (a CPU build of vLLM in its own
# venv, .vllm-venv; SKIP_VLLM=1 leaves that stage out). GPU tests skip here with the reason.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
. .venv/bin/activate
ruff check -q $(ls -d kvtransport backends tests benchmarks integration scripts 2>/dev/null)
mypy
# every GB/s and % figure of README.md and docs/benchmarks.md comes from a committed log or JSON that its
# section cites (derived figures: docs/figures-derived.toml)
python scripts/check_figures.py
# the backends this machine must be able to run (a broken install must fail here, not pass as skipped tests)
kvtransport backends --require "${KVT_REQUIRED_BACKENDS:-ucx,nccl}" >/dev/null
if [ "${SKIP_VLLM:-0}" != 1 ]; then
  # tests/integration needs vLLM: it runs below, in the vLLM venv, instead of skipping here
  HYPOTHESIS_PROFILE=ci python -m pytest -q --durations=12 --ignore=tests/integration "$@"
else
  HYPOTHESIS_PROFILE=ci python -m pytest -q "$@"
fi
if [ "${SKIP_VLLM:-0}" != 1 ]; then
  export VLLM_VENV=${VLLM_VENV:-$PWD/.vllm-venv}
  bash integration/vllm/ci_setup.sh
  HYPOTHESIS_PROFILE=ci "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=12 tests/integration
fi
