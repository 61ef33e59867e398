"""The proxy finds a prefill again after its side channel moved, drops a dead one for a bounded backoff, and
bounds the discovery of a prefill that accepts and never answers. Fake prefill/decode instances are real loopback
HTTP servers (a dead one stops listening), with real listening sockets as side channels; no vLLM process."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("httptools", reason="the proxy's HTTP dependencies are not installed")
proxy_mod = pytest.importorskip("kvtransport_vllm.proxy", reason="kvtransport-vllm is not installed")
from kvtransport_vllm import http11  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class FakeCluster:
    """Prefill instances (``pN``) whose side channel is a real listening socket, and one decode (``d``) recording
    the side-channel port each decode request was told; each an HTTP server on a port of its own. A ``dead``
    instance's server is closed (connections refused) until it is revived on the same port. ``hang``: prefills
    that accept discovery (and model-name) requests and never answer them."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.listeners = {n: socket.create_server(("127.0.0.1", 0)) for n in names}
        self.discoveries: dict[str, int] = dict.fromkeys(names, 0)
        self.prefills: dict[str, int] = dict.fromkeys(names, 0)
        self.told_ports: list[int] = []
        self.hang: set[str] = set()
        self.hung = 0  # requests left unanswered
        self.servers: dict[str, Any] = {}
        self.ports: dict[str, int] = {}

    async def start(self) -> None:
        for name in [*self.names, "d"]:
            await self.revive(name)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    async def kill(self, name: str) -> None:
        await self.servers.pop(name).aclose()

    async def revive(self, name: str) -> None:
        server = http11.Server(self.handler(name))
        self.servers[name] = await server.start("127.0.0.1", self.ports.get(name, 0))
        self.ports[name] = server.port

    @property
    def dead(self) -> set[str]:
        return {n for n in self.names if n not in self.servers}

    def port(self, name: str) -> int:
        return int(self.listeners[name].getsockname()[1])

    def restart_on_new_port(self, name: str) -> None:
        self.listeners[name].close()
        self.listeners[name] = socket.create_server(("127.0.0.1", 0))

    async def close(self) -> None:
        for server in self.servers.values():
            await server.aclose()
        for s in self.listeners.values():
            s.close()

    def handler(self, host: str) -> Any:
        async def handle(request: Any, reply: Any) -> None:
            if host in self.hang and (request.path == "/v1/models" or b"kvt_discover" in request.body):
                self.hung += 1
                await asyncio.sleep(3600)
            if request.path == "/v1/models":
                reply.send(200, json.dumps({"data": [{"id": "tiny"}]}).encode())
                return
            body = json.loads(request.body)
            params = body.get("kv_transfer_params") or {}
            if host == "d":
                self.told_ports.append(params["remote_port"])
                reply.send(200, b'{"choices": [{"text": " w7 ok"}]}')
                return
            side = {"host": "127.0.0.1", "port": self.port(host), "engine": f"engine-{host}-{self.port(host)}"}
            if params.get("kvt_discover"):
                self.discoveries[host] += 1
                reply.send(200, json.dumps({"kv_transfer_params": {
                    "kvt_host": side["host"], "kvt_port": side["port"], "kvt_engine_id": side["engine"]}}).encode())
                return
            self.prefills[host] += 1
            reply.send(200, json.dumps({"id": "cmpl-p", "choices": [{"index": 0, "text": " w7",
                                                                     "finish_reason": "length"}],
                                        "kv_transfer_params": {
                                            "do_remote_prefill": True, "remote_host": side["host"],
                                            "remote_port": side["port"], "remote_engine_id": side["engine"]}}).encode())

        return handle


async def complete(client: Any) -> int:
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    if r.status_code == 200:
        assert r.json() == {"choices": [{"text": " w7 ok"}]}
    return int(r.status_code)


