"""Admission of side-channel connections: accept, challenge, and read each one's first message on one thread.

A receiver must stay reachable whatever arrives at its port. So, before a peer has sent a complete HELLO
(and proved the shared secret, when one is set), it costs the receiver no thread and little memory:

* one thread accepts and multiplexes every connection still in its handshake (``selectors``); a transient
  accept error (EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, ...) is logged (rate-limited) and accepting
  pauses, backing off from 1 ms to 1 s, while the connections already admitted are served;
* a connection may announce a first message (HELLO) of at most ``max_hello_bytes``, buffers only what it
  actually sent, and must complete it within ``preauth_timeout``; at most ``max_pending`` connections wait at
  once (the oldest goes first when more come) and together they may buffer ``max_pending_bytes`` (the
  largest goes first). A message is received into anonymous memory of its own (``mmap``, grown as bytes
  arrive) that goes back to the system the moment its connection is done with: after a flood the
  receiver's memory is what it was before, whatever the allocator keeps;
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
import mmap
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
BODY_START = 16 << 10
"""A message's buffer starts this large (or at its length if smaller) and doubles as its bytes arrive."""
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
    """Bytes that arrived after the message (they belong to the connection's next ones; none so far: the
    admission never reads beyond the first message)."""


def _anonymous(size: int) -> mmap.mmap:
    """``size`` bytes of private anonymous memory (private: a shared anonymous map that grows by ``resize``
    faults with SIGBUS past its first size)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    label: str
    nonce: bytes
    accepted: float
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    """The message's header as it arrives."""
    length: int = -1
    """The message's length without its header, once the header is complete."""
    body: mmap.mmap | None = None
    """``body[:got]``: the message's bytes received so far (anonymous memory, see the module docstring)."""
    got: int = 0

    @property
    def held(self) -> int:
        """Bytes received and held (what ``max_pending_bytes`` counts)."""
        return len(self.head) + self.got

    def read_body(self, chunk: int) -> int:
        """Receive up to ``chunk`` more bytes of the message (growing ``body`` first when it is full); 0 at
        EOF. Raises what ``recv_into`` and ``mmap`` raise (BlockingIOError when nothing is there)."""
        if self.body is None or self.got == len(self.body):
            self.body = self._grown(min(self.length, max(BODY_START, 2 * self.got)))
        with memoryview(self.body) as view:
            n = self.sock.recv_into(view[self.got :], min(chunk, len(view) - self.got))
        self.got += n
        return n

    def _grown(self, size: int) -> mmap.mmap:
        """``body`` grown to ``size`` bytes (a new one when there is none), its first ``got`` bytes kept."""
        if self.body is None:
            return _anonymous(size)
        try:
            self.body.resize(size)  # (mremap: the pages move, nothing is copied)
            return self.body
        except (OSError, SystemError, ValueError, TypeError):  # no mremap here: a new map and a copy
            body = _anonymous(size)
            body[: self.got] = self.body[: self.got]
            self.body.close()
            return body

    def release(self) -> None:
        """Give the buffers back (the body's memory to the system at once). Idempotent."""
        if self.body is not None:
            self.body.close()
            self.body = None
        self.head = bytearray()
        self.got = 0


