"""kvtransport_vllm.http11 on its own: the proxy's HTTP/1.1 server and keep-alive client, on loopback, under
asyncio's own event loop and under uvloop. The raw-socket side of each test reads and writes bytes itself (no
second HTTP implementation), so what is checked is what goes over the wire."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("httptools", reason="the proxy's HTTP dependencies are not installed")
http11 = pytest.importorskip("kvtransport_vllm.http11", reason="kvtransport-vllm is not installed")

pytestmark = pytest.mark.timeout(60)

Run = Callable[[Awaitable[Any]], Any]

# uvloop keeps time in whole milliseconds: a 0.3 s timer can fire a fraction of a millisecond before
# time.monotonic() reads 0.3 s (CI saw 0.29996). Lower bounds on a timeout allow this much early.
EARLY = 0.002


@pytest.fixture(params=["asyncio", "uvloop"])
def arun(request: pytest.FixtureRequest) -> Run:
    """Runs a coroutine to its end on a fresh event loop of the parametrized kind."""
    factory = None
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory = uvloop.new_event_loop

    def run(coro: Awaitable[Any]) -> Any:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]

    return run


async def serve(handler: Any, **kw: Any) -> Any:
    return await http11.Server(handler, **kw).start("127.0.0.1", 0)


async def echo(request: Any, reply: Any) -> None:
    """Answers ``<method> <target> <body length>`` and the body."""
    reply.send(200, b"%s %s %d|" % (request.method.encode(), request.target.encode(), len(request.body))
               + request.body, "text/plain")


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response off a raw connection: status, headers (lower-case), body (content-length or chunked)."""
    line = await reader.readuntil(b"\r\n")
    status = int(line.split()[1])
    headers: dict[str, str] = {}
    while True:
        line = await reader.readuntil(b"\r\n")
        if line == b"\r\n":
            break
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if status < 200:
        return status, headers, b""
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


async def wait_eof(reader: asyncio.StreamReader, within: float) -> float:
    """Seconds until the peer closes (reading and dropping what comes); fails past ``within``."""
    t0 = time.monotonic()
    while await asyncio.wait_for(reader.read(65536), within):
        pass
    return time.monotonic() - t0


