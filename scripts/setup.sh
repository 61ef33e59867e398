#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs kvtransport with its backends and test tools (editable).
# Quiet on success: each step's output goes to .venv/setup.log, and a failing step's output is printed in
# full (exit status 1). Near-instant when nothing changed: the hash of the install inputs (pyproject files,
# the ucx C helper and its setup.py, this script) is kept in .venv/.setup-stamp, and a matching stamp skips
# every install. FORCE_SETUP=1 reinstalls anyway; PYTHON=python3.12 picks the interpreter for a new .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/.setup-stamp
LOG=.venv/setup.log
inputs=(pyproject.toml backends/*/pyproject.toml backends/ucx/setup.py backends/ucx/kvtransport_ucx/_ucp_batch.c
        scripts/setup.sh)
want=$(cat "${inputs[@]}" | sha256sum | cut -d' ' -f1)
if [ "${FORCE_SETUP:-0}" != 1 ] && [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

started=$(date +%s)
step() {  # step DESCRIPTION CMD...: run quietly; on failure print everything the command said, then stop
  local what=$1 out
  shift
  out=$(mktemp)
  if ! "$@" >"$out" 2>&1; then
    cat "$out" >>"$LOG" 2>/dev/null || true
    echo "set-up failed while ${what}: $*" >&2
    cat "$out" >&2
    rm -f "$out"
    exit 1
  fi
  cat "$out" >>"$LOG"
  rm -f "$out"
}

if [ ! -x .venv/bin/python ]; then
  echo "set-up: creating .venv and installing kvtransport with its backends (first run: a few minutes)"
  out=$(mktemp)
  if ! "$PY" -m venv .venv >"$out" 2>&1; then
    echo "set-up failed while creating .venv with $PY (Python >= 3.11 with the venv module is needed):" >&2
    cat "$out" >&2
    rm -f "$out"
    exit 1
  fi
  rm -f "$out"
else
  echo "set-up: install inputs changed since the last set-up; reinstalling into .venv"
fi
rm -f "$STAMP"
: >"$LOG"
. .venv/bin/activate
step "upgrading pip" python -m pip install -q --upgrade pip
# torch: keep the one present (e.g. a CUDA build on a GPU host); else the CPU build
if ! python -c "import torch" >/dev/null 2>&1; then
  step "installing torch" pip install -q "torch==2.13.0"
fi
step "installing kvtransport and its backends" \
  pip install -q -e ".[dev,bench]" -e backends/nccl -e backends/ucx -e backends/mscclpp
step "checking the installed tools" bash -c "command -v ruff && command -v mypy"
# Mooncake's transfer engine, a peer in `kvtransport bench` (host memory over TCP): its non-CUDA wheel on x86-64
# Linux where no Mooncake is installed (a GPU host may have the CUDA one); it links libibverbs.so.1 (Debian:
# libibverbs1), installed with apt when missing and we may. Optional: where it cannot be installed, one line
# says so and the bench reports it as not installed (CI's bench smoke test demands it).
if [ "$(uname -m)" = x86_64 ] && ! python -c "import mooncake.engine" >/dev/null 2>&1; then
  if ! ldconfig -p | grep -q "libibverbs.so.1 " && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >>"$LOG" 2>&1 \
      || { apt-get update -q >>"$LOG" 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >>"$LOG" 2>&1; } \
      || echo "set-up: could not install libibverbs1 with apt (Mooncake's transfer engine needs it); see $LOG"
  fi
  pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" >>"$LOG" 2>&1 \
    || echo "set-up: Mooncake's transfer engine did not install (the bench runs without that peer); see $LOG"
fi
listing=$(python - <<'EOF'
import kvtransport, kvtransport_nccl, kvtransport_ucx, kvtransport_mscclpp  # noqa: F401 - all four import
rows = kvtransport.available_backends()
usable = ", ".join(r.name for r in rows if r.available) or "none"
other = ", ".join(r.name for r in rows if not r.available)
print(f"backends usable here: {usable}" + (f"; not usable: {other} (`kvtransport backends` says why)" if other else ""))
EOF
) || { echo "set-up failed: kvtransport does not import after installing; see $LOG" >&2; exit 1; }
echo "$want" >"$STAMP"
echo "set-up done in $(( $(date +%s) - started )) s; $listing"
