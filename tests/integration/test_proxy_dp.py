"""Issue 28, data parallelism behind one URL: vLLM's API server places a request without X-data-parallel-rank on
any of its DP engines, each with a side channel of its own. The proxy must send each request's prefill leg to the
engine whose side channel its decode was given. A fake prefill fronting several DP engines (a real loopback HTTP
server; a real listening socket per engine) places unpinned requests round robin, as a load balancer would; no
vLLM process (test_e2e_dp runs real ones)."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("httptools", reason="the proxy's HTTP dependencies are not installed")
proxy_mod = pytest.importorskip("kvtransport_vllm.proxy", reason="kvtransport-vllm is not installed")
from kvtransport_vllm import http11  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class DPPrefill:
    """One API server fronting ``size`` DP engines (``size`` 1: no DP fields in its discovery answer, as before
    this change). ``told``: the size its engines report (0: unknown, as a dense model's engines do; vLLM then
    refuses a header past the last engine with HTTP 400, as its API server does). ``honour``: whether it routes
    by the header (False: one that ignores it, whose balancer puts every request on engine 0)."""

    def __init__(self, size: int, honour: bool = True, told: int | None = None) -> None:
        self.size, self.honour = size, honour
        self.told = size if told is None else told
        self.sides = [socket.create_server(("127.0.0.1", 0)) for _ in range(size)]
        self.ports = [int(s.getsockname()[1]) for s in self.sides]
        self.balance = itertools.cycle(range(size))
        self.legs: dict[str, int] = {}  # xfer -> the engine its prefill leg ran on
        self.headers: list[str | None] = []
        self.server: Any = None

    def port(self, rank: int) -> int:
        return self.ports[rank]

    async def handle(self, request: Any, reply: Any) -> None:
        if request.path == "/v1/models":
            reply.send(200, json.dumps({"data": [{"id": "tiny"}]}).encode())
            return
        header = request.headers.get("x-data-parallel-rank")
        self.headers.append(header)
        if header is not None and not 0 <= int(header) < self.size:
            reply.send(400, json.dumps({"error": {"message": f"data_parallel_rank {header} is out of range "
                                                             f"[0, {self.size})."}}).encode())
            return
        if not self.honour:
            rank = 0
        else:
            rank = int(header) if header is not None else next(self.balance)
        params = json.loads(request.body).get("kv_transfer_params") or {}
        side = {"kvt_host": "127.0.0.1", "kvt_port": self.port(rank), "kvt_engine_id": f"engine_dp{rank}"}
        if self.size > 1:
            side |= {"kvt_dp_rank": rank, "kvt_dp_size": self.told}
        if params.get("kvt_discover"):
            reply.send(200, json.dumps({"kv_transfer_params": side}).encode())
            return
        self.legs[params["kvt_xfer"]] = rank
        reply.send(200, json.dumps({"id": "p", "choices": [{"index": 0, "text": " w7", "finish_reason": "length"}],
                                    "kv_transfer_params": None}).encode())

    def close(self) -> None:
        for s in self.sides:
            s.close()


class Decode:
    def __init__(self) -> None:
        self.told: dict[str, int] = {}  # xfer -> the side-channel port the decode was given

    async def handle(self, request: Any, reply: Any) -> None:
        params = json.loads(request.body).get("kv_transfer_params") or {}
        self.told[params["kvt_xfer"]] = params["remote_port"]
        reply.send(200, b'{"choices": [{"text": " w7 ok"}]}')


class Outcome:
    """What a run through the proxy saw: each request's status, ``/health``, ``/metrics``, the proxy's prefill
    entries' DP ranks, and the decode."""

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.codes: list[int] = []
        self.health: dict[str, Any] = {}
        self.metrics = ""
        self.ranks: list[int | None] = []