def test_a_chunked_body_cut_anywhere_arrives_whole(arun: Run) -> None:
    async def main() -> None:
        server = await serve(echo)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (b"hello ", b"chunked", b" world" * 50)) + b"0\r\n\r\n"
        wire = b"POST /echo?x=1 HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n" + body
        for i in range(0, len(wire), 7):  # every chunk-size line and CRLF cut somewhere
            writer.write(wire[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        status, headers, got = await read_response(reader)
        expect = b"hello chunked" + b" world" * 50
        assert (status, got) == (200, b"POST /echo?x=1 %d|" % len(expect) + expect)
        assert headers["content-type"] == "text/plain" and "connection" not in headers
        writer.close()
        await server.aclose()

    arun(main())


def test_a_content_length_body_in_pieces_and_pipelined_requests_in_order(arun: Run) -> None:
    order: list[str] = []

    async def slow_first(request: Any, reply: Any) -> None:
        if request.path == "/slow":
            await asyncio.sleep(0.2)
        order.append(request.path)
        reply.send(200, request.path.encode() + b":" + request.body, "text/plain")

    async def main() -> None:
        server = await serve(slow_first)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        first = b"POST /slow HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\n0123456789"
        writer.write(first[:30])
        await writer.drain()
        await asyncio.sleep(0.05)
        # the rest of the first request and two more, in one write: answered in order, one at a time
        writer.write(first[30:] + b"GET /a HTTP/1.1\r\nhost: t\r\n\r\n" + b"POST /b HTTP/1.1\r\nhost: t\r\n"
                     b"content-length: 3\r\n\r\nxyz")
        got = [await read_response(reader) for _ in range(3)]
        assert [(s, b) for s, _, b in got] == [(200, b"/slow:0123456789"), (200, b"/a:"), (200, b"/b:xyz")]
        assert order == ["/slow", "/a", "/b"] and server.accepted == 1
        writer.close()
        await server.aclose()

    arun(main())


def test_expect_100_continue_and_http10_clients(arun: Run) -> None:
    async def streamer(request: Any, reply: Any) -> None:
        reply.start(200, "text/plain")
        await reply.write(b"one ")
        await reply.write(b"two")
        reply.end()

    async def main() -> None:
        server = await serve(echo)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /e HTTP/1.1\r\nhost: t\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n")
        assert (await read_response(reader))[0] == 100  # go on
        writer.write(b"abcd")
        assert (await read_response(reader))[::2] == (200, b"POST /e 4|abcd")
        writer.close()
        await server.aclose()
        server = await serve(streamer)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.0\r\n\r\n")  # no chunked encoding for HTTP/1.0: the body ends with the connection
        raw = await asyncio.wait_for(reader.read(), 5)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK" and b"connection: close" in head
        assert b"transfer-encoding" not in head and body == b"one two"
        await server.aclose()

    arun(main())


def test_keep_alive_reuses_one_connection_and_a_whole_read_returns_it_to_the_pool(arun: Run) -> None:
    async def main() -> None:
        server = await serve(echo)
        pool = http11.Pool(f"http://127.0.0.1:{server.port}")
        for i in range(3):
            r = await pool.request("POST", f"/r{i}", b"x" * i, [("x-test", "1")])
            assert (r.status, r.headers["content-type"], await r.read()) == (200, "text/plain",
                                                                             b"POST /r%d %d|" % (i, i) + b"x" * i)
        r = await pool.request("GET", "/g")
        async with r:
            assert [c async for c in r] == [b"GET /g 0|"]
        assert (server.accepted, pool.connects) == (1, 1)
        # two at once: a second connection; both go back to the pool afterwards
        a, b = await asyncio.gather(pool.request("GET", "/a"), pool.request("GET", "/b"))
        assert (await a.read(), await b.read()) == (b"GET /a 0|", b"GET /b 0|")
        assert (server.accepted, pool.connects, len(pool._idle)) == (2, 2, 2)
        await pool.close()
        await server.aclose()

    arun(main())


def test_over_limit_bodies_get_413_without_buffering_and_the_connection_closes(arun: Run) -> None:
    calls: list[str] = []

    async def handler(request: Any, reply: Any) -> None:
        calls.append(request.path)
        reply.send(200, b"ok")

    async def main() -> None:
        server = await serve(handler, max_body_bytes=1000)
        # announced too large: refused at the head, before any body byte is read
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /big HTTP/1.1\r\nhost: t\r\ncontent-length: 1000000000\r\n\r\n" + b"x" * 65536)
        status, headers, body = await read_response(reader)
        assert (status, headers["connection"], body) == (413, "close", b'{"error": "request body larger than 1000 bytes"}')
        for _ in range(20):  # what the client still sends is dropped, then the connection ends
            writer.write(b"x" * 65536)
        took = await wait_eof(reader, http11.LINGER_S + 3)
        assert took <= http11.LINGER_S + 1
        writer.close()
        # chunked, growing past the bound: refused once it is crossed
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /chunked HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(3):
            writer.write(b"190\r\n" + b"y" * 400 + b"\r\n")  # 400 bytes each: 1200 > 1000
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (413, "close")
        await wait_eof(reader, http11.LINGER_S + 3)
        writer.close()
        # exactly at the bound: served
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /fits HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n" + b"z" * 1000)
        assert (await read_response(reader))[0] == 200
        writer.close()
        assert calls == ["/fits"]
        await server.aclose()

    arun(main())


def test_over_limit_heads_and_malformed_requests_are_refused(arun: Run) -> None:
    async def main() -> None:
        server = await serve(echo)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * http11.MAX_HEAD_BYTES + b"\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (431, "close")
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers["connection"]) == (400, "close") and body.startswith(b'{"error": "malformed')
        await wait_eof(reader, http11.LINGER_S + 3)
        writer.close()
        await server.aclose()

    arun(main())


def test_idle_and_read_timeouts_close_the_connection(arun: Run) -> None:
    async def main() -> None:
        server = await serve(echo, idle_timeout=0.3, read_timeout=0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /1 HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await read_response(reader))[::2] == (200, b"GET /1 0|")
        took = await wait_eof(reader, 3)  # idle after its answer
        assert 0.2 - EARLY <= took <= 1.0
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /2 HTTP/1.1\r\nhost:")  # a request that stops arriving
        took = await wait_eof(reader, 3)
        assert 0.1 - EARLY <= took <= 0.7
        writer.close()
        await server.aclose()
        # no idle bound: a connection may wait for its next request for ever, a request may still not stall
        server = await serve(echo, idle_timeout=None, read_timeout=0.2)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /3 HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await read_response(reader))[::2] == (200, b"GET /3 0|")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.5)  # idle: kept open
        writer.write(b"GET /4 HTTP/1.1\r\n")
        took = await wait_eof(reader, 3)
        assert 0.1 - EARLY <= took <= 0.7
        writer.close()
        await server.aclose()

    arun(main())


