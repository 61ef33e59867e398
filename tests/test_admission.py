"""kvtransport.admission on its own (the core and the vLLM side channel both admit connections through it):
transient accept errors, crowding, oversized or slow first messages, a busy owner, and bytes sent early."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from typing import Any

import pytest

from kvtransport.admission import BODY_START, READ_CHUNK, Admission, PendingHello, RateLimitedLog

HEADER = struct.Struct("!I")


def make(on_hello: Any, **kw: Any) -> tuple[Admission, socket.socket]:
    server = socket.create_server(("127.0.0.1", 0), backlog=1024)
    adm = Admission(server, greet=lambda: (b"n" * 16, b"HI"), header_size=HEADER.size,
                    message_length=lambda h: HEADER.unpack(h)[0], on_hello=on_hello,
                    preauth_timeout=kw.pop("preauth_timeout", 5.0), **kw)
    adm.start()
    return adm, server


def dial(server: socket.socket) -> socket.socket:
    s = socket.create_connection(server.getsockname()[:2], timeout=5)
    assert s.recv(2) == b"HI"
    return s


def wait_for(pred: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_complete_message_is_handed_over_and_nothing_after_it_is_taken() -> None:
    got: list[PendingHello] = []
    adm, server = make(lambda h: got.append(h) or True)
    try:
        s = dial(server)
        s.sendall(HEADER.pack(5) + b"hel")
        time.sleep(0.05)
        s.sendall(b"loNEXT")  # the rest of the message and the start of the next
        wait_for(lambda: adm.stats.handed_off == 1)  # (bumped once on_hello returned: ``got`` is filled)
        assert (got[0].payload, got[0].nonce) == (b"hello", b"n" * 16)
        got[0].sock.setblocking(True)
        got[0].sock.settimeout(2)  # never read beyond the message: what follows stays for its next reader
        assert got[0].leftover + got[0].sock.recv(16) == b"NEXT"
        assert adm.pending == 0 and adm.stats.handed_off == 1
        got[0].sock.close()
        s.close()
    finally:
        adm.close()
        server.close()


@pytest.mark.parametrize("length", [0, 1, BODY_START - 1, BODY_START, BODY_START + 1, 3 * READ_CHUNK + 5])
def test_a_message_of_any_length_arrives_whole_through_its_growing_buffer(length: int) -> None:
    """The body's buffer starts at BODY_START and doubles as bytes arrive (in pieces here); the message is
    handed over byte for byte, and once it is, the admission holds no byte of it."""
    got: list[PendingHello] = []
    adm, server = make(lambda h: got.append(h) or True, max_hello_bytes=4 * READ_CHUNK)
    try:
        s = dial(server)
        data = HEADER.pack(length) + os.urandom(length)
        for i in range(0, len(data), 100_003):
            s.sendall(data[i : i + 100_003])
            time.sleep(0.01)
        wait_for(lambda: adm.stats.handed_off == 1)
        assert got[0].payload == data[HEADER.size :] and got[0].leftover == b""
        assert (adm.pending, adm._buffered) == (0, 0)
        got[0].sock.close()
        s.close()
    finally:
        adm.close()
        server.close()


def test_accept_errors_pause_accepting_and_it_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    """EMFILE (and the like) from accept(): logged, accepting pauses and backs off, then resumes; nothing dies."""
    calls = {"n": 0}
    real_accept = socket.socket.accept

    def failing_accept(self: socket.socket) -> Any:
        if calls["n"] < 3:
            calls["n"] += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return real_accept(self)

    got: list[PendingHello] = []
    adm, server = make(lambda h: got.append(h) or True)
    monkeypatch.setattr(socket.socket, "accept", failing_accept)
    try:
        s = socket.create_connection(server.getsockname()[:2], timeout=5)
        s.settimeout(5)
        assert s.recv(2) == b"HI"  # accepted after three failures
        s.sendall(HEADER.pack(1) + b"x")
        wait_for(lambda: got)
        assert adm.stats.accept_errors == 3
        got[0].sock.close()
        s.close()
    finally:
        monkeypatch.undo()
        adm.close()
        server.close()


def closed_by_peer(s: socket.socket) -> bool:
    """Whether the admission closed ``s`` (EOF within 2 s; the challenge was read already)."""
    s.settimeout(2)
    return s.recv(16) == b""


def test_crowding_drops_the_oldest_and_a_byte_budget_drops_the_largest() -> None:
    """Deterministic: a connection is pending (and the one it crowded out dropped and counted) before its
    challenge leaves, and a drop is counted after it happened; so what ``dial`` and the counters show is
    the state itself, not a moment in between."""
    adm, server = make(lambda h: True, max_pending=4, max_pending_bytes=1000)
    try:
        socks = [dial(server) for _ in range(6)]  # two beyond max_pending: the two oldest go
        assert (adm.stats.dropped_crowded, adm.pending) == (2, 4)
        assert closed_by_peer(socks[0]) and closed_by_peer(socks[1])
        socks[5].sendall(HEADER.pack(900) + b"x" * 600)
        socks[4].sendall(HEADER.pack(900) + b"y" * 500)  # 1,108 buffered: the largest (socks[5]) goes
        wait_for(lambda: adm.stats.dropped_over_budget == 1)
        assert (adm.stats.dropped_crowded, adm.pending) == (2, 3)
        assert closed_by_peer(socks[5])
        socks[4].settimeout(0.2)
        with pytest.raises(TimeoutError):  # the smaller one still waits for the rest of its message
            socks[4].recv(16)
        for s in socks:
            s.close()
        wait_for(lambda: adm.pending == 0)
        assert adm.stats.dropped_over_budget == 1 and adm.stats.dropped_crowded == 2
    finally:
        adm.close()
        server.close()


def test_an_oversized_or_refused_header_and_a_slow_peer_are_dropped() -> None:
    def length(h: bytes) -> int:
        n = HEADER.unpack(h)[0]
        if n == 7:
            raise ValueError("seven is not a hello")
        return int(n)

    server = socket.create_server(("127.0.0.1", 0))
    adm = Admission(server, greet=lambda: (b"n", b"HI"), header_size=4, message_length=length,
                    on_hello=lambda h: True, preauth_timeout=0.3, max_hello_bytes=100)
    adm.start()
    try:
        big, bad, slow = dial(server), dial(server), dial(server)
        big.sendall(HEADER.pack(101))
        bad.sendall(HEADER.pack(7))
        slow.sendall(HEADER.pack(10) + b"abc")  # and never the rest
        wait_for(lambda: adm.stats.dropped_bad == 2 and adm.stats.dropped_slow == 1)
        for s in (big, bad, slow):
            s.settimeout(2)
            assert s.recv(10) == b""  # closed by the receiver
        assert adm.pending == 0
    finally:
        adm.close()
        server.close()


def test_a_peer_that_closes_before_its_hello_is_counted_as_closed() -> None:
    """Every accepted connection ends in exactly one counter: two strangers that hang up (one at once, one
    half-way through its header) are ``dropped_closed``, not slow, bad or crowded."""
    server = socket.create_server(("127.0.0.1", 0))
    adm = Admission(server, greet=lambda: (b"n", b"HI"), header_size=4, message_length=lambda h: 10,
                    on_hello=lambda h: True, preauth_timeout=30, max_hello_bytes=100)
    adm.start()
    try:
        quiet, partial = dial(server), dial(server)
        partial.sendall(b"\x00\x00")
        wait_for(lambda: adm.stats.accepted == 2 and adm.pending == 2)
        quiet.close()
        partial.close()
        wait_for(lambda: adm.pending == 0)
        st = adm.stats
        assert (st.dropped_closed, st.dropped_slow, st.dropped_bad, st.dropped_crowded, st.handed_off) == (2, 0, 0, 0, 0)
    finally:
        adm.close()
        server.close()


def test_hellos_the_owner_refuses_or_fails_on_are_counted_as_refused() -> None:
    """A whole first message that ``on_hello`` refuses (None) or raises on ends in ``refused``, once each."""
    def on_hello(h: PendingHello) -> bool | None:
        if h.payload == b"boom":
            raise RuntimeError("owner failed")
        h.sock.close()
        return None

    server = socket.create_server(("127.0.0.1", 0))
    adm = Admission(server, greet=lambda: (b"n", b"HI"), header_size=4, message_length=lambda h: 4,
                    on_hello=on_hello, preauth_timeout=30, max_hello_bytes=100)
    adm.start()
    try:
        a, b = dial(server), dial(server)
        a.sendall(b"\x00\x00\x00\x04nope")
        b.sendall(b"\x00\x00\x00\x04boom")
        wait_for(lambda: adm.stats.refused == 2 and adm.pending == 0)
        st = adm.stats
        assert (st.refused, st.handed_off, st.dropped_closed, st.dropped_bad) == (2, 0, 0, 0)
    finally:
        adm.close()
        server.close()


def test_a_busy_owner_gets_the_connection_again_until_its_deadline() -> None:
    busy = threading.Event()
    busy.set()
    got: list[PendingHello] = []

    def on_hello(h: PendingHello) -> bool:
        if busy.is_set():
            return False
        got.append(h)
        return True

    adm, server = make(on_hello)
    try:
        s = dial(server)
        s.sendall(HEADER.pack(2) + b"ok")
        time.sleep(0.3)
        assert not got and adm.pending == 1
        busy.clear()
        wait_for(lambda: got)
        got[0].sock.close()
        s.close()
    finally:
        adm.close()
        server.close()


def test_a_whole_hello_kept_past_its_deadline_by_a_busy_owner_is_dropped_and_said(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every handshake slot stays busy: the complete HELLO waits in the ready queue until its deadline, then is
    dropped (counted slow, never handed over, the peer sees its connection closed) with a warning that says so."""
    import logging

    offered: list[float] = []

    def busy(h: PendingHello) -> bool:
        offered.append(time.monotonic())
        return False

    with caplog.at_level(logging.WARNING, logger="kvtransport"):
        adm, server = make(busy, preauth_timeout=0.5)
        try:
            s = dial(server)
            t0 = time.monotonic()
            s.sendall(HEADER.pack(2) + b"ok")
            wait_for(lambda: adm.stats.dropped_slow == 1)
            s.settimeout(2)
            assert s.recv(10) == b""
            assert len(offered) > 1 and offered[-1] - t0 < 0.5 + 0.2  # offered again and again, not past the deadline
            assert (adm.stats.handed_off, adm.pending) == (0, 0)
            s.close()
        finally:
            adm.close()
            server.close()
    assert any("waited past its deadline for a handshake slot" in r.getMessage() for r in caplog.records)


