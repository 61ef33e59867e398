"""``kvtransport-proxy`` against a hostile client and failing instances, each attack as a test: a 128 MiB body
(and a body that balloons when parsed) leaves the proxy's peak RSS bounded; a prefill or a decode that accepts and
never answers fails the requests sent to it within the timeout (504, naming it and the flag), leaves the rotation
and the other requests are served; /health names the instances out of rotation and the health probe re-admits
them; SIGTERM stops the proxy within 10 s with a hung upstream and open clients; malformed requests get 400 and
reach no instance; /metrics counts every outcome. Fake instances are real loopback HTTP servers answering as
vLLM's OpenAI server does (a prefill with a real side-channel socket); the real proxy process where the attack
was on one; no vLLM."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("httptools", reason="the proxy's HTTP dependencies are not installed")
proxy_mod = pytest.importorskip("kvtransport_vllm.proxy", reason="kvtransport-vllm is not installed")
from kvtransport_vllm import http11, proxycheck  # noqa: E402

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
BODY = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 4}


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Fake:
    """One fake vLLM instance on loopback. A prefill answers discovery with its side channel (a real listening
    socket) and a completion with one token; a decode answers the whole text, streamed or not, but waits forever
    for KV from a prefill that does not answer (as a real decode waits for its push). ``hang``: accepts every
    request (/health too) and never answers; ``stall``: answers /health, /v1/models and discovery, never a
    completion. ``kill`` / ``revive``: stop listening / listen again on the same port."""

    def __init__(self, role: str, cluster: Cluster) -> None:
        self.role, self.cluster = role, cluster
        self.side = socket.create_server(("127.0.0.1", 0)) if role == "prefill" else None
        self.hang = self.stall = False
        self.completions = 0  # completion requests that reached this instance (discovery not counted)
        self.server: Any = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def side_port(self) -> int:
        assert self.side is not None
        return int(self.side.getsockname()[1])

    async def revive(self) -> None:
        self.server = await http11.Server(self.handle).start("127.0.0.1", self.port)
        self.port = self.server.port

    async def kill(self) -> None:
        await self.server.aclose()
        self.server = None

    async def handle(self, request: Any, reply: Any) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if request.path == "/health":
            reply.send(200, b"")
            return
        if request.path == "/v1/models":
            reply.send(200, json.dumps({"data": [{"id": "tiny"}]}).encode())
            return
        body = json.loads(request.body)
        params = body.get("kv_transfer_params") or {}
        if params.get("kvt_discover"):
            reply.send(200, json.dumps({"kv_transfer_params": {
                "kvt_host": "127.0.0.1", "kvt_port": self.side_port, "kvt_engine_id": f"P{self.port}"}}).encode())
            return
        self.completions += 1
        source = self.cluster.by_side.get(params.get("remote_port"))
        if self.stall or (self.role == "decode" and source is not None and (source.hang or source.stall)):
            await asyncio.Event().wait()
        if self.role == "decode" and source is not None and source.server is None:  # its KV cannot come
            reply.send(500, b'{"error": {"message": "KV transfer failed: the prefill is gone", "code": 500}}')
            return
        if self.role == "prefill":
            reply.send(200, json.dumps({
                "id": "cmpl-p", "object": "text_completion", "model": "tiny",
                "choices": [{"index": 0, "text": " w7", "finish_reason": "length", "token_ids": [7]}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
                "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": self.side_port,
                                       "remote_engine_id": f"P{self.port}"}}).encode())
        elif body.get("stream"):
            reply.start(200, "text/event-stream")
            for text, ids in ((" w7 w8", [7, 8]), (" w9", [9])):
                await reply.write(sse({"id": "cmpl-d", "object": "text_completion", "choices": [
                    {"index": 0, "text": text, "token_ids": ids, "finish_reason": None}]}))
            await reply.write(b"data: [DONE]\n\n")
            reply.end()
        else:
            reply.send(200, json.dumps({"id": "cmpl-d", "choices": [
                {"index": 0, "text": " w7 w8 w9", "finish_reason": "length"}]}).encode())


class Cluster:
    def __init__(self, prefills: int = 1, decodes: int = 1) -> None:
        self.prefill = [Fake("prefill", self) for _ in range(prefills)]
        self.decode = [Fake("decode", self) for _ in range(decodes)]
        self.by_side = {p.side_port: p for p in self.prefill}

    async def start(self) -> None:
        for fake in self.prefill + self.decode:
            await fake.revive()

    async def stop(self) -> None:
        for fake in self.prefill + self.decode:
            if fake.server is not None:
                await fake.kill()
            if fake.side is not None:
                fake.side.close()

    def urls(self, role: str) -> list[str]:
        return [f.url for f in (self.prefill if role == "prefill" else self.decode)]


def run(cluster: Cluster, scenario: Any, **kw: Any) -> None:
    """``scenario(client, proxy)`` against a proxy on loopback (in this process) in front of ``cluster``."""

    async def main() -> None:
        await cluster.start()
        proxy = proxy_mod.Proxy(cluster.urls("prefill"), cluster.urls("decode"), **kw)
        server = await proxy.serve("127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
                await scenario(client, proxy)
        finally:
            await server.aclose()
            await proxy.close()
            await cluster.stop()

    asyncio.run(main())


async def timed(client: Any, body: dict[str, Any] | None = None, **kw: Any) -> tuple[int, str, float]:
    """POST /v1/completions: status, text (the answer's, or its error), seconds taken."""
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json=body or BODY, **kw)
    took = time.monotonic() - t0
    out = r.json()
    return r.status_code, out["choices"][0]["text"] if r.status_code == 200 else out["error"], took