def test_streamed_replies_wait_for_a_slow_client(arun: Run) -> None:
    total, piece = 32 * 1024 * 1024, b"z" * 65536
    progress = {"written": 0, "max_buffer": 0}

    async def flood(request: Any, reply: Any) -> None:
        reply.start(200, "application/octet-stream")
        while progress["written"] < total:
            await reply.write(piece)
            progress["written"] += len(piece)
            progress["max_buffer"] = max(progress["max_buffer"], reply.write_buffer_size)
        reply.end()

    async def main() -> None:
        server = await serve(flood)
        pool = http11.Pool(f"http://127.0.0.1:{server.port}")
        r = await pool.request("GET", "/flood")
        await asyncio.sleep(0.5)  # the client does not read: the writer waits
        assert progress["written"] < total // 2
        assert progress["max_buffer"] <= 1024 * 1024
        assert r._buffered <= http11.STREAM_HIGH_WATER + 512 * 1024  # the client stopped reading its socket too
        got = 0
        async for chunk in r:
            assert chunk == b"z" * len(chunk)
            got += len(chunk)
        assert (got, progress["written"]) == (total, total)
        await pool.close()
        await server.aclose()

    arun(main())


def test_a_client_that_goes_away_cancels_its_handler(arun: Run) -> None:
    seen: dict[str, Any] = {}

    async def forever(request: Any, reply: Any) -> None:
        seen["reply"] = reply
        reply.start(200)
        await reply.write(b"data: 1\n\n")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen["cancelled_after_disconnect"] = reply.disconnected
            raise

    async def main() -> None:
        server = await serve(forever)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /s HTTP/1.1\r\nhost: t\r\n\r\n")
        await reader.readuntil(b"data: 1\n\n")
        writer.close()
        for _ in range(200):
            if "cancelled_after_disconnect" in seen:
                break
            await asyncio.sleep(0.01)
        assert seen["cancelled_after_disconnect"] is True
        with pytest.raises(http11.ClientDisconnected):
            await seen["reply"].write(b"late")
        assert server.connections == set()
        await server.aclose()

    arun(main())


def test_closing_a_response_early_closes_its_connection(arun: Run) -> None:
    ended = asyncio.Event()

    async def stream(request: Any, reply: Any) -> None:
        reply.start(200)
        try:
            while True:
                await reply.write(b"tick\n")
                await asyncio.sleep(0.01)
        finally:
            ended.set()

    async def main() -> None:
        server = await serve(stream)
        pool = http11.Pool(f"http://127.0.0.1:{server.port}")
        r = await pool.request("GET", "/s")
        assert await r.__anext__() == b"tick\n"
        r.close()  # aborts the request upstream
        await asyncio.wait_for(ended.wait(), 5)
        assert pool._idle == []
        r2 = await pool.request("GET", "/s")
        assert await r2.__anext__() == b"tick\n"
        r2.close()
        assert pool.connects == 2
        await pool.close()
        await server.aclose()

    arun(main())


