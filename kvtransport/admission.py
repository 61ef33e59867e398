"""Admission of side-channel connections: accept, challenge, and read each one's first message on one thread.

A receiver must stay reachable whatever arrives at its port. So, before a peer has sent a complete HELLO
(and proved the shared secret, when one is set), it costs the receiver no thread and little memory:

* one thread accepts and multiplexes every connection still in its handshake (``selectors``); a transient
  accept error (EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED, ...) is logged (rate-limited) and accepting
  pauses, backing off from 1 ms to 1 s, while the connections already admitted are served;
* a connection may announce a first message (HELLO) of at most ``max_hello_bytes``, buffers only what it
  actually sent, and must complete it within ``preauth_timeout``; at most ``max_pending`` connections wait at
  once and together they may buffer ``max_pending_bytes`` (the largest goes first). A message is received
  into anonymous memory of its own (``mmap``, grown as bytes arrive) that goes back to the system the moment
  its connection is done with: after a flood the receiver's memory is what it was before, whatever the
  allocator keeps. The complete message is handed over in that memory (:attr:`PendingHello.raw`, no copy);
* fair between sources (a source: the peer's IP address). When one more connection comes than
  ``max_pending`` allow, the oldest connection *of the source that holds the most* goes: a host that floods
  crowds out only its own connections, never another host's handshake. A source may start
  ``source_burst`` handshakes at once and ``source_rate`` a second after that; a connection beyond it is
  closed (reset) the moment it is accepted, before any challenge: a flood costs an ``accept`` and a
  ``close`` each, and the listen backlog drains at that cost. (A flood faster still fills the backlog; a
  connect that finds it full waits for the kernel's retransmit, 1 s, before anything here sees its source.)
* a deadline counts the receiver's waking time only: a loop step that woke well past what it asked of
  ``select`` (the thread got no CPU) moves every deadline on by that step (``STALL_GRACE_S``), so a peer whose
  HELLO arrived in time is not dropped because this thread could not read it;
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
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

log = logging.getLogger("kvtransport")

MAX_HELLO_BYTES = 9 << 20
"""The default bound on a first message; an owner passes its protocol's own (the core's: its message_length
refuses more than ``wire.MAX_HELLO_BYTES``, where the reason is)."""
MAX_PENDING = 256
"""Connections in their handshake at once; one more pushes out the oldest of the source holding the most."""
SOURCE_BURST = 2 * MAX_PENDING
"""Handshakes one source may start at once: every pending slot, twice over (a host whose workers all dial
at start-up, a test's hundreds of idle strangers)."""
SOURCE_RATE = 2000.0
"""Handshakes a second one source may start past its burst: four times what the flood tests' strangers need
(one every 2 ms), a tenth of what this thread can accept and reset (20-27k/s measured on the 2-core VM
under a flood); a host beyond it floods, and its excess is reset unread."""
MAX_SOURCES = 4096
"""Sources whose rate is tracked; past it the one seen longest ago is forgotten (its next connect starts a
fresh burst)."""
ACCEPT_BATCH = 1024
"""Connections accepted per loop step (between two reads of the connections already admitted): a listen
backlog's worth."""
MAX_PENDING_BYTES = 64 << 20
"""Bytes all connections in their handshake may hold together; past it the largest is dropped."""
READ_CHUNK = 256 << 10
BODY_START = 16 << 10
"""A message's buffer starts this large (or at its length if smaller) and doubles as its bytes arrive."""
ACCEPT_BACKOFF_S = (0.001, 1.0)
"""A failed accept pauses accepting this long, doubling per consecutive failure up to the second value."""
STALL_GRACE_S = 0.5
"""A loop step that wakes this much later than its ``select`` timeout asked was stalled: the thread got no CPU
(a 2-core host under twelve spinning engine processes stalled it past a 10 s ``preauth_timeout``; CI, issue 27),
or its process was stopped. A stall is not the peers' time: every deadline moves on by the whole stalled step,
since the thread cannot tell when in it their bytes arrived."""


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


class PendingHello:
    """A connection that completed its first message (handed to ``on_hello``; the socket is non-blocking).
    The message stays in the anonymous memory it was received into (:attr:`raw`) until :attr:`payload`
    copies it or the last reference goes."""

    def __init__(self, sock: socket.socket, label: str, nonce: bytes, raw: mmap.mmap | bytes,
                 leftover: bytes = b"") -> None:
        self.sock = sock
        self.label = label
        self.nonce = nonce
        self._raw: mmap.mmap | bytes = raw
        self.leftover = leftover
        """Bytes that arrived after the message (they belong to the connection's next ones; none so far: the
        admission never reads beyond the first message)."""

    @property
    def raw(self) -> mmap.mmap | bytes:
        """The message without its header, where it was received (no copy): slices of it are bytes. Read it
        in ``on_hello``; do not keep it."""
        return self._raw

    @property
    def payload(self) -> bytes:
        """The message without its header, as bytes (copied once; the anonymous memory goes back then)."""
        raw = self._raw
        if isinstance(raw, mmap.mmap):
            self._raw = raw[:]
            _close_map(raw)
        return bytes(self._raw)

    def release(self) -> None:
        """Give the message's memory back now (it reads as empty afterwards). Idempotent."""
        raw, self._raw = self._raw, b""
        if isinstance(raw, mmap.mmap):
            _close_map(raw)


def _close_map(raw: mmap.mmap) -> None:
    try:
        raw.close()
    except BufferError:  # a view of it is still held: it goes with the last reference
        pass


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
    source: str = ""
    """The peer's address without its port (what fairness counts by)."""
    hello: PendingHello | None = None
    """Once the message is complete: what ``on_hello`` is offered (the connection waits in ``_ready``)."""
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
    stalls: int = 0
    """Loop steps that woke more than STALL_GRACE_S late (every deadline moved on by the step's length)."""
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
    reset_flooding: int = 0
    """Accepted and reset at once, unread and unchallenged: their source was past its rate (not in
    ``accepted``, which counts the connections admitted to a handshake)."""


class Admission:
    """See the module docstring. ``server`` is a listening socket."""

    def __init__(self, server: socket.socket, *, greet: Callable[[], tuple[bytes, bytes]], header_size: int,
                 message_length: Callable[[bytes], int], on_hello: Callable[[PendingHello], bool | None],
                 preauth_timeout: float, max_hello_bytes: int = MAX_HELLO_BYTES, max_pending: int = MAX_PENDING,
                 max_pending_bytes: int = MAX_PENDING_BYTES, source_burst: int = SOURCE_BURST,
                 source_rate: float = SOURCE_RATE, name: str = "kvt-accept") -> None:
        self.server = server
        self.greet = greet
        self.header_size = header_size
        self.message_length = message_length
        self.on_hello = on_hello
        self.preauth_timeout = preauth_timeout
        self.max_hello_bytes = max_hello_bytes
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.source_burst = source_burst
        self.source_rate = source_rate
        self.stats = AdmissionStats()
        self.logs = RateLimitedLog(log)
        self._pending: dict[int, _Conn] = {}  # fd -> connection still reading its HELLO
        self._ready: collections.deque[_Conn] = collections.deque()  # complete, waiting for on_hello
        self._sources: dict[str, dict[_Conn, None]] = {}  # source -> its connections (pending or ready), oldest first
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()
        """source -> (handshakes it may still start, when that was computed); least recently seen first."""
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
        self._tick = time.monotonic()  # when the last loop step ended
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
        self._tick = time.monotonic()
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
            for conn in list(self._ready):
                self._drop(conn)
            self._ready.clear()
            self._sel.close()
            for s in (self._wake_r, self._wake_w):
                s.close()

    def _step(self) -> None:
        now = time.monotonic()
        timeout = 0.05 if self._ready else 1.0
        deadlines = [c.deadline for c in self._pending.values()] + [c.deadline for c in self._ready]
        if deadlines:
            timeout = min(timeout, max(0.0, min(deadlines) - now))
        if not self._accepting:
            timeout = min(timeout, max(0.0, self._resume_at - now))
        events = self._sel.select(timeout)
        self._forgive_stall(time.monotonic() - self._tick, timeout)
        for key, _ in events:
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
            self.logs.log(logging.INFO, "slow", "kvtransport: side-channel connection from %s dropped: no whole "
                          "first message within %.3gs", conn.label, self.preauth_timeout)
            self._drop(conn)
            self.stats.dropped_slow += 1
        self._offer_ready(now)
        self._tick = time.monotonic()

    def _forgive_stall(self, stepped: float, asked: float) -> None:
        """The step took ``stepped`` seconds where ``select`` was asked to wait ``asked`` at most: past
        STALL_GRACE_S more, this thread was stalled, and every deadline moves on by ``stepped``."""
        if stepped <= asked + STALL_GRACE_S:
            return
        self.stats.stalls += 1
        for conn in chain(self._pending.values(), self._ready):
            conn.deadline += stepped
        self.logs.log(logging.WARNING, "stall", "kvtransport: the side-channel admission thread was stalled %.3gs "
                      "(no CPU?); the handshakes in progress keep their time", stepped - asked)

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):  # bounded: the connections already admitted are served in between
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
            source = str(addr[0]) if isinstance(addr, tuple) else ""
            if not self._take_token(source):
                _reset(raw)
                self.stats.reset_flooding += 1
                continue
            self._admit(raw, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr), source)

    def _take_token(self, source: str) -> bool:
        """Whether ``source`` may start one more handshake now (its bucket: ``source_burst`` deep, refilled at
        ``source_rate`` a second); takes it if so. O(1)."""
        now = time.monotonic()
        tokens, stamp = self._buckets.pop(source, (float(self.source_burst), now))
        tokens = min(float(self.source_burst), tokens + (now - stamp) * self.source_rate)
        ok = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if ok else tokens, now)  # (now the most recently seen)
        if len(self._buckets) > MAX_SOURCES:
            self._buckets.popitem(last=False)
        return ok

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

    def _admit(self, raw: socket.socket, label: str, source: str) -> None:
        self.stats.accepted += 1
        while self._sources and len(self._pending) + len(self._ready) >= self.max_pending:
            heaviest = max(self._sources.values(), key=len)  # crowded: the oldest of the source holding most goes
            self._drop(next(iter(heaviest)))
            self.stats.dropped_crowded += 1
        now = time.monotonic()
        nonce, challenge = self.greet()
        conn = _Conn(raw, label, nonce, now, now + self.preauth_timeout, source)
        try:
            raw.setblocking(False)
            if raw.family in (socket.AF_INET, socket.AF_INET6):
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sel.register(raw, selectors.EVENT_READ, conn)
        except OSError:
            raw.close()
            return
        self._pending[raw.fileno()] = conn  # pending before the peer hears from us: who got the challenge sees it
        self._sources.setdefault(source, {})[conn] = None
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
        """The message is whole: it moves, in its own memory, to a PendingHello in ``_ready``."""
        self._sel.unregister(conn.sock)
        body: mmap.mmap | bytes = conn.body if conn.body is not None else b""
        conn.hello = PendingHello(conn.sock, conn.label, conn.nonce, body)
        conn.body = None  # (the hello owns it now)
        self._ready.append(conn)
        del self._pending[conn.sock.fileno()]  # (after: ``pending`` never misses it)
        self._buffered -= conn.held
        conn.release()
        self._offer_ready(time.monotonic())

    def _offer_ready(self, now: float) -> None:
        """Offer each ready connection to ``on_hello`` once, oldest first. A connection stays in ``_ready``
        (counted in ``pending``) until it is taken or dropped; those the owner is too busy for stay, in order."""
        for _ in range(len(self._ready)):
            conn = self._ready[0]
            hello = conn.hello
            if conn.deadline <= now or hello is None:
                if hello is not None:
                    self.logs.log(logging.WARNING, "slow-ready", "kvtransport: a whole HELLO from %s waited past its "
                                  "deadline for a handshake slot and was dropped (every slot busy)", conn.label)
                self._drop(conn)
                self.stats.dropped_slow += 1
                continue
            try:
                taken = self.on_hello(hello)
            except Exception as exc:
                self.logs.log(logging.ERROR, "on_hello", "kvtransport: handshake of %s failed: %s: %s", conn.label,
                              type(exc).__name__, exc)
                taken = None
            if taken is False:
                self._ready.rotate(-1)  # to the back, in one step: the count never changes
                continue
            self._ready.popleft()
            self._forget(conn)
            conn.hello = None  # (the owner's now, or gone with its last reference)
            if taken:
                self.stats.handed_off += 1
            else:  # refused by the owner (it closed the socket), or its check raised
                _close(conn.sock)
                self.stats.refused += 1

    def _forget(self, conn: _Conn) -> None:
        """Take ``conn`` out of its source's connections."""
        conns = self._sources.get(conn.source)
        if conns is not None:
            conns.pop(conn, None)
            if not conns:
                del self._sources[conn.source]

    def _drop(self, conn: _Conn) -> None:
        """Close a connection still in its handshake (reading, or ready and not taken) and forget it."""
        self._forget(conn)
        fd = conn.sock.fileno()
        if fd >= 0 and self._pending.get(fd) is conn:
            del self._pending[fd]
            self._buffered -= conn.held
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        if conn.hello is not None:
            if self._ready and self._ready[0] is conn:
                self._ready.popleft()
            else:
                try:
                    self._ready.remove(conn)
                except ValueError:
                    pass
            conn.hello.release()
            conn.hello = None
        conn.release()
        _close(conn.sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): nothing is sent but the RST, no state (TIME_WAIT) stays behind."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock)


__all__ = ["MAX_HELLO_BYTES", "MAX_PENDING", "MAX_PENDING_BYTES", "SOURCE_BURST", "SOURCE_RATE", "Admission",
           "PendingHello", "RateLimitedLog"]
