"""Framed TCP side channel with bounded reads (used by the CommManager for handshake and control)."""

from __future__ import annotations

import socket
import threading
import time

from .errors import PeerDisconnected, ProtocolError, TransferTimeout
from .wire import FRAME_HEADER, FrameType, frame, parse_header


class FramedSocket:
    """A connected TCP socket speaking kvtransport frames. ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket, peer_label: str, send_timeout: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.sock = sock
        self.peer_label = peer_label
        self.send_timeout = send_timeout
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, kind: FrameType, payload: bytes = b"") -> None:
        """Send one frame; raises PeerDisconnected / TransferTimeout (bounded by ``send_timeout``)."""
        self._send_bytes(frame(kind, payload))

    def send_many(self, frames: list[tuple[FrameType, bytes]]) -> None:
        """Send several frames in one write (same errors as :meth:`send`)."""
        self._send_bytes(b"".join(frame(k, p) for k, p in frames))

    def _send_bytes(self, data: bytes) -> None:
        with self._send_lock:
            try:
                self.sock.settimeout(self.send_timeout)
                self.sock.sendall(data)
            except TimeoutError:
                raise TransferTimeout(
                    f"peer {self.peer_label} did not accept data for {self.send_timeout:.3g}s (stalled receiver)"
                ) from None
            except OSError as exc:
                raise PeerDisconnected(f"side channel to {self.peer_label} broke: {exc}") from None

    def recv(self, deadline: float | None = None) -> tuple[FrameType, bytes]:
        """Read one frame. ``deadline`` (monotonic) bounds the wait; None waits until data or close."""
        header = self._recv_exact(FRAME_HEADER.size, deadline)
        kind, length = parse_header(header)
        return kind, self._recv_exact(length, deadline) if length else b""

    def _recv_exact(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no complete message from {self.peer_label} in time")
            try:
                self.sock.settimeout(left)
                chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                raise TransferTimeout(f"no complete message from {self.peer_label} in time") from None
            except OSError as exc:
                raise PeerDisconnected(f"side channel to {self.peer_label} broke: {exc}") from None
            if not chunk:
                if buf:
                    raise ProtocolError(f"truncated message from {self.peer_label}")
                raise PeerDisconnected(f"peer {self.peer_label} closed the side channel")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        """Shut the socket down (wakes a thread blocked in ``recv``). Idempotent, never blocks."""
        if self._closed:
            return
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
