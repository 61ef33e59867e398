#!/usr/bin/env bash
# The vLLM-on-GPU run of issue 12, on a lent GPU host with no network (one GPU is enough: every instance and
# both ends of every link share cuda:0). Stage the pieces first with scripts/gpu_stage.sh, then, from the
# repository root on the host, one call per piece and then calls that wait and collect:
#
#   bash scripts/gpu_vllm.sh tick [WAIT_S]      (carry=[".stage/c1"], then c2 ... c7, then no carry)
#
# Each tick moves a carried piece to /tmp/kvt-gpu, starts the background run once (setsid: it outlives the
# call while the host stays warm), waits up to WAIT_S seconds (returning early when the run ends), prints the
# run's status and copies its results to $OUT. The run, as soon as its inputs have arrived:
#   A  (c1)     installs kvtransport and its backends, builds MSCCL++ from the carried source (IB off, g++),
#               then the GPU conformance suites of mscclpp and ucx and the mscclpp/ucx demos on cuda:0;
#   B  (c2-c5)  installs vLLM 0.24.0 and its dependencies, imports the connector on it;
#   C  (A, B)   the GPU end-to-end suites (tests/integration, -m gpu: P/D and faults, mscclpp and ucx) while
#               the serving benchmark's instances start; the benchmark measures once the e2e suites are done
#               (benchmarks/serving.py; with nixl among SERVING_CONFIGS it waits for c6, which brings NIXL for
#               its NixlConnector baseline), then benchmarks/proxy_overhead.py measures the proxy's own cost on
#               this host; the backends' GPU conformance suites and demos run last (CONFORMANCE=0 skips them),
#               so that nothing else shares the GPU while the benchmark measures. SERVING_FIRST=1: the benchmark
#               measures as soon as its instances are up, and the e2e suites run after it (a short lease).
# The commit measured is read from .stage/c1/COMMIT (written by gpu_stage.sh) into machine.txt.
# `bash scripts/gpu_vllm.sh job NAME` re-runs one step in the background (conformance, e2e, serving).
# Knobs for a short lease: SERVING=0 (no benchmark), CONFORMANCE=0 (or =early: the conformance suites run beside
# the e2e suites while the benchmark's instances start, and the benchmark measures after both), MSCCLPP_BUILD=0 (ucx only), and
# E2E_RUNS="pd ucx-cuda|faults cuda" (suite and -k filter per run, '|' between runs). SERVING_ROUNDS=3: the
# benchmark's configurations measured three times, interleaved; PUT_PATH=1: benchmarks/gpu_put_path.py per
# backend (PUT_PATH_BACKENDS) once the e2e suites are done, before the conformance suites.
set -uo pipefail
W=/tmp/kvt-gpu
R=$W/out
REPO=$(pwd)
mkdir -p "$W/pieces" "$R"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
PY=python3
PIP="$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check"

status() { echo "$(date -u +%T) $*" | tee -a "$R/status.txt"; }
mscclpp_env() {  # an MSCCL++ built without libstdc++ in DT_NEEDED crashes beside torch: preload the shared one
  local lib=/tmp/site/mscclpp/lib/libmscclpp.so
  if [ -e "$lib" ] && ! readelf -d "$lib" | grep -q 'NEEDED.*libstdc++'; then
    export LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)
  fi
}
wait_for() { while [ ! -e "$1" ]; do sleep 2; done; }

