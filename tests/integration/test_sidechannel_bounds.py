"""The connector's scheduler side channel never blocks for ever on a peer that stopped reading."""

from __future__ import annotations

import socket
import time

import pytest

from kvtransport import sidechannel as core_sc

sc = pytest.importorskip("kvtransport_vllm.sidechannel", reason="kvtransport-vllm is not installed")


def test_a_peer_that_stops_reading_fails_the_connection_within_the_send_bound() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        b = socket.create_connection(server.getsockname()[:2], timeout=5)
        a, _ = server.accept()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the writer blocks sooner
    try:
        conn = sc._Conn(a, "stalled-peer", send_timeout=0.5)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == core_sc.KEEPALIVE_IDLE_S
        blob = "x" * (1 << 20)
        t0 = time.monotonic()
        for i in range(64):  # far more than the socket buffers hold: the writer must block, then give up
            conn.send({"type": "fill", "i": i, "blob": blob})
        assert conn.closed.wait(10), "the writer is still blocked on a peer that does not read"
        assert time.monotonic() - t0 < 10
    finally:
        b.close()
        a.close()


def _pair(rcvbuf: int = 4096) -> tuple[socket.socket, socket.socket]:
    """(ours, the peer's) over loopback, the peer with a small receive window and ours with a small send buffer."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname()[:2], timeout=10)
        ours, _ = server.accept()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return ours, peer


def _fill(i: int) -> dict[str, object]:
    return {"type": "fill", "i": f"{i:06d}", "blob": "y" * 2000}  # every frame the same size


def _until(cond: object, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_the_backlog_counts_every_queued_byte_and_its_bound_is_exact(monkeypatch) -> None:
    """A peer that stopped reading: once the socket takes no more, each frame waits whole in the backlog, counted
    to the byte; a frame that brings the backlog exactly to MAX_BACKLOG_BYTES still waits, one byte more fails the
    connection (and clears the backlog)."""
    from kvtransport_vllm.protocol import encode_message

    frame = len(encode_message(_fill(0)))
    ours, peer = _pair()
    conn = sc._Conn(ours, "slow-peer", send_timeout=30)
    try:
        assert conn._queued == 0 and not conn._writing and not conn._backlog
        i = 0
        while not conn._backlog and not conn._writing:  # written directly while the socket takes them
            conn.send(_fill(i))
            i += 1
            assert i < 10_000, "the socket never filled"
        _until(lambda: conn._writing, "the writer never took the queued rest")
        conn.send(_fill(i))  # the writer holds a frame (blocked: nobody reads): this one waits whole
        i += 1
        assert conn._queued == frame * len(conn._backlog) >= frame and not conn.closed.is_set()
        queued = conn._queued
        monkeypatch.setattr(sc, "MAX_BACKLOG_BYTES", queued + 2 * frame)
        conn.send(_fill(i))
        conn.send(_fill(i + 1))  # exactly at the bound: waits
        assert conn._queued == queued + 2 * frame and not conn.closed.is_set()
        conn.send(_fill(i + 2))  # past it
        assert conn.closed.is_set() and conn._queued == 0 and not conn._backlog
    finally:
        conn.close()
        peer.close()


def test_frames_arrive_whole_and_in_order_while_the_peer_reads_slowly() -> None:
    """Sends written directly, queued, and written by the writer thread interleave while a slow peer reads: every
    frame arrives once, whole and in order, and afterwards nothing is counted as queued or being written."""
    import threading

    from kvtransport_vllm.protocol import recv_message

    ours, peer = _pair()
    conn = sc._Conn(ours, "slow-reader", send_timeout=30)
    got: list[str] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(400):
                got.append(recv_message(peer)["i"])
                time.sleep(0.0005)
        except BaseException as exc:  # reported below
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(400):
            conn.send(_fill(i))
            if i % 3 == 0:
                time.sleep(0.001)  # now and then the backlog drains while the writer is mid-frame
        reader.join(30)
        assert not errors and got == [f"{i:06d}" for i in range(400)]
        _until(lambda: not conn._writing, "the writer still counts a frame as being written")
        assert conn._queued == 0 and not conn._backlog and not conn.closed.is_set()
    finally:
        conn.close()
        peer.close()
        reader.join(5)


class _GatedSocket:
    """A socket whose direct (non-blocking) send takes ``room`` bytes at most and whose blocking ``sendall`` waits
    for ``gate``: what the peer receives is ``wire``, in the order the bytes were written."""

    family = socket.AF_UNIX  # no keepalive options

    def __init__(self) -> None:
        import threading

        self.wire = bytearray()
        self.room = 1 << 30
        self.gate = threading.Event()
        self.in_sendall = threading.Event()

    def settimeout(self, value: object) -> None:
        pass

    def setsockopt(self, *args: object) -> None:
        pass

    def send(self, data: bytes, flags: int = 0) -> int:
        n = min(len(data), self.room)
        self.wire += data[:n]
        return n

    def sendall(self, data: bytes) -> None:
        self.in_sendall.set()
        assert self.gate.wait(10)
        self.wire += data

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_no_direct_send_overtakes_a_frame_the_writer_holds() -> None:
    """A frame's rest is with the writer thread (blocked in ``sendall``) and nothing else waits: the next send
    must wait behind it, not be written directly into the middle of the stream."""
    from kvtransport_vllm.protocol import encode_message

    fake = _GatedSocket()
    conn = sc._Conn(fake, "gated", send_timeout=5)  # type: ignore[arg-type]
    try:
        first, second, third = (encode_message(_fill(i)) for i in range(3))
        conn.send(_fill(0))  # written directly, whole
        assert bytes(fake.wire) == first
        fake.room = 10
        conn.send(_fill(1))  # 10 bytes now, the rest to the writer
        assert fake.in_sendall.wait(5) and conn._writing and not conn._backlog
        fake.room = 1 << 30  # the socket would take the next frame whole: it must still wait
        conn.send(_fill(2))
        assert bytes(fake.wire) == first + second[:10] and conn._queued == len(third)
        fake.gate.set()
        _until(lambda: not conn._writing and not conn._backlog, "the writer did not finish")
        assert bytes(fake.wire) == first + second + third and conn._queued == 0
    finally:
        conn.close()
