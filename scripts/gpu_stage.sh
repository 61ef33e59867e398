#!/usr/bin/env bash
# Stages what the vLLM GPU run (scripts/gpu_vllm.sh) needs on a lent GPU host that has no network, into the
# ignored folder .stage/ of this checkout, then packs it into pieces small enough to carry one per call:
#   .stage/c1        MSCCL++ sources (+ nlohmann/json, dlpack for its offline configure), the UCX wheel, build tools
#   .stage/c2..c5    one stream, split in 4: vLLM 0.24.0 (its wheel less kernels an H200 never loads) + its deps
#   .stage/c6        NIXL's wheels (vLLM's NixlConnector, the serving benchmark's baseline)
# Wheels come from PyPI by name and version (scripts/gpu-wheels.txt); sources from GitHub at pinned commits, or
# from checkouts you already have: MSCCLPP_SRC=dir JSON_SRC=dir DLPACK_SRC=dir. Nothing staged is committed.
# Runs on any Linux machine with network; re-running reuses what is already there (delete .stage/ to redo).
set -euo pipefail
cd "$(dirname "$0")/.."
S=.stage
MSCCLPP_COMMIT=1f5f065d7b13ab02df32c22568f38785d1eeec01   # v0.10.0-15, the commit we tested
JSON_TAG=v3.11.3                                           # mscclpp pins 3.12.0; 3.11.3 works (docs/notes.md)
DLPACK_COMMIT=7f393bbb86a0ddd71fde3e700fc2affa5cdce72d
mkdir -p "$S/wheels" "$S/src"

# 1. wheels by section, for the host's Python (3.12, manylinux x86_64)
section() { awk -v s="[$1]" '/^\[/{on=($0==s); next} on && NF && !/^#/' scripts/gpu-wheels.txt; }
for sec in vllm gpu nixl router; do
  mkdir -p "$S/wheels/$sec"
  section "$sec" > "$S/wheels/$sec.txt"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $(for v in 35 34 33 32 31 30 29 28 27 26 25 24 17 5; do printf -- '--platform manylinux_2_%s_x86_64 ' $v; done) \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
    -d "$S/wheels/$sec" -r "$S/wheels/$sec.txt"
done

# 2. vLLM without what an H200 never loads: DeepGEMM and the SM100 attention kernels (Blackwell), FA2
#    (Hopper runs FA3), the Rust tool-parser sources: 279 MB -> a 142 MB .tar.xz of the installed tree
if [ ! -s "$S/vllm-slim.tar.xz" ]; then
  rm -rf "$S/vllm-site" && mkdir -p "$S/vllm-site"
  python3 -m zipfile -e "$S"/wheels/vllm/vllm-0.24.0-*.whl "$S/vllm-site"
  rm -rf "$S"/vllm-site/vllm/third_party/{deep_gemm,fmha_sm100} "$S"/vllm-site/vllm/vllm-rs \
    "$S"/vllm-site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
  tar -C "$S/vllm-site" -cf - . | xz -T0 -6 > "$S/vllm-slim.tar.xz.part" && mv "$S/vllm-slim.tar.xz.part" "$S/vllm-slim.tar.xz"
  rm -rf "$S/vllm-site"
fi

# 3. sources, as tarballs of a directory named after the project
src() {  # src NAME USER_DIR URL REF
  local name=$1 dir=$2 url=$3 ref=$4
  [ -s "$S/src/$name.tar.gz" ] && return 0
  if [ -z "$dir" ]; then
    dir=$S/src/$name.git
    rm -rf "$dir" && git clone -q "$url" "$dir" && git -C "$dir" checkout -q "$ref" \
      || { echo "gpu_stage: cannot fetch $url (no network? pass a checkout: ${name^^}_SRC=dir)" >&2; exit 1; }
  fi
  tar -C "$(dirname "$dir")" --exclude=.git --transform "s|^$(basename "$dir")|$name|" -czf "$S/src/$name.tar.gz.part" \
    "$(basename "$dir")" && [ -n "$(tar -tzf "$S/src/$name.tar.gz.part" | head -1)" ] \
    || { echo "gpu_stage: could not pack $name from $dir" >&2; rm -f "$S/src/$name.tar.gz.part"; exit 1; }
  mv "$S/src/$name.tar.gz.part" "$S/src/$name.tar.gz"  # only a complete archive counts as staged
}
src mscclpp "${MSCCLPP_SRC:-}" https://github.com/microsoft/mscclpp "$MSCCLPP_COMMIT"
src json "${JSON_SRC:-}" https://github.com/nlohmann/json "$JSON_TAG"
src dlpack "${DLPACK_SRC:-}" https://github.com/dmlc/dlpack "$DLPACK_COMMIT"

# 4. pieces (carry=[".stage/cN"] one per call; gpu_vllm.sh puts them back together on the host)
rm -rf "$S"/c[0-9]*
mkdir -p "$S/c1" "$S/c6" "$S/c7"
cp "$S"/src/*.tar.gz "$S"/wheels/gpu/*.whl "$S/c1/"
git rev-parse HEAD > "$S/c1/COMMIT" 2>/dev/null || echo unknown > "$S/c1/COMMIT"  # the code the run measures
cp "$S"/wheels/nixl/*.whl "$S/c6/"
cp "$S"/wheels/router/*.whl "$S/c7/"  # vllm-router for the e2e suite's router test (24 MB)
tmp=$(mktemp -d)
tar -C "$S" --exclude='vllm-0.24.0-*.whl' -cf "$tmp/stream.tar" wheels/vllm vllm-slim.tar.xz
split -n 4 -d -a 1 "$tmp/stream.tar" "$tmp/stream.tar."
for i in 0 1 2 3; do mkdir -p "$S/c$((i + 2))" && mv "$tmp/stream.tar.$i" "$S/c$((i + 2))/"; done
rm -rf "$tmp"
du -sh "$S"/c[0-9]* | sed 's|^|piece |'