stage_a() {  # install, build MSCCL++, conformance + demos
  wait_for "$W/pieces/c1.done"
  status "A: installing kvtransport + backends, UCX wheel"
  $PIP --target /tmp/site "$W"/pieces/c1/*.whl >"$R/install-a.log" 2>&1
  $PY -m pip install -q --no-index --no-build-isolation --no-deps -e . -e backends/nccl -e backends/ucx \
    -e backends/mscclpp >>"$R/install-a.log" 2>&1 || { status "A: FAILED installing kvtransport"; return 1; }
  { date -u; echo "commit $(cat "$W/pieces/c1/COMMIT" 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -1
    g++ --version | head -1; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  } >"$R/machine.txt" 2>&1
  if [ "${MSCCLPP_BUILD:-1}" = 0 ]; then status "A: MSCCL++ not built (MSCCLPP_BUILD=0)"; touch "$W/a.done"; return 0; fi
  status "A: building MSCCL++ (IB off, the system gcc for C, C++ and as nvcc's host compiler)"
  rm -rf "$W/src" && mkdir -p "$W/src"
  for t in mscclpp json dlpack; do tar -C "$W/src" -xzf "$W/pieces/c1/$t.tar.gz"; done
  local t0=$SECONDS
  # The host image exports CC/CXX=/opt/gcc/bin/gcc/g++: with only CXX overridden, nvcc still took /opt/gcc's
  # g++ as its host compiler, CMake added its library dirs to every link, and libmscclpp.so came out with
  # libstdc++ linked statically (2026-12-02). Every compiler is the system one here.
  ( cd "$W/src/mscclpp" && SETUPTOOLS_SCM_PRETEND_VERSION=0.10.0 CC=/usr/bin/gcc CXX=/usr/bin/g++ \
    CUDAHOSTCXX=/usr/bin/g++ CMAKE_BUILD_PARALLEL_LEVEL=16 \
    CMAKE_ARGS="-DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++ -DMSCCLPP_BYPASS_GPU_CHECK=ON -DMSCCLPP_USE_CUDA=ON -DMSCCLPP_GPU_ARCHS=90 -DMSCCLPP_BUILD_EXT_NCCL=OFF \
-DMSCCLPP_USE_IB=OFF -DFETCHCONTENT_SOURCE_DIR_JSON=$W/src/json -DFETCHCONTENT_SOURCE_DIR_DLPACK=$W/src/dlpack \
-DFETCHCONTENT_TRY_FIND_PACKAGE_MODE=ALWAYS -Dnanobind_DIR=$($PY -m nanobind --cmake_dir)" \
    $PY -m pip install --no-index --no-build-isolation --no-deps --no-cache-dir --target /tmp/site -v . ) \
    >"$R/mscclpp-build.log" 2>&1 || { status "A: FAILED building MSCCL++ (mscclpp-build.log)"; tail -30 "$R/mscclpp-build.log"; }
  status "A: MSCCL++ build took $((SECONDS - t0)) s"
  { ls -la /tmp/site/mscclpp/lib/ 2>&1; for so in /tmp/site/mscclpp/lib/libmscclpp.so*; do echo "== $so"; readelf -d "$so" | grep -E "NEEDED|RUNPATH|RPATH"; done
    echo "== compilers"; command -v g++ c++; ls -la /usr/bin/g++ "$(command -v g++)"; /usr/bin/g++ --version | head -1
    /usr/bin/g++ -print-file-name=libstdc++.so; /usr/bin/g++ -print-file-name=libstdc++.a; env | grep -E "FLAGS|^CXX|^CC" || true
    echo "== link rule of libmscclpp.so"; grep -rh -A6 "build lib/libmscclpp.so.0" "$W"/src/mscclpp/build/*/build.ninja 2>/dev/null | head -20
  } >"$R/mscclpp-elf.txt" 2>&1
  $PY -m kvtransport.cli doctor >"$R/doctor.txt" 2>&1
  touch "$W/a.done"
}

job_conformance() {
  mscclpp_env
  status "A: GPU conformance suites (mscclpp, ucx) and demos on cuda:0${LD_PRELOAD:+ (LD_PRELOAD=$LD_PRELOAD)}"
  timeout 600 $PY -m pytest -v -p no:cacheprovider -m "gpu" --durations=10 tests/backends -k "mscclpp or ucx" \
    >"$R/pytest-gpu-backends.txt" 2>&1
  status "A: conformance: $(tail -1 "$R/pytest-gpu-backends.txt")"
  for b in mscclpp ucx; do
    for args in "--pattern random" "--pattern contiguous"; do
      timeout 150 $PY -m kvtransport.cli demo --device cuda --backend "$b" $args 2>&1
    done >"$R/demo-$b.txt"
    status "A: demo $b: $(grep -cE '^verified' "$R/demo-$b.txt") verified runs of 2"
  done
  touch "$W/conf.done"
}