async def raw_server(answer: Callable[[int, bytes], bytes | None]) -> tuple[asyncio.Server, list[int]]:
    """A server of raw bytes: ``answer(connection number, request bytes)`` is written back (None: close the
    connection without answering; b"": answer nothing, keep it open; an answer with ``connection: close``: close
    after it)."""
    conns: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(conns)
        conns.append(n)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(x.split(b":")[1]) for x in head.lower().split(b"\r\n")
                               if x.startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                out = answer(n, request)
                if out is None:
                    break
                writer.write(out)
                if b"connection: close" in out:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), conns


def test_timeouts_of_the_client(arun: Run) -> None:
    def stall(n: int, request: bytes) -> bytes:
        if b"/trickle" in request:
            return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n"  # then nothing
        return b""  # never answers

    async def main() -> None:
        server, _ = await raw_server(stall)
        port = server.sockets[0].getsockname()[1]
        pool = http11.Pool(f"http://127.0.0.1:{port}", head_timeout=0.2, read_timeout=0.2)
        t0 = time.monotonic()
        with pytest.raises(http11.ReadTimeout, match="no response head"):
            await pool.request("POST", "/never", b"{}")
        assert 0.2 - EARLY <= time.monotonic() - t0 <= 1.0
        r = await pool.request("GET", "/trickle")
        assert await r.__anext__() == b"first"
        with pytest.raises(http11.ReadTimeout, match="no response body"):
            await r.__anext__()
        r2 = await pool.open("GET", "/never", head_timeout=0.1)  # a per-request bound
        with pytest.raises(http11.ReadTimeout):
            await r2.head()
        assert pool._idle == []  # every timed-out connection was closed, none pooled
        server.close()
        # connecting: a listener whose backlog is full takes no more connections
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        filler = socket.create_connection(listener.getsockname())
        full = http11.Pool(f"http://127.0.0.1:{listener.getsockname()[1]}", connect_timeout=0.3)
        t0 = time.monotonic()
        with pytest.raises(http11.ConnectTimeout):
            await full.request("GET", "/")
        assert 0.3 - EARLY <= time.monotonic() - t0 <= 1.5
        filler.close()
        listener.close()
        with pytest.raises(http11.ConnectError, match="cannot connect"):
            await http11.Pool(f"http://127.0.0.1:{port}").request("GET", "/")  # nobody listens any more

    arun(main())


def test_responses_the_client_must_cope_with(arun: Run) -> None:
    def answer(n: int, request: bytes) -> bytes | None:
        if b"/eof" in request:
            return b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end"
        if b"/big" in request:
            return b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"b" * 5000
        if b"/interim" in request:
            return b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok"
        if b"/garbage" in request:
            return b"SPDY/9 what\r\n\r\n"
        if n == 0 and b"/second" in request:
            return None  # a pooled keep-alive connection the server closes as the request arrives
        return b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nhi"

    async def main() -> None:
        server, conns = await raw_server(answer)
        pool = http11.Pool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        r = await pool.request("GET", "/first")
        assert await r.read() == b"hi" and len(pool._idle) == 1
        r = await pool.request("POST", "/second", b"{}")  # retried once on a new connection
        assert (r.status, await r.read(), conns) == (200, b"hi", [0, 1])
        r = await pool.request("GET", "/eof")
        assert (await r.read(), r.complete) == (b"until the end", True)
        r = await pool.request("GET", "/interim")
        assert (r.status, await r.read()) == (201, b"ok")
        r = await pool.request("GET", "/big")
        with pytest.raises(http11.TooLarge):
            await r.read(max_bytes=4096)
        with pytest.raises(http11.ProtocolError):
            await pool.request("GET", "/garbage")
        with pytest.raises(ValueError):
            await pool.request("GET", "/", headers=[("x-evil", "a\r\nx-injected: 1")])
        await pool.close()
        server.close()

    arun(main())


def test_server_close_cancels_running_handlers(arun: Run) -> None:
    cancelled = asyncio.Event()

    async def forever(request: Any, reply: Any) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    async def main() -> None:
        server = await serve(forever)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n")
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        await server.aclose()
        assert cancelled.is_set() and time.monotonic() - t0 < 1
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()

    arun(main())
