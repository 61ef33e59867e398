"""The proxy finds a prefill again after its side channel moved, and drops a dead one for a bounded backoff.
Fake prefill/decode servers (an httpx transport) and real listening sockets as side channels; no vLLM process."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the proxy's web dependencies are not installed")
proxy_mod = pytest.importorskip("kvtransport_vllm.proxy", reason="kvtransport-vllm is not installed")

pytestmark = pytest.mark.timeout(60)


class FakeCluster:
    """Prefill instances (``http://pN``) whose side channel is a real listening socket, and one decode
    (``http://d``) recording the side-channel port each decode request was told. ``dead`` instances refuse."""

    def __init__(self, names: list[str]) -> None:
        self.listeners = {n: socket.create_server(("127.0.0.1", 0)) for n in names}
        self.dead: set[str] = set()
        self.discoveries: dict[str, int] = dict.fromkeys(names, 0)
        self.prefills: dict[str, int] = dict.fromkeys(names, 0)
        self.told_ports: list[int] = []

    def port(self, name: str) -> int:
        return int(self.listeners[name].getsockname()[1])

    def restart_on_new_port(self, name: str) -> None:
        self.listeners[name].close()
        self.listeners[name] = socket.create_server(("127.0.0.1", 0))

    def close(self) -> None:
        for s in self.listeners.values():
            s.close()

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        params = body.get("kv_transfer_params") or {}
        if host == "d":
            self.told_ports.append(params["remote_port"])
            return httpx.Response(200, headers={"content-type": "application/json"},  # streamed, as vLLM does
                                  stream=httpx.ByteStream(b'{"choices": [{"text": "ok"}]}'))
        side = {"host": "127.0.0.1", "port": self.port(host), "engine": f"engine-{host}-{self.port(host)}"}
        if params.get("kvt_discover"):
            self.discoveries[host] += 1
            return httpx.Response(200, json={"kv_transfer_params": {
                "kvt_host": side["host"], "kvt_port": side["port"], "kvt_engine_id": side["engine"]}})
        self.prefills[host] += 1
        return httpx.Response(200, json={"kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": side["host"], "remote_port": side["port"],
            "remote_engine_id": side["engine"]}})


async def complete(client: Any) -> int:
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    return int(r.status_code)


def run(names: list[str], scenario: Any) -> None:
    cluster = FakeCluster(names)
    proxy = proxy_mod.Proxy([f"http://{n}" for n in names], ["http://d"], transport=httpx.MockTransport(cluster.handler))

    async def main() -> None:
        app = proxy_mod.build_app(proxy)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            await scenario(cluster, proxy, client)
        await proxy.close()

    try:
        asyncio.run(main())
    finally:
        cluster.close()


def test_a_prefill_restarted_on_a_new_port_is_found_again() -> None:
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        (p,) = proxy.prefill
        old = cluster.port("p1")
        assert await complete(client) == 200 and cluster.told_ports == [old]
        cluster.restart_on_new_port("p1")
        new = cluster.port("p1")
        # a cached address older than REVALIDATE_AFTER_S is checked before use: the old port refuses
        p.side_checked -= proxy_mod.REVALIDATE_AFTER_S + 1
        assert await complete(client) == 200 and cluster.told_ports[-1] == new
        assert cluster.discoveries["p1"] == 2
        # a fresh (unchecked) cache that went stale is corrected by the prefill's own answer: the request that
        # was told the old port fails on the decode side, the next one is told the new port, without discovery
        cluster.restart_on_new_port("p1")
        newer = cluster.port("p1")
        assert await complete(client) == 200 and cluster.told_ports[-1] == new
        assert await complete(client) == 200 and cluster.told_ports[-1] == newer
        assert cluster.discoveries["p1"] == 2 and p.failures == 0

    run(["p1"], scenario)


def test_a_dead_prefill_is_dropped_at_once_and_retried_after_a_bounded_backoff() -> None:
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        p1, _ = proxy.prefill
        assert await complete(client) == 200 and await complete(client) == 200  # both learned, both serve
        cluster.dead.add("p1")
        p1.side_checked -= proxy_mod.REVALIDATE_AFTER_S + 1
        cluster.listeners["p1"].close()
        for _ in range(6):  # every request is served: the one that picked the dead prefill went to p2
            assert await complete(client) == 200
        assert cluster.prefills == {"p1": 1, "p2": 7}
        assert p1.failures == 1 and p1.side is None
        loop_now = time.monotonic()
        assert 0 < p1.down_until - loop_now <= proxy_mod.BACKOFF_MIN_S
        p1.down_until = 0.0  # the backoff ran out: one new attempt, then twice as long out
        assert await complete(client) == 200
        assert p1.failures == 2 and p1.down_until - time.monotonic() > proxy_mod.BACKOFF_MIN_S
        for _ in range(40):  # consecutive failures: the backoff doubles up to its bound
            p1.mark_down("still dead")
        assert p1.down_until - time.monotonic() <= proxy_mod.BACKOFF_MAX_S
        cluster.dead.discard("p1")  # it comes back (on a new port): found again once its backoff ends
        cluster.restart_on_new_port("p1")
        p1.down_until = 0.0
        for _ in range(2):
            assert await complete(client) == 200
        assert cluster.told_ports[-2:].count(cluster.port("p1")) == 1 and p1.failures == 0

    run(["p1", "p2"], scenario)


def test_no_live_prefill_is_a_503_not_a_hang() -> None:
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        cluster.dead.update({"p1", "p2"})
        assert await complete(client) == 503
        assert all(i.failures == 1 for i in proxy.prefill)

    run(["p1", "p2"], scenario)