stage_b() {  # vLLM 0.24.0 + deps
  for i in 2 3 4 5; do wait_for "$W/pieces/c$i.done"; done
  status "B: installing vLLM 0.24.0 and its dependencies"
  rm -rf "$W/stream" && mkdir -p "$W/stream"
  cat "$W"/pieces/c2/stream.tar.0 "$W"/pieces/c3/stream.tar.1 "$W"/pieces/c4/stream.tar.2 "$W"/pieces/c5/stream.tar.3 \
    | tar -C "$W/stream" -xf - || { status "B: FAILED unpacking"; return 1; }
  $PIP --target /tmp/site "$W"/stream/wheels/vllm/*.whl >"$R/install-b.log" 2>&1
  xz -dc "$W/stream/vllm-slim.tar.xz" | tar -C /tmp/site -xf -
  $PY -m pip install -q --no-index --no-build-isolation --no-deps -e integration/vllm >>"$R/install-b.log" 2>&1
  $PY -c "import vllm, kvtransport_vllm.compat as c, kvtransport_vllm.connector; print('vllm', vllm.__version__, \
'connector imports; compat', c.VLLM_VERSION, 'failed_recving:', c.REPORTS_FAILED_RECVING)" >"$R/vllm-import.txt" 2>&1
  status "B: $(tail -1 "$R/vllm-import.txt")"
  $PY -c "import sys; sys.path.insert(0, 'tests/integration'); from tiny_model import make_tiny_llama; \
make_tiny_llama('$W/tiny')" >"$R/models.log" 2>&1
  $PY benchmarks/serving.py make-model "$W/llama8b" >>"$R/models.log" 2>&1
  touch "$W/b.done"
}

job_e2e() {
  rm -f "$W/e2e.done"
  status "C: GPU e2e suites (P/D and faults; mscclpp and ucx on cuda:0)"
  mscclpp_env
  if [ -e "$W/pieces/c7.done" ]; then  # vllm-router: a target of its own (pip --target leaves an existing
    # /tmp/site/bin as it is, so the binary never landed there: 2026-12-03, fifth run)
    $PIP --target /tmp/router "$W"/pieces/c7/*.whl >"$R/install-router.log" 2>&1
    export PATH=/tmp/router/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/router  # its entry script imports vllm_router
    command -v vllm-router >>"$R/install-router.log" 2>&1 || status "C: vllm-router did not install (install-router.log)"
  fi
  local pids=() run
  local IFS_OLD=$IFS; IFS='|'; local runs=(${E2E_RUNS:-pd ucx-cuda|pd mscclpp-cuda|faults cuda}); IFS=$IFS_OLD
  for run in "${runs[@]}"; do  # the P/D suite per backend side by side
    set -- $run
    KVT_TINY_MODEL=$W/tiny KVT_E2E_LOG_DIR=$R/e2e-$1-${2%-cuda}-logs timeout 900 $PY -m pytest -v -p no:cacheprovider \
      -m gpu -k "$2" -rA --durations=15 "tests/integration/test_e2e_$1.py" >"$R/e2e-$1-${2%-cuda}.txt" 2>&1 &
    pids+=($!)
  done
  wait "${pids[@]}"
  for f in "$R"/e2e-*.txt; do status "C: $(basename "$f" .txt): $(tail -1 "$f")"; done
  touch "$W/e2e.done"
}

job_serving() {
  mscclpp_env
  case " ${SERVING_CONFIGS:-nixl} " in *" nixl "*)
    wait_for "$W/pieces/c6.done"
    $PIP --target /tmp/site "$W"/pieces/c6/*.whl >"$R/install-c.log" 2>&1 ;;
  esac
  status "C: serving benchmark: instances start (measures after the e2e suites)"
  rm -rf "$R/serving"
  ( wait_for "$W/e2e.done"; if [ "${CONFORMANCE:-1}" = early ]; then wait_for "$W/conf.done"; fi; touch "$W/quiet" ) &
  timeout 1500 $PY benchmarks/serving.py run --model "$W/llama8b" --out "$R/serving" --wait-for "$W/quiet" \
    ${SERVING_CONFIGS:+--configs $SERVING_CONFIGS} --rounds "${SERVING_ROUNDS:-1}" >"$R/serving.txt" 2>&1
  $PY benchmarks/serving.py report "$R/serving/serving.json" --out "$R/serving" >>"$R/serving.txt" 2>&1
  status "C: serving benchmark done"
  timeout 120 $PY benchmarks/proxy_overhead.py --requests 300 >"$R/proxy-overhead.json" 2>"$R/proxy-overhead.log"
  status "C: proxy overhead: $(grep proxy_cost "$R/proxy-overhead.json")"
}

job_put_path() {  # benchmarks/gpu_put_path.py per backend, both processes on cuda:0 (issue 30's figures)
  status "C: gpu_put_path (mscclpp, ucx; put_layer, put_layers, signal -> wait with the doorbell on and off)"
  mscclpp_env
  local b
  for b in ${PUT_PATH_BACKENDS:-mscclpp ucx}; do
    { timeout 150 $PY benchmarks/gpu_put_path.py --backend "$b" --api layer --doorbell 1 --out "$R/put-path-$b-layer-1.json"
      timeout 90 $PY benchmarks/gpu_put_path.py --backend "$b" --api layers --doorbell 1 --cases llama8b-2k-random \
        --out "$R/put-path-$b-layers-1.json"
      timeout 60 $PY benchmarks/gpu_put_path.py --backend "$b" --doorbell 0 --cases signal --out "$R/put-path-$b-signal-0.json"
    } >>"$R/put-path.txt" 2>&1
  done
  status "C: gpu_put_path: $(grep -c "signal -> wait\|receiver wait" "$R/put-path.txt") results (put-path.txt)"
}

master() {
  stage_a &
  local a=$!
  stage_b
  wait_for "$W/a.done"
  if [ "${SERVING:-1}" = 0 ]; then  # the suites only (E2E_RUNS picks them)
    job_e2e
  elif [ "${SERVING_FIRST:-0}" = 1 ]; then  # the figures first (a short lease), then the suites
    touch "$W/e2e.done"  # the benchmark measures as soon as its instances are up
    job_serving
    job_e2e
  else
    job_serving &
    local s=$! c=""
    if [ "${CONFORMANCE:-1}" = early ]; then job_conformance & c=$!; fi  # beside the e2e suites, while the
    job_e2e                                                                # benchmark's instances start
    wait "$s"
    if [ -n "$c" ]; then wait "$c"; fi
  fi
  wait "$a"
  if [ "${PUT_PATH:-0}" = 1 ]; then job_put_path; fi
  # last, unless CONFORMANCE=0 or it ran early (=early starts it beside the e2e suites only where the benchmark
  # measures after them; with SERVING=0 or SERVING_FIRST=1 it runs here)
  if [ "${CONFORMANCE:-1}" != 0 ] && [ ! -e "$W/conf.done" ]; then job_conformance; fi
  status "ALL DONE"
  touch "$R/DONE"
}

collect() {  # results -> $OUT as one archive (only 8 files of <= 16 MiB come back from a call) + the status
  [ -n "${OUT:-}" ] || return 0
  cp "$R/status.txt" "$OUT/" 2>/dev/null
  tar -C "$R" -czf "$OUT/results.tgz" . 2>/dev/null
  if [ "$(stat -c %s "$OUT/results.tgz" 2>/dev/null || echo 0)" -gt 15000000 ]; then  # too big: logs cut to their ends
    rm -rf "$W/trim" && mkdir -p "$W/trim" && cp -r "$R"/. "$W/trim"/
    find "$W/trim" -name '*.log' -size +200k -exec sh -c 'tail -c 200000 "$1" > "$1.t" && mv "$1.t" "$1"' _ {} \;
    tar -C "$W/trim" -czf "$OUT/results.tgz" .
  fi
  true
}

case "${1:-tick}" in
  tick)
    for d in .stage/c[0-9]*; do
      [ -d "$d" ] || continue
      n=$(basename "$d")
      rm -rf "$W/pieces/$n" && mv "$d" "$W/pieces/$n" && touch "$W/pieces/$n.done" && status "piece $n arrived ($(du -sh "$W/pieces/$n" | cut -f1))"
    done
    if [ ! -e "$W/master.started" ]; then
      touch "$W/master.started"
      setsid nohup bash "$REPO/scripts/gpu_vllm.sh" master >"$R/master.log" 2>&1 </dev/null &
    fi
    end=$((SECONDS + ${2:-0}))
    while [ $SECONDS -lt $end ] && [ ! -e "$R/DONE" ] && [ ! -e "$W/stop-waiting" ]; do sleep 5; done
    rm -f "$W/stop-waiting"
    cat "$R/status.txt" 2>/dev/null | tail -30
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
    collect
    ;;
  master) master ;;
  job)
    case "$2" in
      conformance|e2e|serving|put_path) setsid nohup bash -c "source '$REPO/scripts/gpu_vllm.sh' __lib; job_$2" \
        >"$R/job-$2.log" 2>&1 </dev/null & status "job $2 restarted" ;;
      *) echo "jobs: conformance e2e serving put_path" ;;
    esac
    ;;
  __lib) ;;  # sourced for its functions
esac