def run(names: list[str], scenario: Any, **kw: Any) -> None:
    cluster = FakeCluster(names)

    async def main() -> None:
        await cluster.start()
        proxy = proxy_mod.Proxy([cluster.url(n) for n in names], [cluster.url("d")], **kw)
        server = await proxy.serve("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as client:
                await scenario(cluster, proxy, client)
        finally:
            await server.aclose()
            await proxy.close()
            await cluster.close()

    asyncio.run(main())


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
        await cluster.kill("p1")
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
        await cluster.revive("p1")  # it comes back (on a new side-channel port): found again once its backoff ends
        cluster.restart_on_new_port("p1")
        p1.down_until = 0.0
        for _ in range(2):
            assert await complete(client) == 200
        assert cluster.told_ports[-2:].count(cluster.port("p1")) == 1 and p1.failures == 0

    run(["p1", "p2"], scenario)


def test_no_live_prefill_is_a_503_not_a_hang() -> None:
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        await cluster.kill("p1")
        await cluster.kill("p2")
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json() == {"error": f"no prefill instance reachable: {cluster.url('p1')}, {cluster.url('p2')}"}
        assert [i.failures for i in proxy.prefill] == [1, 1]

    run(["p1", "p2"], scenario)


BOUND = 0.5


def test_a_discovery_that_never_answers_ends_within_its_bound() -> None:
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        (p,) = proxy.prefill
        cluster.hang.add("p1")
        t0 = time.monotonic()
        # two requests at once: the second waits for the first's discovery (the instance lock), then fails at
        # once instead of asking again
        codes = await asyncio.gather(complete(client), complete(client))
        took = time.monotonic() - t0
        assert codes == [503, 503] and BOUND <= took < 2 * BOUND
        assert (p.failures, cluster.hung) == (1, 1) and not p.lock.locked()
        # the prefill answers again: the next request (once the backoff ran out) is served
        cluster.hang.clear()
        p.down_until = 0.0
        assert await complete(client) == 200
        assert (p.failures, cluster.discoveries["p1"], cluster.prefills["p1"]) == (0, 1, 1)

    run(["p1"], scenario, discovery_timeout=BOUND)


def test_a_hung_prefill_costs_one_bound_and_the_request_goes_to_the_next() -> None:
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        p1, p2 = proxy.prefill
        assert await complete(client) == 200  # p1 learned (the model name too)
        cluster.hang.add("p1")
        p1.side = None  # forgotten: the next use of p1 asks it again, and it never answers
        assert await complete(client) == 200  # p2
        t0 = time.monotonic()
        assert await complete(client) == 200  # p1 hangs: within the bound, the request goes to p2
        took = time.monotonic() - t0
        assert BOUND <= took < BOUND + 0.5
        assert (p1.failures, p2.failures, cluster.prefills) == (1, 0, {"p1": 1, "p2": 2})
        assert await complete(client) == 200 and cluster.prefills == {"p1": 1, "p2": 3}  # p1 out of rotation

    run(["p1", "p2"], scenario, discovery_timeout=BOUND)


def test_a_missed_health_probe_fails_no_request_and_keeps_the_side_channel() -> None:
    """A health probe with no answer (a prefill slowed by a starved host, as in CI: load 42 on 2 cores) takes the
    instance out of rotation but fails nothing that was sent to it: a request waiting for the instance's lock
    while the probe fires still gets the side channel (it was answered 503 at once before), the cached side
    channel is kept (no new discovery on the starved instance), and the only prefill still serves."""
    async def scenario(cluster: FakeCluster, proxy: Any, client: Any) -> None:
        (p,) = proxy.prefill
        assert await complete(client) == 200 and cluster.discoveries["p1"] == 1
        side, failed_at = dict(p.side), p.failed_at
        p.side_checked -= proxy_mod.REVALIDATE_AFTER_S + 1  # the waiter below takes the lock, not the cache
        await p.lock.acquire()  # another request's discovery holds the instance
        waiter = asyncio.ensure_future(proxy.discover(p, []))
        await asyncio.sleep(0.05)
        p.probed(None, "none within 5 s", 10.0)  # the probe gives up on it meanwhile
        assert not p.up(time.monotonic()) and p.side == side and p.failed_at == failed_at
        p.lock.release()
        assert await asyncio.wait_for(waiter, 5) == side
        assert await complete(client) == 200  # out of rotation, but the only one: served
        assert cluster.discoveries["p1"] == 1 and cluster.prefills["p1"] == 2
        assert p.up(time.monotonic()) and p.failures == 0  # its answer put it back in rotation

    run(["p1"], scenario, health_interval=None)
