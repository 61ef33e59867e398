"""Admission of side-channel connections: accept, challenge, and read each one's first message on one thread.

A receiver must stay reachable whatever arrives at its port. So, before a peer has sent a complete HELLO
(and proved the shared secret, when one is set), it costs the receiver no thread and little memory:

* one thread accepts and multiplexes every connection still in its handshake (``selectors``); a transient
  accept error (EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, ...) is logged (rate-limited) and accepting
  pauses, backing off from 1 ms to 1 s, while the connections already admitted are served;
* a connection may announce a first message (HELLO) of at most ``max_hello_bytes``, buffers only what it
  actually sent, and must complete it within ``preauth_timeout``; at most ``max_pending`` connections wait at
  once (the oldest goes first when more come) and together they may buffer ``max_pending_bytes`` (the
  largest goes first);
* the complete message goes to ``on_hello`` on this thread; it returns ``True`` when it took the connection
  (its owner starts a handshake thread), ``False`` when it is busy (the connection waits, bounded by its
  deadline, and is offered again), or closes it itself and returns ``None``.

The protocol is the caller's: ``greet()`` gives a fresh nonce and the bytes to send on connect (the
challenge), ``message_length(header)`` reads the payload length from a ``header_size``-byte header (raising
any exception for a header it refuses). The kvtransport core and the vLLM connector's scheduler side channel
both admit their connections this way. Thread-safe ``close``; never blocks longer than a poll interval.
"""

from __future__ import annotations

import collections
import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvtransport")

MAX_HELLO_BYTES = 9 << 20
"""The largest HELLO an unauthenticated peer may announce (metadata of at most 4 MiB, JSON-escaped twice)."""
MAX_PENDING = 256
"""Connections in their handshake at once; one more pushes the oldest out."""
MAX_PENDING_BYTES = 64 << 20
"""Bytes all connections in their handshake may hold together; past it the largest is dropped."""
READ_CHUNK = 256 << 10
ACCEPT_BACKOFF_S = (0.001, 1.0)
"""A failed accept pauses accepting this long, doubling per consecutive failure up to the second value."""