@dataclass
class AdmissionStats:
    """Counters of one Admission. Each is bumped after the state change it counts (an observer that sees the
    count also sees the change: the connection gone, or the new one pending)."""

    accepted: int = 0
    handed_off: int = 0
    """Connections whose first message ``on_hello`` took."""
    dropped_slow: int = 0
    """Past their deadline (``preauth_timeout``) before ``on_hello`` took them."""
    dropped_crowded: int = 0
    """The oldest, when one more than ``max_pending`` waited."""
    dropped_over_budget: int = 0
    """The largest, when all together buffered more than ``max_pending_bytes``."""
    dropped_bad: int = 0
    dropped_closed: int = 0
    """Closed by the peer (or failed) before its first message was whole, our challenge unsent included."""
    refused: int = 0
    """Whole first messages that ``on_hello`` refused (returned None) or failed on."""
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
            elif (conn := self._pending.get(key.fd)) is key.data and conn is not None:
                self._read(conn)  # (not dropped earlier in this batch: crowded out or over budget)
        now = time.monotonic()
        if not self._accepting and now >= self._resume_at and not self._closed:
            self._sel.register(self.server, selectors.EVENT_READ, None)
            self._accepting = True
        for conn in [c for c in self._pending.values() if c.deadline <= now]:
            self._drop(conn)
            self.stats.dropped_slow += 1
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
            self._ready = collections.deque(item for item in self._ready if item[0] is not oldest)
            self._drop(oldest)
            self.stats.dropped_crowded += 1
        now = time.monotonic()
        nonce, challenge = self.greet()
        conn = _Conn(raw, label, nonce, now, now + self.preauth_timeout)
        try:
            raw.setblocking(False)
            if raw.family in (socket.AF_INET, socket.AF_INET6):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sel.register(raw, selectors.EVENT_READ, conn)
        except OSError:
            raw.close()
            return
        self._pending[raw.fileno()] = conn  # pending before the peer hears from us: who got the challenge sees it
        try:
            if raw.send(challenge) != len(challenge):  # a fresh socket's buffer takes it whole
                raise OSError("short send")
        except OSError:
            self._drop(conn)
            self.stats.dropped_closed += 1

    def _read(self, conn: _Conn) -> None:
        try:
            if conn.length < 0:  # the header
                data = conn.sock.recv(self.header_size - len(conn.head))
                conn.head += data
                n = len(data)
            else:
                n = conn.read_body(READ_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the socket failed, or no memory for the body
            n = 0
        if not n:
            self._drop(conn)
            self.stats.dropped_closed += 1
            return
        self._buffered += n
        if conn.length < 0 and len(conn.head) == self.header_size:
            try:
                length = self.message_length(bytes(conn.head))
            except Exception as exc:  # the caller's protocol refuses the header
                self._bad(conn, str(exc))
                return
            if not 0 <= length <= self.max_hello_bytes:
                self._bad(conn, f"a first message of {length} bytes announced (at most {self.max_hello_bytes} "
                                "before the handshake)")
                return
            conn.length = length
        if conn.got == conn.length:
            self._complete(conn)
        elif self._buffered > self.max_pending_bytes:
            largest = max(self._pending.values(), key=lambda c: c.held)
            self._drop(largest)
            self.stats.dropped_over_budget += 1

    def _bad(self, conn: _Conn, why: str) -> None:
        self._drop(conn)
        self.stats.dropped_bad += 1
        self.logs.log(logging.INFO, "bad", "kvtransport: side-channel connection from %s dropped: %s", conn.label, why)

    def _complete(self, conn: _Conn) -> None:
        self._sel.unregister(conn.sock)
        payload = conn.body[: conn.got] if conn.body is not None else b""
        self._ready.append((conn, PendingHello(conn.sock, conn.label, conn.nonce, payload)))
        del self._pending[conn.sock.fileno()]  # (after: ``pending`` never misses it)
        self._buffered -= conn.held
        conn.release()
        self._offer_ready(time.monotonic())

    def _offer_ready(self, now: float) -> None:
        """Offer each ready connection to ``on_hello`` once, oldest first. A connection stays in ``_ready``
        (counted in ``pending``) until it is taken or dropped; those the owner is too busy for stay, in order."""
        for _ in range(len(self._ready)):
            conn, hello = self._ready[0]
            if conn.deadline <= now:
                self._ready.popleft()
                self._drop(conn)
                self.stats.dropped_slow += 1
                continue
            try:
                taken = self.on_hello(hello)
            except Exception as exc:
                self.logs.log(logging.ERROR, "on_hello", "kvtransport: handshake of %s failed: %s: %s", conn.label,
                              type(exc).__name__, exc)
                taken = None
                self._drop(conn)
            if taken is False:
                self._ready.rotate(-1)  # to the back, in one step: the count never changes
                continue
            self._ready.popleft()
            if taken:
                self.stats.handed_off += 1
            else:  # refused by the owner (it closed the socket), or its check raised (dropped above)
                self.stats.refused += 1

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0 and self._pending.get(fd) is conn:
            del self._pending[fd]
            self._buffered -= conn.held
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.release()
        try:
            conn.sock.close()
        except OSError:
            pass


__all__ = ["MAX_HELLO_BYTES", "MAX_PENDING", "MAX_PENDING_BYTES", "Admission", "PendingHello", "RateLimitedLog"]
