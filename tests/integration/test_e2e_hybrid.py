"""End-to-end P/D with a hybrid model: a tiny random Llama whose layers alternate sliding-window (48 tokens)
and full attention, so vLLM's hybrid allocator (kept on: the connector is ``SupportsHMA``) makes two KV cache
groups, the sliding-window one pointing its out-of-window blocks at the null block. Prompts longer than the
window; outputs token-identical to a single instance, no prompt token computed by the decode.

Instances: P (kv_producer, also the single-instance reference) and D (kv_consumer), TP1, block 32.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from .test_e2e_hetero import check_pair, instance
from .test_e2e_pd import base_env, running

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
WINDOW = 48


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory):
    from .tiny_model import make_tiny_llama

    model = str(make_tiny_llama(tmp_path_factory.mktemp("tiny-sliding"), sliding_window=WINDOW))
    log_dir = Path(os.environ.get("KVT_E2E_LOG_DIR") or tmp_path_factory.mktemp("e2e-hybrid-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {"P1": instance("hyb-prefill", model, "kv_producer", 1, 32, log_dir),
             "D": instance("hyb-decode", model, "kv_consumer", 1, 32, log_dir)}
    with running(procs, "e2e-hybrid", log_dir):
        yield {"procs": procs, "env": base_env("ucx"), "log_dir": log_dir}


def test_sliding_window_model_two_kv_groups(hybrid: dict[str, Any]) -> None:
    for p in hybrid["procs"].values():  # the hybrid allocator stayed on: two groups reached the workers
        assert "1 plane(s)/layer, 2 KV cache group(s)" in p.log.read_text(errors="replace"), p.name
    check_pair(hybrid, "P1", "D", seed=21, lengths=(3, 31, 70, 150, 300), unlike=False)
