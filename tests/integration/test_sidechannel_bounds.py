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
