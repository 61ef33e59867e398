"""Framed TCP side channel with bounded reads (used by the CommManager for handshake and control).

The socket stays in blocking mode for its whole life: sends are bounded by the kernel (``SO_SNDTIMEO``),
reads with a deadline wait in ``poll`` first. Switching a shared socket between timeout modes per call (what
``socket.settimeout`` does) costs a system call each time, makes Python poll before every send and
receive, and races between a thread that sends and one that reads. Reads are buffered: one ``recv``
returns every frame that has arrived (:meth:`FramedSocket.recv_many`).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from .errors import PeerDisconnected, ProtocolError, TransferTimeout
from .wire import FRAME_HEADER, FrameType, frame, parse_header

RECV_CHUNK = 64 << 10
"""Receive buffer: a batch of control frames arrives in one call; larger frames get their own buffer."""


def block_with_send_bound(sock: socket.socket, send_timeout: float) -> None:
    """Put ``sock`` in blocking mode with every send bounded by the kernel (SO_SNDTIMEO, ``send_timeout``
    seconds): a peer that is alive but stopped reading makes a send fail (BlockingIOError) instead of
    blocking for ever. Reads stay unbounded: their callers poll with deadlines or are woken by close."""
    sock.settimeout(None)
    secs = max(send_timeout, 0.001)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(secs), int((secs - int(secs)) * 1e6)))


KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
"""A peer host that vanishes without closing (power, network partition) is declared lost after ~25 s of
silence: its in-flight sequences fail with PeerDisconnected instead of waiting out their timeouts."""


def enable_keepalive(sock: socket.socket) -> None:
    """TCP keepalive with the bounds above on a TCP socket (Linux options; elsewhere the system defaults,
    often two hours, apply). Non-blocking; used by the core's and the vLLM connector's side channels."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                       ("TCP_KEEPCNT", KEEPALIVE_PROBES)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