def run(prefill: DPPrefill, requests: int, first_token: str = "decode") -> Outcome:
    out = Outcome(Decode())

    async def main() -> None:
        p = await http11.Server(prefill.handle).start("127.0.0.1", 0)
        d = await http11.Server(out.decode.handle).start("127.0.0.1", 0)
        proxy = proxy_mod.Proxy([f"http://127.0.0.1:{p.port}"], [f"http://127.0.0.1:{d.port}"],
                                first_token=first_token, health_interval=None)
        server = await proxy.serve("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
                for _ in range(requests):
                    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
                    out.codes.append(r.status_code)
                out.health = (await client.get("/health")).json()
                out.metrics = (await client.get("/metrics")).text
            out.ranks = [i.dp_rank for i in proxy.prefill]
        finally:
            await server.aclose()
            await proxy.close()
            await p.aclose()
            await d.aclose()

    try:
        asyncio.run(main())
    finally:
        prefill.close()
    return out


@pytest.mark.parametrize("first_token, told", [("decode", 3), ("prefill", 3), ("decode", 0)])
def test_every_prefill_leg_runs_on_the_engine_its_decode_was_given(first_token: str, told: int) -> None:
    """``told`` 3: the engines know their count (a MoE model); 0: they do not (a dense one), and the proxy asks
    the API server for each rank until it refuses one."""
    prefill = DPPrefill(3, told=told)
    out = run(prefill, 9, first_token)
    decode, health, metrics = out.decode, out.health, out.metrics
    assert out.codes == [200] * 9
    assert len(decode.told) == 9 and decode.told.keys() == prefill.legs.keys()
    for xfer, rank in prefill.legs.items():
        assert decode.told[xfer] == prefill.port(rank), (xfer, rank)
    assert sorted(prefill.legs.values()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # every engine in the rotation, evenly
    url = health["prefill"][0].split("#")[0]
    assert sorted(health["prefill"]) == [f"{url}#dp{r}" for r in range(3)], health
    assert health["status"] == "ok"
    # the first discovery went unpinned (the balancer chose engine 0); every later request names its engine;
    # a count the engines do not know costs one question per engine and one the API server refuses
    questions = [] if told else ["1", "2", "3"]  # a known count: each engine is asked when its turn comes
    assert prefill.headers[:len(questions) + 1] == [None, *questions], prefill.headers
    assert all(h in ("0", "1", "2") for h in prefill.headers[len(questions) + 1:]), prefill.headers
    for r in range(3):
        assert f'dp_rank="{r}"' in metrics


def test_one_engine_behind_the_url_sends_no_header() -> None:
    prefill = DPPrefill(1)
    out = run(prefill, 3)
    decode, health = out.decode, out.health
    assert out.codes == [200] * 3
    assert prefill.headers == [None] * 4  # discovery + 3 legs
    assert all(decode.told[x] == prefill.port(0) for x in prefill.legs)
    assert health["prefill"] == [health["prefill"][0]] and "#" not in health["prefill"][0]


@pytest.mark.parametrize("answer", [
    {"kvt_dp_rank": 0, "kvt_dp_size": 10 ** 9}, {"kvt_dp_rank": 5, "kvt_dp_size": 2},
    {"kvt_dp_rank": "0", "kvt_dp_size": 2}, {"kvt_dp_rank": -1, "kvt_dp_size": 2},
    {"kvt_dp_rank": True, "kvt_dp_size": 2}, {"kvt_dp_rank": 0, "kvt_dp_size": 2.0},
])
def test_nonsense_dp_fields_pin_nothing(answer: dict[str, Any]) -> None:
    proxy = proxy_mod.Proxy(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], health_interval=None)
    inst = proxy.prefill[0]
    asyncio.run(proxy._pin(inst, answer, []))
    assert inst.dp_rank is None and len(proxy.prefill) == 1


@pytest.mark.parametrize("told", [2, 0])
def test_an_api_server_that_ignores_the_header_gets_no_pinned_legs(told: int) -> None:
    """An API server that ignores X-data-parallel-rank: the engine asked for is not the one that answers, so the
    proxy takes that entry out with a message naming the header. A known count: the entry of engine 1 is out,
    engine 0 serves (its answers come from engine 0 anyway); an unknown one: the question for engine 1 fails the
    whole discovery, nothing stays pinned, and the URL is out (503)."""
    prefill = DPPrefill(2, honour=False, told=told)
    out = run(prefill, 3)
    codes, health, ranks, decode = out.codes, out.health, out.ranks, out.decode
    (name, why), = health["down"].items()
    assert "x-data-parallel-rank" in why, health
    if told:
        assert codes == [200, 200, 200] and ranks == [0, 1] and name.endswith("#dp1"), (codes, ranks, health)
        assert all(decode.told[x] == prefill.port(0) for x in decode.told) and set(prefill.legs.values()) == {0}
    else:
        assert codes == [503, 503, 503] and ranks == [None] and "#" not in name, (codes, ranks, health)