def test_a_hello_that_came_in_time_is_not_dropped_because_the_receiver_was_stalled() -> None:
    """The admission thread gets no CPU for 2.5 s (its ``select`` returns that late; CI's 2-core host under
    twelve engine processes stalled it past 10 s) while a peer sends its whole HELLO at once: the deadline
    (1 s) counts the receiver's waking time only, so the hello is handed over, not dropped as slow. A peer
    that stays silent is still dropped once the receiver is awake past the deadline."""
    got: list[PendingHello] = []
    adm, server = make(lambda h: got.append(h) or True, preauth_timeout=1.0)
    real_select = adm._sel.select
    stall = threading.Event()

    def stalled_select(timeout: float | None = None) -> Any:
        if stall.is_set():
            stall.clear()
            time.sleep(2.5)  # (the thread would have slept at most ``timeout``)
            return real_select(0)
        return real_select(timeout)

    adm._sel.select = stalled_select  # type: ignore[method-assign]
    try:
        s, silent = dial(server), dial(server)
        wait_for(lambda: adm.pending == 2)
        stall.set()
        s.sendall(HEADER.pack(2) + b"ok")
        wait_for(lambda: got, timeout=6)
        assert got[0].payload == b"ok" and adm.stats.stalls == 1
        wait_for(lambda: adm.stats.dropped_slow == 1, timeout=6)  # the silent one, in the receiver's own time
        assert adm.pending == 0 and adm.stats.handed_off == 1
        got[0].sock.close()
        s.close()
        silent.close()
    finally:
        adm.close()
        server.close()


def test_rate_limited_log_says_how_many_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    logs = RateLimitedLog(logging.getLogger("test.rl"), interval=0.2)
    with caplog.at_level(logging.INFO, logger="test.rl"):
        for _ in range(50):
            logs.log(logging.WARNING, "k", "same %s", "thing")
        time.sleep(0.25)
        logs.log(logging.WARNING, "k", "same %s", "thing")
    assert [r.getMessage() for r in caplog.records] == ["same thing", "same thing (49 more like it in the last 0.2s)"]
