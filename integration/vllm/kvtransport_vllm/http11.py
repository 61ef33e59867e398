"""A small HTTP/1.1 server and keep-alive client over asyncio and httptools, for :mod:`.proxy`.

Only what a P/D proxy needs, kept lean on the hot path (one task per request, no per-request objects beyond the
request, its reply and the upstream response; timeouts are loop timers, not ``wait_for`` tasks):

Server (:class:`Server`): an asyncio Protocol per connection parsing with ``httptools.HttpRequestParser``;
keep-alive and pipelining (requests of one connection are answered in order); ``content-length`` and chunked
request bodies; every length bounded (the request head by ``max_head_bytes``, answered 431; the body by
``max_body_bytes``, answered 413: the excess is read and dropped, never buffered, then the connection closes); an
idle timeout between requests and a read timeout while a request arrives. The handler,
``async def handler(request: Request, reply: Reply) -> None``, answers whole (:meth:`Reply.send`, with
``content-length``) or streamed (:meth:`Reply.start`, :meth:`Reply.write`, :meth:`Reply.end`, chunked) with write
backpressure (``write`` waits while the transport's buffer is over its high-water mark). When the client goes
away the handler's task is cancelled (and :attr:`Reply.disconnected` is set), so it can cancel upstream work in
``finally``.

Client (:class:`Pool`): one pool of keep-alive connections per upstream (``http://host:port``; no TLS). A
request is written at once (:meth:`Pool.open`, no suspension when an idle connection is pooled); its response
head is awaited with :meth:`ClientResponse.head`; the body is read whole (:meth:`ClientResponse.read`, bounded) or
streamed as decoded chunks (``async for chunk in response``; the socket stops being read while more than
``STREAM_HIGH_WATER`` bytes wait for the consumer). Connecting, the head and each read are bounded by timeouts
(None: unbounded, for the streamed body of a long generation). Closing a response before its end closes its
connection (how the proxy aborts an upstream request); a response read to its end on a keep-alive connection
returns the connection to the pool. A pooled connection that the server closed before answering is retried once
on a new connection (the server saw no request on it).

Errors are :class:`HTTPError` subclasses: :class:`ConnectError` (:class:`ConnectTimeout`), :class:`ReadTimeout`,
:class:`ConnectionClosed` (:class:`ClientDisconnected` on the server side), :class:`ProtocolError`,
:class:`TooLarge`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import http
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Literal, cast
from urllib.parse import urlsplit

import httptools  # type: ignore[import-not-found, unused-ignore]

log = logging.getLogger("kvtransport.http11")

MAX_HEAD_BYTES = 64 * 1024
"""Default bound on a request or response head (request line or status line and headers)."""
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Default bound on a request body (server) and on a response body read whole (client)."""
STREAM_HIGH_WATER = 1024 * 1024
"""A streamed response's socket is not read while more than this many body bytes wait for the consumer."""
LINGER_S = 1.0
"""After answering an over-limit request, the server reads and drops what the client still sends this long
before it closes (closing with unread data would reset the connection, and the client could miss the answer)."""


class HTTPError(Exception):
    """Base of every error raised by this module."""


class ConnectError(HTTPError):
    """Could not connect to the upstream (refused, unreachable, or the pool is closed)."""


class ConnectTimeout(ConnectError):
    """Connecting took longer than the connect timeout."""


class ReadTimeout(HTTPError):
    """The response head, or the next bytes of its body, did not come within the timeout."""


class ConnectionClosed(HTTPError):
    """The peer closed the connection before the message ended."""


class ClientDisconnected(ConnectionClosed):
    """Server side: the client went away before the reply was written."""


class ProtocolError(HTTPError):
    """The peer sent something that is not HTTP/1.1 as this module speaks it."""


class TooLarge(HTTPError):
    """A bounded length (head or body) was exceeded."""


class _Default(enum.Enum):
    DEFAULT = 0


