"""End-to-end P/D with an MLA model: a tiny random DeepSeek-V2-shaped model (multi-head latent attention), whose
KV cache is one 576-wide latent per token in a 3-D ``[num_blocks, block_size, 576]`` tensor per layer (no K/V
split, no heads). Outputs token-identical to a single instance, no prompt token computed by the decode, every
byte sent landed, and exactly a whole number of latent blocks moved.

Instances: P1 (kv_producer, also the single-instance reference: plain requests bypass the connector) and D
(kv_consumer), TP1. On the CPU (vLLM's CPU_MLA backend: block size 16, float32) over ucx; on a GPU (``-m gpu``,
bfloat16, block size 64) over mscclpp and ucx, both instances on GPU 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from .test_e2e_hetero import check_pair
from .test_e2e_pd import Proc, base_env, free_port, matrix_params, running, vllm_cmd

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

LATENT = 512 + 64
"""Width of one token's MLA cache entry: kv_lora_rank 512 + qk_rope_head_dim 64 (tiny_model.make_tiny_mla)."""
LAYERS = 2


def block_of(device: str) -> int:
    """vLLM's CPU_MLA kernel is built for block size 16; the GPU MLA backends take 64 (FlashMLA's size)."""
    return 16 if device == "cpu" else 64


def instance(name: str, model: str, role: str, backend: str, device: str, log_dir: Path) -> Proc:
    port = free_port()
    kv = {"kv_connector": "KVTransportConnector", "kv_role": role}
    extra = ["--max-num-batched-tokens", "1024"]  # MLA on the CPU turns chunked prefill off: a whole prompt per step
    cmd = vllm_cmd(model, port, kv, extra, device)
    cmd[cmd.index("--block-size") + 1] = str(block_of(device))
    if device == "cuda":  # the GPU MLA kernels take 16-bit activations
        cmd[cmd.index("--dtype") + 1] = "bfloat16"
    else:  # the reference kernel in float32 on every CPU (vLLM prefers AMX_MLA where the CPU has AMX: bf16 only)
        cmd += ["--attention-backend", "CPU_MLA"]
    return Proc(name, cmd, base_env(backend, device), port, log_dir)


@pytest.fixture(scope="module", params=matrix_params([("ucx", "cpu"), ("mscclpp", "cuda"), ("ucx", "cuda")]))
def mla(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from .tiny_model import make_tiny_mla

    backend, device = request.param
    model = str(make_tiny_mla(tmp_path_factory.mktemp("tiny-mla")))
    log_dir = Path(os.environ.get("KVT_E2E_LOG_DIR") or tmp_path_factory.mktemp("e2e-mla-logs")) / f"{backend}-{device}"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {"P1": instance("mla-prefill", model, "kv_producer", backend, device, log_dir),
             "D": instance("mla-decode", model, "kv_consumer", backend, device, log_dir)}
    with running(procs, f"e2e-mla {backend}-{device}", log_dir):
        yield {"procs": procs, "env": base_env(backend, device), "log_dir": log_dir, "device": device}


def test_mla_model_pd_token_identical(mla: dict[str, Any]) -> None:
    for p in mla["procs"].values():  # the latent cache reached the worker as one plane per layer, no heads
        log = p.log.read_text(errors="replace")
        assert f"{LAYERS} layers x " in log and "1 plane(s)/layer" in log, p.name
    # one request at a time: MLA's kernels are not batch-invariant (on vLLM's CPU_MLA the single instance's own
    # greedy output for the 150-token prompt changes at token 8 when six requests share its batch)
    lengths = (3, 15, 16, 17, 70, 150)
    s = check_pair(mla, "P1", "D", seed=31, lengths=lengths, unlike=False, concurrent=False)
    # a prompt of n words is n + 1 tokens (BOS); the decode computes the last one: n tokens' latents, in whole
    # blocks of the block size
    block, item = block_of(mla["device"]), 4 if mla["device"] == "cpu" else 2
    assert s["external"] == sum(lengths), s
    assert s["bytes_received"] == sum(-(-n // block) for n in lengths) * LAYERS * block * LATENT * item, s
