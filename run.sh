#!/usr/bin/env bash
# Sets everything up, then runs the main job: a vLLM-shaped KV request (Llama-3.1-8B, 2k tokens, random
# block ids) moved between two local processes through the default backend, verified byte for byte,
# with GB/s printed next to a memcpy of the same bytes measured in the same run. Extra args go to the demo.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup.sh
exec .venv/bin/kvtransport demo "$@"