class RateLimitedLog:
    """Logs the first message of each key at once, then at most one per ``interval`` seconds with how many
    were suppressed (a peer or a library that fails in a loop must not flood the log)."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(key, (-1e9, 0))
            if now - last < self.interval:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
            while len(self._last) > 1024:  # bounded: forget the oldest keys
                self._last.pop(next(iter(self._last)))
        if suppressed:
            msg += f" ({suppressed} more like it in the last {self.interval:g}s)"
        self.logger.log(level, msg, *args)


@dataclass
class PendingHello:
    """A connection that completed its first message (handed to ``on_hello``; the socket is non-blocking)."""

    sock: socket.socket
    label: str
    nonce: bytes
    payload: bytes
    """The message without its header."""
    leftover: bytes = b""
    """Bytes that arrived after the message (they belong to the connection's next ones)."""


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    label: str
    nonce: bytes
    accepted: float
    deadline: float
    need: int
    buf: bytearray = field(default_factory=bytearray)
    header_done: bool = False


@dataclass
class AdmissionStats:
    accepted: int = 0
    handed_off: int = 0
    dropped_slow: int = 0
    dropped_crowded: int = 0
    dropped_bad: int = 0
    accept_errors: int = 0


class Admission:
    """See the module docstring. ``server`` is a listening socket."""

    def __init__(self, server: socket.socket, *, greet: Callable[[], tuple[bytes, bytes]], header_size: int,
                 message_length: Callable[[bytes], int], on_hello: Callable[[PendingHello], bool | None],
                 preauth_timeout: float, max_hello_bytes: int = MAX_HELLO_BYTES, max_pending: int = MAX_PENDING,
                 max_pending_bytes: int = MAX_PENDING_BYTES, name: str = "kvt-accept") -> None:
        self.server = server
        self.greet = greet
        self.header_size = header_size
        self.message_length = message_length
        self.on_hello = on_hello
        self.preauth_timeout = preauth_timeout
        self.max_hello_bytes = max_hello_bytes
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.stats = AdmissionStats()
        self.logs = RateLimitedLog(log)
        self._pending: dict[int, _Conn] = {}  # fd -> connection still reading its HELLO
        self._ready: collections.deque[tuple[_Conn, PendingHello]] = collections.deque()  # waiting for on_hello
        self._buffered = 0
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        server.setblocking(False)
        self._sel.register(server, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accepting = True
        self._backoff = 0.0
        self._resume_at = 0.0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def pending(self) -> int:
        """Connections in their handshake now (reading, or waiting for a handshake thread)."""
        return len(self._pending) + len(self._ready)

    def close(self) -> None:
        """Stop accepting and drop every connection still in its handshake. Idempotent; never blocks long."""
        if self._closed:
            return
        self._closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(2.0)

    # ---------------------------------------------------------------- the loop
    def _run(self) -> None:
        try:
            while not self._closed:
                try:
                    self._step()
                except Exception as exc:  # never let the loop die: the receiver would go deaf for good
                    self.logs.log(logging.ERROR, "loop", "kvtransport: side-channel admission error (%s: %s); "
                                  "going on", type(exc).__name__, exc)
                    time.sleep(0.01)
        finally:
            for conn in list(self._pending.values()):
                self._drop(conn)
            while self._ready:
                self._drop(self._ready.popleft()[0])
            self._sel.close()
            for s in (self._wake_r, self._wake_w):
                s.close()

    def _step(self) -> None:
        now = time.monotonic()
        timeout = 0.05 if self._ready else 1.0
        deadlines = [c.deadline for c in self._pending.values()] + [c.deadline for c, _ in self._ready]
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - now))
        if not self._accepting:
            timeout = min(timeout, max(0.0, self._resume_at - now))
        for key, _ in self._sel.select(timeout):
            if key.data is None:
                self._accept_some()
            elif key.data == "wake":
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            else:
                self._read(key.data)
        now = time.monotonic()
        if not self._accepting and now >= self._resume_at and not self._closed:
            self._sel.register(self.server, selectors.EVENT_READ, None)
            self._accepting = True
        for conn in [c for c in self._pending.values() if c.deadline <= now]:
            self.stats.dropped_slow += 1
            self._drop(conn)
        self._offer_ready(now)

    def _accept_some(self) -> None:
        for _ in range(64):  # bounded: the connections already admitted are served in between
            try:
                raw, addr = self.server.accept()
            except (BlockingIOError, InterruptedError):
                self._backoff = 0.0
                return
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL):
                    self._closed = True
                    return
                self._pause(exc)
                return
            self._backoff = 0.0
            self._admit(raw, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))

    def _pause(self, exc: OSError) -> None:
        """A transient accept error: stop accepting for a while (the kernel keeps completing connections in
        its backlog; they are accepted once we resume), keep serving the others."""
        self.stats.accept_errors += 1
        lo, hi = ACCEPT_BACKOFF_S
        self._backoff = min(hi, max(lo, 2 * self._backoff))
        self._resume_at = time.monotonic() + self._backoff
        if self._accepting:
            self._sel.unregister(self.server)
            self._accepting = False
        self.logs.log(logging.WARNING, f"accept-{exc.errno}", "kvtransport: accepting a side-channel connection "
                      "failed (%s); retrying in %.3gs", exc.strerror or exc, self._backoff)

    def _admit(self, raw: socket.socket, label: str) -> None:
        self.stats.accepted += 1
        while len(self._pending) + len(self._ready) >= self.max_pending:  # crowded: the oldest goes
            oldest = min(list(self._pending.values()) + [c for c, _ in self._ready], key=lambda c: c.accepted)
            self.stats.dropped_crowded += 1
            self._ready = collections.deque(item for item in self._ready if item[0] is not oldest)
            self._drop(oldest)
        now = time.monotonic()
        nonce, challenge = self.greet()
        conn = _Conn(raw, label, nonce, now, now + self.preauth_timeout, self.header_size)
        try:
            raw.setblocking(False)
            if raw.family in (socket.AF_INET, socket.AF_INET6):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if raw.send(challenge) != len(challenge):  # a fresh socket's buffer takes it whole
                raise OSError("short send")
            self._sel.register(raw, selectors.EVENT_READ, conn)
        except OSError:
            raw.close()
            return
        self._pending[raw.fileno()] = conn

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(min(READ_CHUNK, max(1, conn.need - len(conn.buf))))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        conn.buf += data
        self._buffered += len(data)
        if not conn.header_done and len(conn.buf) >= self.header_size:
            try:
                length = self.message_length(bytes(conn.buf[: self.header_size]))
            except Exception as exc:  # the caller's protocol refuses the header
                self._bad(conn, str(exc))
                return
            if length > self.max_hello_bytes:
                self._bad(conn, f"a first message of {length} bytes announced (at most {self.max_hello_bytes} "
                                "before the handshake)")
                return
            conn.header_done = True
            conn.need = self.header_size + length
        if len(conn.buf) >= conn.need:
            self._complete(conn)
        elif self._buffered > self.max_pending_bytes:
            largest = max(self._pending.values(), key=lambda c: len(c.buf))
            self.stats.dropped_crowded += 1
            self._drop(largest)

    def _bad(self, conn: _Conn, why: str) -> None:
        self.stats.dropped_bad += 1
        self.logs.log(logging.INFO, "bad", "kvtransport: side-channel connection from %s dropped: %s", conn.label, why)
        self._drop(conn)

    def _complete(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        del self._pending[conn.sock.fileno()]
        self._buffered -= len(conn.buf)
        data = bytes(conn.buf)
        conn.buf = bytearray()
        hello = PendingHello(conn.sock, conn.label, conn.nonce, data[self.header_size : conn.need], data[conn.need :])
        self._ready.append((conn, hello))
        self._offer_ready(time.monotonic())

    def _offer_ready(self, now: float) -> None:
        keep: collections.deque[tuple[_Conn, PendingHello]] = collections.deque()
        while self._ready:
            conn, hello = self._ready.popleft()
            if conn.deadline <= now:
                self.stats.dropped_slow += 1
                self._drop(conn)
                continue
            try:
                taken = self.on_hello(hello)
            except Exception as exc:
                self.logs.log(logging.ERROR, "on_hello", "kvtransport: handshake of %s failed: %s: %s", conn.label,
                              type(exc).__name__, exc)
                taken = None
                self._drop(conn)
            if taken is False:
                keep.append((conn, hello))
            elif taken:
                self.stats.handed_off += 1
        self._ready = keep

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0 and self._pending.get(fd) is conn:
            del self._pending[fd]
            self._buffered -= len(conn.buf)
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.buf = bytearray()
        try:
            conn.sock.close()
        except OSError:
            pass


__all__ = ["MAX_HELLO_BYTES", "MAX_PENDING", "MAX_PENDING_BYTES", "Admission", "PendingHello", "RateLimitedLog"]
