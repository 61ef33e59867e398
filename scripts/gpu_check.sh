#!/usr/bin/env bash
# Runs the GPU checks on a lent GPU host (no network there): installs kvtransport from this checkout and
# the carried UCX wheel (.whl/), then doctor, the CUDA conformance suites (PYTEST_K selects) and the demo
# on CUDA memory for each backend in BACKENDS: a 2k-token Llama-8B request with random block ids, the same
# request with contiguous ids, and one 256 MiB contiguous put; each next to a raw GPU copy of the same
# bytes measured in the same run (GPU0 -> GPU1 when there are two). Results go to $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# carried wheels: .whl/ (e.g. libucx-cu13) and .mscclpp/ (an MSCCL++ wheel the user built, plus blake3)
wheels=$(ls .whl/*.whl .mscclpp/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# an MSCCL++ linked with a static libstdc++ crashes once torch is loaded: preload the shared one (see
# backends/mscclpp/README.md); kvtransport refuses such a build without this
lib=$(ls /tmp/site/mscclpp/lib/libmscclpp.so.0 2>/dev/null)
if [ -n "$lib" ] && ! grep -q "libstdc++.so.6" "$lib"; then
  export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)
  echo "MSCCL++ links libstdc++ statically: LD_PRELOAD=$LD_PRELOAD"
fi
python3 -m pip install -q --no-index --no-build-isolation --no-deps -e . -e backends/nccl -e backends/ucx -e backends/mscclpp 2>&1 | tail -2
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } > "$OUT/machine.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())" | tee -a "$OUT/machine.txt"
python3 -m kvtransport.cli doctor > "$OUT/doctor.txt" 2>&1
if [ -n "${GATE:-}" ]; then  # fail fast (device time is scarce): one demo of backend $GATE must pass first
  timeout 90 python3 -m kvtransport.cli demo --device cuda --backend "$GATE" --pattern random > "$OUT/gate.txt" 2>&1 \
    || { echo "gate demo with $GATE failed:"; tail -40 "$OUT/gate.txt"; exit 1; }
  grep -E "^transfer|^baseline|^verified" "$OUT/gate.txt"
fi
if [ "${PYTEST_K:-}" != "skip" ]; then
  timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -v -p no:cacheprovider -m "gpu or gpu2" --durations=10 tests/backends ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | tee "$OUT/pytest-gpu.txt" | grep -E "passed|failed|FAILED|Error" | tail -15
fi
# PROBE="mscclpp ucx": benchmarks/gpu_put_path.py per backend; PROBE_RUNS: api:doorbell pairs
for b in ${PROBE:-}; do
  for run in ${PROBE_RUNS:-layers:1 layers:0}; do
    api=${run%%:*} bell=${run##*:}
    timeout 120 python3 benchmarks/gpu_put_path.py --backend "$b" --api "$api" --doorbell "$bell" ${PROBE_ARGS:-} \
      --out "$OUT/probe-$b-$api-$bell.json" 2>&1 | tee -a "$OUT/probe.txt" | grep -v "^    \|^INFO"
  done
done
[ -n "${PROBE:-}" ] && (cd "$OUT" && tar czf probe.tgz probe-*.json probe.txt && rm -f probe-*.json)
for b in ${BACKENDS:-mscclpp ucx nccl}; do
  [ "$b" = none ] && continue
  demo() { timeout 150 python3 -m kvtransport.cli demo --device cuda --backend "$b" "$@" 2>&1; }
  { demo --pattern random; demo --pattern contiguous; demo --model one-layer --tokens 65536 --pattern contiguous; } \
    > "$OUT/demo-$b.txt"
  grep -E "^kvtransport .* demo|^backend:|^transfer|^baseline|^verified|Error" "$OUT/demo-$b.txt"
done
# BENCH=1: `kvtransport bench` in parts, each in its own folder under a timeout (a part cut short loses only
# itself); BENCH_PARTS picks parts (kv overlap sweep presets), BENCH_ARGS adds options to each
if [ -n "${BENCH:-}" ]; then
  part() {
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m kvtransport.cli bench --device cuda --out "$OUT/bench-$name" "$@" ${BENCH_ARGS:-} > "$OUT/bench-$name.log" 2>&1
    echo "bench $name: rc=$? ($limit s limit)"; grep -A12 "^\*\*Summary" "$OUT/bench-$name/table.md" 2>/dev/null | head -14
    # one file per part (the device tool returns at most 8 files), packed as soon as the part ends
    (cd "$OUT" && tar czf "bench-$name.tgz" "bench-$name" "bench-$name.log" 2>/dev/null && rm -rf "bench-$name" "bench-$name.log")
  }
  for p in ${BENCH_PARTS:-kv overlap sweep presets}; do
    case $p in
      kv) part kv 200 --workloads kv,latency --presets llama-3.1-8b --tokens 2048 --patterns contiguous,random ;;
      overlap) part overlap 110 --workloads overlap --presets llama-3.1-8b --tokens 2048,32768 ;;
      sweep) part sweep 90 --workloads sweep ;;
      presets) part presets 80 --workloads kv --presets llama-3.1-70b-tp8,qwen3-8b,deepseek-v3-mla --tokens 128,2048 --patterns random --reps-scale 0.5 ;;
    esac
  done
fi