# --------------------------------------------------------------------------------- real proxy processes
class Background:
    """An event loop in a thread, for fake instances beside a proxy process."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_proxy(log: Path, *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m kvtransport_vllm.proxy ARGS`` on a free port, once it answers GET /health."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvtransport_vllm.proxy", *args, "--port", str(port),
                             "--log-level", "warning"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, port
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
        time.sleep(0.1)


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} in /proc/{pid}/status")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def send_body(port: int, head: bytes, size: int, chunked: bool) -> bytes:
    """A client that sends ``size`` body bytes whatever the proxy answers (until the connection breaks);
    returns the start of the answer."""
    piece = b"x" * MiB
    frame = b"100000\r\n" + piece + b"\r\n" if chunked else piece
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        try:
            for _ in range(size // MiB):
                s.sendall(frame)
        except OSError:
            pass  # refused and closed: what the proxy does after LINGER_S
        try:
            return s.recv(4096)
        except OSError:
            return b""


BOUND_KIB = 32 * 1024


def test_a_128_mib_body_and_a_body_that_balloons_leave_the_proxy_rss_bounded(tmp_path: Path) -> None:
    """Point 1: the real proxy with its default limits. A 128 MiB body, announced (content-length) or not
    (chunked), sent in full by a client that ignores the 413; and a body within the limit made of empty arrays
    (parsed, ~25 times its size): the proxy's peak RSS (VmHWM) grows by less than BOUND_KIB (32 MiB; measured: +3
    MiB and +11 MiB, where the proxy before this test held +63 MiB of the chunked body and +104 MiB parsed)."""
    proc, port = start_proxy(tmp_path / "proxy.log", "--prefill", "http://127.0.0.1:9", "--decode",
                             "http://127.0.0.1:9")
    try:
        for _ in range(3):  # warm-up: the request path, the 400 path, /metrics
            httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{bad", timeout=10)
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        before = status_kib(proc.pid, "VmHWM")
        size = 128 * MiB
        got = send_body(port, b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-length: %d\r\n\r\n" % size,
                        size, chunked=False)
        assert got.startswith(b"HTTP/1.1 413 "), got
        got = send_body(port, b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ntransfer-encoding: chunked\r\n\r\n",
                        size, chunked=True)
        assert got.startswith(b"HTTP/1.1 413 "), got
        grew = status_kib(proc.pid, "VmHWM") - before
        assert grew < BOUND_KIB, f"peak RSS grew by {grew} KiB under 128 MiB bodies"
        limit = 4 * MiB  # the default, REQUEST_BODY_BYTES
        balloon = b'{"model": "tiny", "prompt": [' + b"[]," * ((limit - 64) // 3) + b"[]]}"
        assert len(balloon) <= limit
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=balloon, timeout=60)
        grew = status_kib(proc.pid, "VmHWM") - before
        assert grew < BOUND_KIB, f"peak RSS grew by {grew} KiB under a {len(balloon)}-byte body of arrays"
        assert r.status_code == 400, r.text
        assert proc.poll() is None
    finally:
        stop(proc)


# --------------------------------------------------------------------------------- hung instances
@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_a_prefill_that_never_answers_fails_its_requests_within_the_timeout(first_token: str) -> None:
    """Point 2: a prefill that answered discovery, then accepts requests and never answers them. The requests
    routed to it get 504 naming it and --prefill-timeout within the timeout (its decode leg, waiting for KV that
    is not coming, is closed), the others are served meanwhile, and it leaves the rotation."""
    cluster = Cluster(prefills=2)
    bound = 1.0

    async def scenario(client: Any, proxy: Any) -> None:
        p1, p2 = cluster.prefill
        assert [(await timed(client))[0] for _ in range(2)] == [200, 200]  # both prefills' side channels known
        p1.stall = True
        got = await asyncio.wait_for(asyncio.gather(*(timed(client) for _ in range(4))), 30)
        hung = [g for g in got if g[0] != 200]
        assert len(hung) == 2, got
        for status, error, took in hung:
            assert status == 504 and p1.url in error and "--prefill-timeout" in error, error
            assert bound <= took < bound + 1.5, took
        assert all(took < bound for status, _, took in got if status == 200), got  # served meanwhile
        served = p2.completions
        for _ in range(3):  # out of rotation: every request goes to p2, at once
            status, _, took = await asyncio.wait_for(timed(client), 30)
            assert status == 200 and took < bound
        assert p2.completions == served + 3
        assert proxy.prefill[0].failures >= 1 and proxy.prefill[1].failures == 0

    run(cluster, scenario, prefill_timeout=bound, first_token=first_token, health_interval=None)


def test_a_decode_that_never_answers_fails_within_the_timeout_and_leaves_the_rotation() -> None:
    """Point 2: a decode that accepts and never answers: 504 naming it and --timeout within the timeout (an
    error event after the prefill's first token when streamed); then it is out of rotation and every request is
    served by the other decode at once."""
    cluster = Cluster(decodes=2)
    bound = 1.0

    async def scenario(client: Any, proxy: Any) -> None:
        d1, d2 = cluster.decode
        d1.hang = True
        status, error, took = await asyncio.wait_for(timed(client), 30)
        assert status == 504 and d1.url in error and "--timeout" in error, error
        assert bound <= took < bound + 1.5
        for _ in range(4):
            status, _, took = await asyncio.wait_for(timed(client), 30)
            assert status == 200 and took < bound
        assert d2.completions == 4
        # streamed: the first token (from the prefill) is out when the decode times out: an error event
        proxy.decode[1].mark_down("test: make d1 the only decode in rotation")
        proxy.decode[0].down_until = 0.0
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            lines = [json.loads(x[6:]) for x in [line async for line in r.aiter_lines()]
                     if x.startswith("data: {")]
        assert lines[0]["choices"][0]["text"] == " w7"
        assert lines[1]["error"]["code"] == 504 and d1.url in lines[1]["error"]["message"]

    run(cluster, scenario, timeout=bound, health_interval=None)


# --------------------------------------------------------------------------------- health
async def until(check: Any, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.05)


def test_down_instances_are_skipped_named_by_health_and_readmitted_by_the_probe() -> None:
    """Point 3: an instance that stops answering (dead, or hung) is taken out by the health probe (no request
    needed), skipped by round-robin, and named by /health (200, ``degraded``); every prefill out: ``unavailable``,
    /ready 503. Once an instance answers /health again it is back in rotation within a probe interval."""
    cluster = Cluster(prefills=2, decodes=2)
    interval = 0.2

    async def health(client: Any, path: str = "/health") -> tuple[int, dict[str, Any]]:
        r = await client.get(path)
        return r.status_code, r.json()

    async def scenario(client: Any, proxy: Any) -> None:
        (p1, p2), (d1, d2) = cluster.prefill, cluster.decode
        assert await health(client) == (200, {"status": "ok", "mode": "push", "prefill": [p1.url, p2.url],
                                              "decode": [d1.url, d2.url]})
        await p1.kill()
        d1.hang = True
        t0 = time.monotonic()
        await until(lambda: not proxy.prefill[0].up(time.monotonic()) and not proxy.decode[0].up(time.monotonic()))
        assert time.monotonic() - t0 < 2 * (interval + proxy.health_timeout) + 1
        status, body = await health(client)
        assert status == 200 and body["status"] == "degraded" and set(body["down"]) == {p1.url, d1.url}
        assert "GET /health" in body["down"][p1.url]
        before = (p2.completions, d2.completions)
        for _ in range(4):  # round-robin skips them
            status, _, took = await asyncio.wait_for(timed(client), 30)
            assert status == 200 and took < 1
        assert (p2.completions, d2.completions) == (before[0] + 4, before[1] + 4) and d1.completions == 0
        p2.hang = True  # every prefill out
        await until(lambda: not proxy.prefill[1].up(time.monotonic()))
        status, body = await health(client)
        assert status == 200 and body["status"] == "unavailable" and set(body["down"]) == {p1.url, p2.url, d1.url}
        assert (await health(client, "/ready"))[0] == 503
        # they answer again: re-admitted by the probe
        await p1.revive()
        d1.hang = False
        await until(lambda: proxy.prefill[0].up(time.monotonic()) and proxy.decode[0].up(time.monotonic()),
                    within=2 * (interval + proxy.health_timeout) + 1)
        status, body = await health(client, "/ready")
        assert status == 200 and body["status"] == "degraded" and set(body["down"]) == {p2.url}
        for _ in range(4):
            assert (await asyncio.wait_for(timed(client), 30))[0] == 200
        assert d1.completions == 2 and p1.completions == 4  # both decodes in turn again; p2 still out

    run(cluster, scenario, health_interval=interval, health_timeout=0.3)


# --------------------------------------------------------------------------------- SIGTERM
def test_sigterm_stops_the_proxy_within_10_s_with_a_hung_upstream_and_open_clients(tmp_path: Path) -> None:
    """Point 4: the real proxy with its default timeouts, a prefill that never answers a completion and a decode
    that never answers anything; clients with requests in flight, an idle keep-alive connection, a request half
    sent and a connection that sent nothing. SIGTERM: the process exits (0) within 10 s."""
    bg = Background()
    cluster = Cluster()
    bg.run(cluster.start())
    cluster.prefill[0].stall = True
    cluster.decode[0].hang = True
    proc, port = start_proxy(tmp_path / "proxy.log", "--prefill", *cluster.urls("prefill"), "--decode",
                             *cluster.urls("decode"))
    clients: list[socket.socket] = []
    try:
        request = json.dumps({**BODY, "stream": True}).encode()
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port), timeout=15)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n%s" % (len(request), request))
            clients.append(s)
        idle = socket.create_connection(("127.0.0.1", port), timeout=15)
        idle.sendall(b"GET /health HTTP/1.1\r\nhost: p\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200 ")
        half = socket.create_connection(("127.0.0.1", port), timeout=15)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: p\r\ncontent-length: 1000\r\n\r\n{\"model")
        silent = socket.create_connection(("127.0.0.1", port), timeout=15)
        clients += [idle, half, silent]
        time.sleep(1.5)  # the requests reached the instances, which never answer
        assert cluster.prefill[0].completions == 3 and proc.poll() is None
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, (tmp_path / "proxy.log").read_text()
        assert time.monotonic() - t0 < 10
    finally:
        for s in clients:
            s.close()
        stop(proc)
        bg.run(cluster.stop())
        bg.close()


# --------------------------------------------------------------------------------- malformed requests
MALFORMED: list[bytes] = [
    b"", b"{not json", b"\xff\xfe{}", b"[1, 2]", b'"a string"', b"null", b"42",
    b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # deeper than the parser goes
    b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # and more arrays than the guard lets through
    b'{"prompt": "x", "max_tokens": NaN}', b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "temperature": -Infinity}', b'{"prompt": "x", "max_tokens": 1e400}',
    b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}",
    b'{"prompt": "x", "top_p": 1e999}',
    b'{"prompt": "x", "n": Infinity}',
    b'{"prompt": "' + b"x" * 100_000 + b'", "stop": [' + b'"a",' * 70_000 + b'"a"]}',  # balloon (strings)
    b'{"prompt": [' + b"{}," * 70_000 + b"{}]}",  # balloon (objects)
]
WRONG_TYPES: list[dict[str, Any]] = [
    {"n": "2"}, {"n": 0}, {"n": -1}, {"n": 2.5}, {"n": 10**30}, {"n": 100_000}, {"n": True}, {"n": [2]},
    {"stream": "yes"}, {"stream": 1}, {"stream": {}},
    {"stream": True, "stream_options": "x"}, {"stream": True, "stream_options": {"include_usage": "yes"}},
    {"stream_options": {"include_usage": True}},
    {"max_tokens": "5"}, {"max_tokens": -1}, {"max_tokens": 1.5}, {"max_tokens": 2**63}, {"max_tokens": []},
    {"max_tokens": {}}, {"max_tokens": True}, {"max_completion_tokens": "x"}, {"min_tokens": "2"},
    {"min_tokens": -3}, {"kv_transfer_params": "x"}, {"kv_transfer_params": [1]}, {"kv_transfer_params": 1},
    {"seed": "x"}, {"seed": 2**64}, {"seed": 1.5}, {"best_of": "2"}, {"best_of": 10**6}, {"logprobs": "x"},
    {"logprobs": -1}, {"logprobs": 1.5}, {"top_logprobs": "x"}, {"prompt_logprobs": "x"}, {"echo": "yes"},
    {"stop": 5}, {"stop": [1, 2]}, {"stop": {"a": 1}}, {"use_beam_search": "no"},
]


def test_malformed_requests_get_400_reach_no_instance_and_the_proxy_keeps_serving() -> None:
    """Point 5: invalid JSON, JSON that is not an object, NaN/Infinity/out-of-range numbers, nesting too deep,
    bodies that would balloon when parsed, and wrong types or ranges for every field the proxy reads, on both
    APIs and in every flow: 400 with a JSON error, no instance asked; a valid request is served afterwards."""
    cluster = Cluster()
    bodies = [*MALFORMED]
    for extra in WRONG_TYPES:
        bodies.append(json.dumps({**BODY, **extra}).encode())
        chat = {k: v for k, v in BODY.items() if k != "prompt"}
        bodies.append(json.dumps({**chat, "messages": [{"role": "user", "content": "w1"}], **extra}).encode())

    async def scenario(client: Any, proxy: Any) -> None:
        for mode in ("prefill", "decode"):
            proxy.first_token = mode
            for i, body in enumerate(bodies):
                api = "/v1/chat/completions" if b'"messages"' in body else "/v1/completions"
                r = await client.post(api, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (i, body[:200], r.status_code, r.text[:300])
                assert isinstance(r.json()["error"], str)
        assert [f.completions for f in cluster.prefill + cluster.decode] == [0, 0]
        proxy.first_token = "prefill"
        # chat's logprobs is a boolean; both APIs still served
        r = await client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3, "logprobs": True,
                                                              "messages": [{"role": "user", "content": "w1"}]})
        assert r.status_code == 200
        for body in ({**BODY, "kv_transfer_params": {"do_remote_decode": True}}, {**BODY, "max_tokens": 1,
                                                                                   "kv_transfer_params": {}}):
            status, text, _ = await timed(client, body)
            assert (status, text) in ((200, " w7 w8 w9"), (200, " w7"))

    run(cluster, scenario, health_interval=None)


def test_the_request_checks_themselves() -> None:
    """The parser and the field checks behind point 5, directly: strict JSON, the balloon guard counts only
    what is outside strings (a long prompt full of quotes and brackets passes), and the messages name the fix."""
    prompt = 'code {"a": [1, 2]} "quoted" [x] \\ ' * 20_000
    ok = proxy_mod.parse_request(json.dumps({"prompt": prompt}).encode(), 65536)
    assert isinstance(ok, dict) and ok["prompt"] == prompt
    ids = proxy_mod.parse_request(json.dumps({"prompt": list(range(200_000))}).encode(), 65536)
    assert isinstance(ids, dict)
    why = proxy_mod.parse_request(b'{"prompt": [' + b"[]," * 70_000 + b"[]]}", 65536)
    assert isinstance(why, str) and "raise --max-body-bytes" in why
    assert proxy_mod.parse_request(b'{"t": NaN}', 65536) == "the request body is not JSON: NaN is not JSON"
    assert proxy_mod.invalid({"n": 300}, chat=False) == f"n must be an integer in [1, {proxy_mod.MAX_N}], got 300"
    assert proxy_mod.invalid({"logprobs": 2}, chat=True) == "logprobs must be true or false, got 2"
    assert proxy_mod.invalid({"logprobs": 2, "n": None, "stop": ["a"]}, chat=False) is None
    assert not math.isnan(proxycheck.finite("1e308"))


# --------------------------------------------------------------------------------- /metrics
def scrape(text: str) -> dict[str, float]:
    """Prometheus text format to ``{name{labels}: value}``, checked by prometheus_client's parser."""
    parser = pytest.importorskip("prometheus_client.parser")
    out: dict[str, float] = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_metrics_count_every_outcome_and_the_proxys_own_time() -> None:
    """Point 6 (issue 28): after a known set of requests, /metrics (Prometheus text format) counts each outcome
    exactly, observes the proxy's own time once per answered request (less than the whole time to the first
    byte), counts the 413 refused at the HTTP layer, and gauges the instances in rotation."""
    cluster = Cluster()

    async def scenario(client: Any, proxy: Any) -> None:
        (p,), (d,) = cluster.prefill, cluster.decode
        for body in (BODY, {**BODY, "stream": True}, {**BODY, "max_tokens": 1}, {**BODY, "n": 2}, BODY):
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
        for bad in (b"{bad", b'{"n": "x"}'):
            assert (await client.post("/v1/completions", content=bad)).status_code == 400
        assert (await client.post("/v1/completions", content=b"x" * 5000)).status_code == 413
        d.hang = True
        async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            async for line in r.aiter_lines():  # the first token (from the prefill), then the client leaves
                assert line.startswith("data: {")
                break
        assert (await client.post("/v1/completions", json=BODY)).status_code == 504  # the decode's timeout
        d.hang = False
        await p.kill()  # the side channel is cached: the prefill leg fails at connect, and the decode's answer
        # (its failure path: the KV's source is gone) is relayed
        assert (await client.post("/v1/completions", json=BODY)).status_code == 500
        assert (await client.post("/v1/completions", json=BODY)).status_code == 503  # none left: discovery
        r = await client.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
        m = scrape(r.text)
        outcomes = {k: m[f'kvtransport_proxy_requests_total{{outcome="{k}"}}'] for k in proxy_mod.OUTCOMES}
        assert outcomes == {"ok": 5, "client_error": 2, "upstream_error": 1, "timeout": 1, "unavailable": 1,
                            "disconnected": 1, "internal_error": 0}
        assert m['kvtransport_proxy_refused_total{code="413"}'] == 1
        assert m["kvtransport_proxy_in_flight"] == 0
        own, first = m["kvtransport_proxy_overhead_seconds_count"], m["kvtransport_proxy_first_byte_seconds_count"]
        assert own == first == 5  # the answered requests
        assert m['kvtransport_proxy_overhead_seconds_bucket{le="+Inf"}'] == 5
        assert 0 < m["kvtransport_proxy_overhead_seconds_sum"] < m["kvtransport_proxy_first_byte_seconds_sum"]
        labels = {f: f'{{role="{f.role}",url="{f.url}"}}' for f in (p, d)}
        assert [m[f"kvtransport_proxy_instance_up{labels[f]}"] for f in (p, d)] == [0, 0]
        # the prefill: its leg's connect, then discovery; the decode: its timeout
        assert [m[f"kvtransport_proxy_instance_failures_total{labels[f]}"] for f in (p, d)] == [2, 1]

    run(cluster, scenario, timeout=0.5, max_body_bytes=4096, health_interval=None)