class FramedSocket:
    """A connected TCP socket speaking kvtransport frames. ``send`` is thread-safe; one thread reads."""

    def __init__(self, sock: socket.socket, peer_label: str, send_timeout: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        enable_keepalive(sock)  # a vanished peer host is noticed in ~25 s, not the system's two hours
        block_with_send_bound(sock, send_timeout)  # bounds come from SO_SNDTIMEO and poll (module docstring)
        self.sock = sock
        self.peer_label = peer_label
        self.send_timeout = send_timeout
        self._send_lock = threading.Lock()
        self._closed = False
        self._buf = bytearray(RECV_CHUNK)  # received bytes not yet consumed: _buf[_start:_end]
        self._start = 0
        self._end = 0
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)

    def preload(self, data: bytes) -> None:
        """Bytes of this stream read before this object took the socket (they come first). Reader thread."""
        if not data:
            return
        pending = bytes(self._buf[self._start : self._end]) + data
        if len(pending) > len(self._buf):
            self._buf = bytearray(len(pending))
        self._buf[: len(pending)] = pending
        self._start, self._end = 0, len(pending)

    def send(self, kind: FrameType, payload: bytes = b"") -> None:
        """Send one frame; raises PeerDisconnected / TransferTimeout (bounded by ``send_timeout``)."""
        self._send_bytes(frame(kind, payload))

    def send_many(self, frames: list[tuple[FrameType, bytes]]) -> None:
        """Send several frames in one write (same errors as :meth:`send`)."""
        self._send_bytes(b"".join(frame(k, p) for k, p in frames))

    def _send_bytes(self, data: bytes) -> None:
        self.send_prepared(data, None)

    def send_prepared(self, data: bytes, write: Callable[[int, bytes], tuple[bytes, int]] | None) -> None:
        """Send ``data`` (whole frames), letting ``write(fd, data)`` go first under the send lock: it may write
        to the socket itself (e.g. a backend that writes a completion signal from C the moment a copy
        lands) and returns (the bytes that must be on the wire — ``data``, possibly with more frames after
        it — and how many of them it wrote); the rest is sent here. Same errors as :meth:`send`; whatever
        ``write`` raises propagates, with nothing sent by this method."""
        try:
            with self._send_lock:
                full, n = write(self.sock.fileno(), data) if write is not None else (data, 0)
                if n >= len(full):
                    return
                try:
                    self.sock.sendall(memoryview(full)[n:] if n else full)
                except (BlockingIOError, TimeoutError):  # SO_SNDTIMEO ran out: a frame may be cut, the link is done
                    raise TransferTimeout(
                        f"peer {self.peer_label} did not accept data for {self.send_timeout:.3g}s (stalled receiver)"
                    ) from None
                except OSError as exc:
                    raise PeerDisconnected(f"side channel to {self.peer_label} broke: {exc}") from None
        finally:
            if self._closed:  # close() may have left the descriptor to us (see there)
                self._release_descriptor()

    def readable(self, timeout: float) -> bool:
        """Whether a byte is buffered or arrives within ``timeout`` seconds (then ``recv`` will not wait long)."""
        if self._end > self._start:
            return True
        try:
            return bool(self._poller.poll(max(0, int(timeout * 1000))))
        except OSError:
            return True  # the next recv reports the broken socket

    def recv(self, deadline: float | None = None) -> tuple[FrameType, bytes]:
        """Read one frame. ``deadline`` (monotonic) bounds the wait; None waits until data or close."""
        header = self._take(FRAME_HEADER.size, deadline)
        kind, length = parse_header(header)
        return kind, self._take(length, deadline) if length else b""

    def recv_many(self) -> list[tuple[FrameType, bytes]]:
        """Wait for at least one frame; return it with every further complete frame already received."""
        out = [self.recv()]
        size = FRAME_HEADER.size
        buf = self._buf
        while self._end - self._start >= size:
            kind, length = parse_header(bytes(buf[self._start : self._start + size]))
            if self._end - self._start < size + length:
                break
            begin = self._start + size
            out.append((kind, bytes(buf[begin : begin + length])))
            self._start = begin + length
        return out

    def _take(self, n: int, deadline: float | None) -> bytes:
        """The next ``n`` bytes of the stream."""
        buf = self._buf
        if self._end - self._start < n:
            if n > len(buf):  # a large frame (metadata): its own buffer, grown only as its bytes arrive
                out = bytearray(buf[self._start : self._end])
                self._start = self._end = 0
                chunk = memoryview(bytearray(min(n, 1 << 20)))
                while len(out) < n:
                    got = self._fill(chunk[: min(len(chunk), n - len(out))], deadline)
                    out += chunk[:got]
                return bytes(out)
            if self._start:  # make room at the end
                have = self._end - self._start
                buf[:have] = buf[self._start : self._end]
                self._start, self._end = 0, have
            view = memoryview(buf)
            while self._end - self._start < n:
                self._end += self._fill(view[self._end :], deadline)
        out_b = bytes(buf[self._start : self._start + n])
        self._start += n
        return out_b

    def _fill(self, into: memoryview, deadline: float | None) -> int:
        """``recv_into`` once (bounded by ``deadline``); returns the byte count (> 0)."""
        if deadline is not None:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and self._poller.poll(max(1, int(left * 1000 + 0.999)))
            except OSError as exc:
                raise PeerDisconnected(f"side channel to {self.peer_label} broke: {exc}") from None
            if not ready:
                raise TransferTimeout(f"no complete message from {self.peer_label} in time")
        try:
            got = self.sock.recv_into(into)
        except OSError as exc:
            raise PeerDisconnected(f"side channel to {self.peer_label} broke: {exc}") from None
        if not got:
            if self._end > self._start or into.obj is not self._buf:
                raise ProtocolError(f"truncated message from {self.peer_label}")
            raise PeerDisconnected(f"peer {self.peer_label} closed the side channel")
        return got

    def close(self) -> None:
        """Shut the socket down (wakes a thread blocked in ``recv``; sends fail). Idempotent, never blocks.

        The descriptor is released at once unless a send is in progress — it may be writing from C with
        the descriptor's number in hand, which must not be reused meanwhile: that send releases it. The shutdown
        comes first, before ``_closed`` tells a send to release the descriptor: a recv blocked on a descriptor
        that was closed is not woken (nor does the peer see the end of the stream) — only a shutdown does that."""
        if self._closed:
            return
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._closed = True
        self._release_descriptor()

    def _release_descriptor(self) -> None:
        """Close the descriptor unless a send holds it (then that send does, once it let go of the lock: it
        sees ``_closed``, which was set before this attempt)."""
        if self._send_lock.acquire(blocking=False):
            try:
                self.sock.close()
            finally:
                self._send_lock.release()
