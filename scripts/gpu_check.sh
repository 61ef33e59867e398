#!/usr/bin/env bash
# Runs the GPU checks on a lent GPU host (no network there): installs kvtransport from this checkout
# and the carried UCX wheel (.whl/), then doctor, the CUDA conformance suites and the demo on CUDA memory.
# Results go to $OUT (default ./gpu-out). Usage: bash scripts/gpu_check.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . -e backends/nccl -e backends/ucx 2>&1 | tail -2
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
python3 -m kvtransport.cli doctor 2>&1 | tee "$OUT/doctor.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or gpu2" tests/backends ${1:+-k "$1"} 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -25
for b in ${BACKENDS:-ucx nccl}; do
  for pat in random contiguous; do
    timeout 200 python3 -m kvtransport.cli demo --device cuda --backend "$b" --pattern $pat 2>&1 | tee "$OUT/demo-$b-cuda-$pat.txt" | tail -5
  done
done