DEFAULT: Literal[_Default.DEFAULT] = _Default.DEFAULT
"""Stands for "the pool's setting" in per-request arguments (where None means "no bound")."""
Timeout = float | None | Literal[_Default.DEFAULT]


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode("latin-1"))


_STATUS_LINES = {s.value: _status_line(s.value) for s in http.HTTPStatus}


def _check_header(name: str, value: str) -> None:
    if any(c in name for c in "\r\n:") or "\r" in value or "\n" in value:
        raise ValueError(f"invalid header {name!r}")


def _headers_bytes(headers: Iterable[tuple[str, str]]) -> bytes:
    out = []
    for name, value in headers:
        _check_header(name, value)
        out.append(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1")))
    return b"".join(out)


def _set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ------------------------------------------------------------------------------------------------- server
class Request:
    """One parsed request. ``headers``: lower-case names (a repeated header keeps its last value)."""

    __slots__ = ("body", "headers", "keep_alive", "method", "path", "target", "version")

    def __init__(self, method: str, target: str, headers: dict[str, str], body: bytes, keep_alive: bool,
                 version: str) -> None:
        self.method = method
        self.target = target  # as sent, query included
        self.path = target.split("?", 1)[0]
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.version = version


Handler = Callable[[Request, "Reply"], Awaitable[None]]


class Reply:
    """The answer to one request: whole (:meth:`send`) or streamed (:meth:`start`, :meth:`write`, :meth:`end`)."""

    __slots__ = ("_chunked", "_conn", "_head", "_keep_alive", "aborted", "finished", "started", "status")

    def __init__(self, conn: _ServerConnection, keep_alive: bool, chunked: bool) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._chunked = chunked  # False for an HTTP/1.0 client: a streamed body ends with the connection
        self._head = b""
        self.started = False  # the status line is decided (sent or waiting for the first chunk)
        self.finished = False  # the whole reply is written (or cut short: ``aborted``)
        self.aborted = False
        self.status = 0  # once started

    @property
    def disconnected(self) -> bool:
        """Whether the client went away."""
        return self._conn.lost

    @property
    def write_buffer_size(self) -> int:
        """Bytes written but not yet taken by the socket."""
        t = self._conn.transport
        return t.get_write_buffer_size() if t is not None and not self._conn.lost else 0

    def _head_bytes(self, status: int, content_type: str | None, headers: Iterable[tuple[str, str]] | None) -> bytes:
        head = _STATUS_LINES.get(status) or _status_line(status)
        if content_type:
            head += b"content-type: %s\r\n" % content_type.encode("latin-1")
        if headers:
            head += _headers_bytes(headers)
        if not self._keep_alive:
            head += b"connection: close\r\n"
        return head

    def send(self, status: int, body: bytes = b"", content_type: str | None = "application/json",
             headers: Iterable[tuple[str, str]] | None = None) -> None:
        """The whole reply at once (``content-length``)."""
        if self.started:
            raise RuntimeError("reply already started")
        self.started = self.finished = True
        self.status = status
        head = self._head_bytes(status, content_type, headers) + b"content-length: %d\r\n\r\n" % len(body)
        if len(body) <= 65536:
            self._conn.write(head + body)
        else:  # no copy of a large body
            self._conn.write(head)
            self._conn.write(body)

    def start(self, status: int, content_type: str | None = "text/event-stream",
              headers: Iterable[tuple[str, str]] | None = None) -> None:
        """Begin a streamed reply (chunked). The head goes out with the first chunk, in one write."""
        if self.started:
            raise RuntimeError("reply already started")
        self.started, self.status = True, status
        self._head = self._head_bytes(status, content_type, headers)
        self._head += b"transfer-encoding: chunked\r\n\r\n" if self._chunked else b"\r\n"

    async def write(self, data: bytes) -> None:
        """One chunk of a streamed reply; waits while the client is slower than the writes. Raises
        :class:`ClientDisconnected` when the client went away."""
        conn = self._conn
        if conn.lost:
            raise ClientDisconnected("the client went away")
        if not self.started or self.finished:
            raise RuntimeError("write() outside start() ... end()")
        if not data:
            return
        frame = b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data
        if self._head:
            frame, self._head = self._head + frame, b""
        conn.write(frame)
        if conn.write_paused:
            await conn.drain()

    def end(self) -> None:
        """End a streamed reply."""
        if self.finished:
            return
        if not self.started:
            raise RuntimeError("end() before start()")
        self.finished = True
        self._conn.write(self._head + (b"0\r\n\r\n" if self._chunked else b""))
        self._head = b""
        if not self._chunked:
            self._keep_alive = False
            self._conn.close_after_reply()

    def abort(self) -> None:
        """Cut the reply short: the connection closes (the client sees a truncated body)."""
        self.finished = self.aborted = True
        self._conn.abort()


class _Reject:
    """A request refused while it was arriving (too large, malformed): answered in turn, then the connection
    closes."""

    __slots__ = ("body", "status")

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body = status, body


class _StopParsing(Exception):
    pass


class _ServerConnection(asyncio.Protocol):
    """One client connection of a :class:`Server`."""

    def __init__(self, server: Server) -> None:
        assert server.loop is not None
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.lost = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_len = 0
        self._head_len = 0
        self._in_request = False  # part of a request has arrived
        self._queue: deque[Request | _Reject] = deque()  # pipelined requests waiting for the current one
        self._task: asyncio.Task[None] | None = None
        self._discarding = False  # a refused request: what the client still sends is dropped
        self._closing = False  # no request after the current one
        self._reading_paused = False
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0

    # -------------------------------------------------------------- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        _set_nodelay(transport)
        self.server.connections.add(self)
        self.server.accepted += 1
        self._last = self.loop.time()
        self._arm(self.server.idle_timeout)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        self._last = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if not self._discarding:  # an error of ours in a callback
                log.exception("http11: request parsing failed")
                self._refuse(400, b'{"error": "bad request"}')
        except httptools.HttpParserUpgrade:
            self._refuse(400, b'{"error": "protocol upgrade is not supported"}')
        except httptools.HttpParserError as exc:
            self._refuse(400, b'{"error": "malformed HTTP request: %s"}' % str(exc).encode("latin-1", "replace")
                         .replace(b'"', b"'"))

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ClientDisconnected("the client went away"))
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the handler learns of it (CancelledError) and cancels its upstream work

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_len = self._head_len = 0
        self._in_request = True
        read_timeout = self.server.read_timeout
        if read_timeout is not None and (self._timer is None or self._timer_due > self._last + read_timeout):
            self._arm(read_timeout)

    def on_url(self, url: bytes) -> None:
        self._head_len += len(url)
        if self._head_len > self.server.max_head_bytes:
            self._stop(431, b'{"error": "request head too large"}')
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_len += len(name) + len(value) + 4
        if self._head_len > self.server.max_head_bytes:
            self._stop(431, b'{"error": "request head too large"}')
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._stop(413, b'{"error": "request body larger than %d bytes"}' % self.server.max_body_bytes)
        if self._headers.get("expect", "").lower() == "100-continue" and self._task is None and not self._queue:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self.server.max_body_bytes:
            self._body = []
            self._stop(413, b'{"error": "request body larger than %d bytes"}' % self.server.max_body_bytes)
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_request = False
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        keep_alive = bool(self.parser.should_keep_alive())
        request = Request(self.parser.get_method().decode("latin-1"), self._url.decode("latin-1"), self._headers,
                          body, keep_alive, self.parser.get_http_version())
        if not keep_alive:
            self._closing = True
        if self._task is None and not self._queue:
            self._dispatch(request)
        else:
            self._queue.append(request)
            self._pause_reading()

    # -------------------------------------------------------------- internals
    def _stop(self, status: int, body: bytes) -> None:
        """Refuse the request being parsed: drop the rest of what the client sends; answer once the requests
        before it are answered; then close."""
        self._refuse(status, body)
        raise _StopParsing

    def _refuse(self, status: int, body: bytes) -> None:
        self._discarding = self._closing = True
        self._in_request = False
        self._body = []
        reject = _Reject(status, body)
        if self._task is None and not self._queue:
            self._dispatch(reject)
        else:
            self._queue.append(reject)

    def _dispatch(self, item: Request | _Reject) -> None:
        if isinstance(item, _Reject):
            self.server.refused[item.status] = self.server.refused.get(item.status, 0) + 1
            self.write(_STATUS_LINES.get(item.status, _status_line(item.status))
                       + b"content-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                       % len(item.body) + item.body)
            self._linger()
            return
        reply = Reply(self, item.keep_alive and not self._closing, item.version != "1.0")
        self._task = self.loop.create_task(self._run(item, reply))

    async def _run(self, request: Request, reply: Reply) -> None:
        try:
            await self.server.handler(request, reply)
        except asyncio.CancelledError:
            if not self.lost:  # the server is shutting down
                reply.abort()
            return
        except ClientDisconnected:
            return
        except Exception:
            log.exception("http11: handler failed on %s %s", request.method, request.target)
            if not reply.started:
                reply.send(500, b'{"error": "internal error"}')
            else:
                reply.abort()
        else:
            if not reply.started:
                log.error("http11: handler sent no reply to %s %s", request.method, request.target)
                reply.send(500, b'{"error": "no reply"}')
            elif not reply.finished:
                reply.end()
        finally:
            self._task = None
            self._next()

    def _next(self) -> None:
        """The current reply is done: the next pipelined request, or wait for one."""
        if self.lost or self.transport is None:
            return
        if self._queue:
            self._dispatch(self._queue.popleft())
            return
        if self._closing and not self._discarding:
            self.transport.close()
            return
        if self._discarding:
            return
        if self._reading_paused:
            self._reading_paused = False
            self.transport.resume_reading()
        self._last = self.loop.time()
        self._arm(self.server.read_timeout if self._in_request else self.server.idle_timeout)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.lost:
            self._reading_paused = True
            self.transport.pause_reading()

    def _linger(self) -> None:
        """After a refusal: no more writes; read and drop until the client closes or LINGER_S passes."""
        t = self.transport
        if t is None or self.lost:
            return
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        if t.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                t.write_eof()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(LINGER_S, t.close)

    def _arm(self, timeout: float | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if timeout is None:
            return
        self._timer_due = self._last + timeout
        self._timer = self.loop.call_at(self._timer_due, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.lost or self.transport is None or self._task is not None or self._discarding:
            return  # a handler is running: the timer is armed again when it is done
        timeout = self.server.read_timeout if self._in_request else self.server.idle_timeout
        if timeout is None:
            return
        due = self._last + timeout
        if self.loop.time() >= due:
            self.transport.close()
        else:
            self._timer_due = due
            self._timer = self.loop.call_at(due, self._on_timer)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.lost:
            raise ClientDisconnected("the client went away")
        if not self.write_paused:
            return
        waiter = self.loop.create_future()
        self._drain_waiter = waiter
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def close_after_reply(self) -> None:
        self._closing = True

    def abort(self) -> None:
        self._closing = True
        if self.transport is not None and not self.lost:
            self.transport.close()


class Server:
    """An HTTP/1.1 server calling ``handler(request, reply)`` for every request (see the module docstring)."""

    def __init__(self, handler: Handler, *, max_head_bytes: int = MAX_HEAD_BYTES,
                 max_body_bytes: int = MAX_BODY_BYTES, idle_timeout: float | None = 75.0,
                 read_timeout: float | None = 30.0) -> None:
        """``idle_timeout``: how long a keep-alive connection may wait for its next request; ``read_timeout``: how
        long a request may pause while it arrives (None: no bound)."""
        self.handler = handler
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self.connections: set[_ServerConnection] = set()
        self.accepted = 0  # connections accepted so far
        self.refused: dict[int, int] = {}  # requests refused while they arrived (413, 431, 400), by status
        self._server: asyncio.Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by start()

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, backlog: int = 1024) -> Server:
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _ServerConnection(self), host, port, backlog=backlog,
                                                     reuse_address=True)
        return self

    @property
    def port(self) -> int:
        """The port listened on (the one picked, for port 0)."""
        assert self._server is not None and self._server.sockets, "not started"
        return int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        """Stop listening, end every connection (a running handler is cancelled) and wait for the handlers."""
        if self._server is not None:
            self._server.close()
        tasks = []
        for conn in list(self.connections):
            if conn._task is not None:
                tasks.append(conn._task)
                conn._task.cancel()
            if conn.transport is not None:
                conn.transport.close()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None


# ------------------------------------------------------------------------------------------------- client
class _ClientConnection(asyncio.Protocol):
    """One connection of a :class:`Pool`; the response being received is :attr:`resp`."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: ClientResponse | None = None
        self.closed = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not asyncio.Transport subclasses
        _set_nodelay(transport)

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        resp._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            resp._on_fail(cause if isinstance(cause, HTTPError) else ProtocolError(f"response parsing failed: {exc}"))
            self.close()
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            resp._on_fail(ProtocolError(f"malformed HTTP response from {self.pool.url}: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.resp is not None:
            self.resp._on_lost(exc)

    def pause_writing(self) -> None:
        pass  # a request is written at once; the head timeout bounds a peer that does not read it

    def resume_writing(self) -> None:
        pass

    # parser callbacks: to the response being received
    def on_message_begin(self) -> None:
        if self.resp is not None:
            self.resp._on_begin()

    def on_status(self, status: bytes) -> None:
        pass

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp._on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.resp is not None:
            self.resp._on_head(int(self.parser.get_status_code()))

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._on_body(body)

    def on_message_complete(self) -> None:
        if self.resp is not None:
            self.resp._on_complete(bool(self.parser.should_keep_alive()))

    def send(self, head: bytes, body: bytes) -> None:
        t = self.transport
        if t is None or self.closed:
            if self.resp is not None:
                self.resp._on_lost(None)
            return
        if len(body) <= 65536:
            t.write(head + body)
        else:  # no copy of a large body
            t.write(head)
            t.write(body)

    def close(self) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.close()


class ClientResponse:
    """The response to one request of a :class:`Pool` (see :meth:`Pool.open`)."""

    def __init__(self, pool: Pool, conn: _ClientConnection, request: tuple[bytes, bytes], reused: bool,
                 head_timeout: float | None, read_timeout: float | None) -> None:
        self.pool = pool
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_timeout = head_timeout
        self.read_timeout = read_timeout
        self._got_bytes = False  # of the response, on this connection
        self._conn = conn
        self._request: tuple[bytes, bytes] | None = request  # kept for one retry on a stale pooled connection
        self._reused = reused
        self._loop = asyncio.get_running_loop()
        self._head_len = 0
        self._head_done = False
        self._done = False
        self._keep_alive = False
        self._until_eof = False
        self._error: HTTPError | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False  # flow control: the consumer is behind
        self._waiter: asyncio.Future[None] | None = None
        self._released = False

    # ------------------------------------------------------------- connection side
    def _on_begin(self) -> None:
        self._head_len = 0
        self.headers = {}

    def _on_header(self, name: bytes, value: bytes) -> None:
        self._head_len += len(name) + len(value) + 4
        if self._head_len > self.pool.max_head_bytes:
            raise TooLarge(f"response head from {self.pool.url} larger than {self.pool.max_head_bytes} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def _on_head(self, status: int) -> None:
        if 100 <= status < 200:
            return  # an interim response (100 Continue): its message completes, the real one follows
        self.status = status
        self._head_done = True
        self._request = None
        self._until_eof = ("content-length" not in self.headers
                           and "chunked" not in self.headers.get("transfer-encoding", "").lower()
                           and status not in (204, 304))
        self._wake()

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > STREAM_HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _on_complete(self, keep_alive: bool) -> None:
        if not self._head_done:
            return  # the end of an interim response
        self._done = True
        self._keep_alive = keep_alive and not self._until_eof
        self._wake()

    def _on_lost(self, exc: Exception | None) -> None:
        if self._done:
            return
        if self._head_done and self._until_eof and exc is None:
            self._done = True  # a body delimited by the end of the connection
        elif self._error is None:
            why = f": {exc}" if exc else ""
            self._error = ConnectionClosed(f"{self.pool.url} closed the connection before the response ended{why}")
        self._wake()

    def _on_fail(self, error: HTTPError) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------- user side
    async def _wait(self, timeout: float | None, what: str) -> None:
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_later(timeout, _expire, waiter, what, self.pool.url, timeout) \
            if timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def head(self) -> ClientResponse:
        """Wait for the status and headers (``head_timeout``). On any error the connection is closed."""
        try:
            while not self._head_done:
                if self._error is not None:
                    if isinstance(self._error, ConnectionClosed) and self._reused and not self._got_bytes \
                            and self._request is not None and not self._released:
                        await self._retry()
                        continue
                    raise self._error
                await self._wait(self.head_timeout, "response head")
        except BaseException:
            self.close()
            raise
        return self

    async def _retry(self) -> None:
        """The pooled connection was closed by the server before it answered (an idle keep-alive connection
        it timed out as we wrote): send the request once more on a new connection."""
        assert self._request is not None
        log.debug("http11: %s closed a pooled connection before answering; retrying on a new one", self.pool.url)
        conn = await self.pool._connect()
        self._conn, self._reused, self._error, self._got_bytes = conn, False, None, False
        conn.resp = self
        conn.send(*self._request)

    def __aiter__(self) -> ClientResponse:
        return self

    async def __anext__(self) -> bytes:
        """The next decoded piece of the body (as the parser hands it out); ``read_timeout`` per wait."""
        while True:
            if self._chunks:
                data = self._chunks.popleft()
                self._buffered -= len(data)
                if self._paused and self._buffered <= STREAM_HIGH_WATER // 2:
                    self._paused = False
                    if self._conn.transport is not None and not self._conn.closed:
                        self._conn.transport.resume_reading()
                return data
            if self._error is not None:
                self.close()
                raise self._error
            if self._done:
                self._release()
                raise StopAsyncIteration
            if not self._head_done:
                await self.head()
                continue
            try:
                await self._wait(self.read_timeout, "response body")
            except BaseException:
                self.close()
                raise

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body (at most ``max_bytes``, default the pool's ``max_body_bytes``: more raises
        :class:`TooLarge` and closes the connection)."""
        limit = self.pool.max_body_bytes if max_bytes is None else max_bytes
        parts = []
        total = 0
        async for data in self:
            total += len(data)
            if total > limit:
                self.close()
                raise TooLarge(f"response body from {self.pool.url} larger than {limit} bytes")
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def fail(self, error: HTTPError) -> None:
        """Abandon this response for ``error``: its connection closes (the upstream request is aborted) and its
        reader raises ``error`` (after what was already buffered)."""
        if not self._released and not self._done:
            self._on_fail(error)
            self._conn.close()

    @property
    def complete(self) -> bool:
        """Whether the whole response has arrived."""
        return self._done

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        if conn.resp is self:
            conn.resp = None
        if self._done and self._error is None and self._keep_alive and not conn.closed and not self._chunks:
            self.pool._put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Done with this response: its connection goes back to the pool when the response was complete and
        keep-alive, else it is closed (which aborts the request on the upstream)."""
        if self._released:
            return
        self._chunks.clear()
        self._buffered = 0
        if not self._done or self._error is not None:
            self._released = True
            conn = self._conn
            if conn.resp is self:
                conn.resp = None
            conn.close()
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_exception(ConnectionClosed("response closed"))
            return
        self._release()

    async def __aenter__(self) -> ClientResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def _expire(waiter: asyncio.Future[None], what: str, url: str, timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout(f"no {what} from {url} within {timeout:g} s"))


class Pool:
    """Keep-alive connections to one upstream, ``http://host:port[/prefix]`` (see the module docstring)."""

    def __init__(self, url: str, *, connect_timeout: float = 10.0, head_timeout: float | None = None,
                 read_timeout: float | None = None, idle_timeout: float = 4.0, max_idle: int = 64,
                 max_head_bytes: int = MAX_HEAD_BYTES, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        """``head_timeout`` / ``read_timeout``: defaults of :meth:`open` (None: no bound). ``idle_timeout``: a
        pooled connection idle longer is not reused (below the usual 5 s keep-alive of uvicorn, vLLM's server).
        ``max_idle``: connections kept idle at most."""
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http://host[:port] URLs are supported, got {url!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self.max_idle = max_idle
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = max_body_bytes
        self._host_line = b"host: %s\r\n" % parts.netloc.encode("idna")
        self._idle: list[_ClientConnection] = []
        self._closed = False
        self.connects = 0  # connections opened so far

    async def _connect(self) -> _ClientConnection:
        if self._closed:
            raise ConnectError(f"pool for {self.url} is closed")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _ClientConnection(self), self.host,
                                                                    self.port), self.connect_timeout)
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {self.url} took more than {self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {self.url}: {exc}") from None
        self.connects += 1
        return conn

    def _take(self) -> _ClientConnection | None:
        idle = self._idle
        if not idle:
            return None
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since <= self.idle_timeout:
                return conn
            conn.close()
        return None

    def _put(self, conn: _ClientConnection) -> None:
        if self._closed or len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _forget(self, conn: _ClientConnection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def encode(self, method: str, path: str, body: bytes = b"",
               headers: Iterable[tuple[str, str]] = ()) -> tuple[bytes, bytes]:
        """The request's head and body as written."""
        head = b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), (self.prefix + path).encode("ascii")) + self._host_line
        if body or method not in ("GET", "HEAD"):
            head += b"content-length: %d\r\n" % len(body)
        return head + _headers_bytes(headers) + b"\r\n", body

    async def open(self, method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = (), *,
                   head_timeout: Timeout = DEFAULT, read_timeout: Timeout = DEFAULT) -> ClientResponse:
        """Write a request now (on a pooled connection when one is idle, without suspending) and return its
        response, whose head is not awaited yet (:meth:`ClientResponse.head`). Raises :class:`ConnectError`."""
        request = self.encode(method, path, body, headers)
        conn = self._take()
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        resp = ClientResponse(self, conn, request, reused,
                              self.head_timeout if head_timeout is DEFAULT else head_timeout,
                              self.read_timeout if read_timeout is DEFAULT else read_timeout)
        conn.resp = resp
        conn.send(*request)
        return resp

    async def request(self, method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = (), *,
                      head_timeout: Timeout = DEFAULT, read_timeout: Timeout = DEFAULT) -> ClientResponse:
        """:meth:`open` and wait for the response head."""
        resp = await self.open(method, path, body, headers, head_timeout=head_timeout, read_timeout=read_timeout)
        return await resp.head()

    async def close(self) -> None:
        """Close the idle connections; connections in use close when their response is done."""
        self._closed = True
        for conn in self._idle[:]:
            conn.close()
        self._idle.clear()


__all__ = ["DEFAULT", "LINGER_S", "MAX_BODY_BYTES", "MAX_HEAD_BYTES", "STREAM_HIGH_WATER", "ClientDisconnected",
           "ClientResponse", "ConnectError", "ConnectTimeout", "ConnectionClosed", "HTTPError", "Handler", "Pool",
           "ProtocolError", "ReadTimeout", "Reply", "Request", "Server", "Timeout", "TooLarge"]
