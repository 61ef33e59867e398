"""The scheduler side channel as an adversary meets it: strangers, wrong secrets, garbage, floods, and a decode
acting on another decode's requests. Real sockets on loopback, no vLLM process."""

from __future__ import annotations

import json
import queue
import select
import socket
import struct
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from kvtransport import wire

sc = pytest.importorskip("kvtransport_vllm.sidechannel", reason="kvtransport-vllm is not installed")
from kvtransport_vllm import protocol as proto  # noqa: E402
from kvtransport_vllm.config import resolve_settings  # noqa: E402
from kvtransport_vllm.scheduler import SchedulerSide  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SECRET = b"the-shared-secret"
COMPAT_INFO = {"model": "tiny-secret-model", "block_size": 16}
COMPAT = proto.compat_hash(COMPAT_INFO)
META = wire.encode_metadata({"instance": "dec0", "backend": "inproc", "host": "127.0.0.1", "port": 1, "capacity": 1,
                             "layout_hash": "h", "layout_signature": {}, "layout": {}, "transport": {},
                             "auth_required": True})


def compat() -> tuple[str, dict[str, Any]]:
    return COMPAT, dict(COMPAT_INFO)


def hello(engine: str = "decode-A", workers: dict[str, str] | None = None) -> dict[str, Any]:
    return {"type": "hello", "version": proto.PROTOCOL_VERSION, "engine_id": engine, "compat": COMPAT,
            "compat_info": COMPAT_INFO, "tp_size": 1,
            "workers": {"0": proto.b64(META)} if workers is None else workers}


@pytest.fixture
def server():
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    srv = sc.SideChannelServer("127.0.0.1", 0, "prefill-P", compat, inbox, timeout=5.0, lease=30.0, secret=SECRET)
    yield srv, inbox
    srv.close()


def dial(srv: Any) -> socket.socket:
    return socket.create_connection((srv.host, srv.port), timeout=5)


def handshake(srv: Any, secret: bytes | None = SECRET, body: dict[str, Any] | None = None) -> tuple[socket.socket, dict]:
    """A raw client: challenge, sealed hello; returns the socket and the (unsealed when possible) reply."""
    s = dial(srv)
    challenge = proto.recv_message(s)
    nonce = proto.new_nonce()
    proto.send_frame(s, proto.seal({**(body or hello()), "nonce": nonce.hex()}, secret,
                                   bytes.fromhex(challenge["nonce"])))
    payload = proto.recv_frame(s)
    reply = proto.unseal(payload, secret, nonce) if proto.is_sealed(payload) else proto.parse_message(payload)
    return s, reply


def welcomed(client: Any, within: float = 5.0) -> str | None:
    """The prefill engine id ``client`` (a PeerClient) learnt from its welcome, once it has (None: not in time)."""
    deadline = time.monotonic() + within
    while client.peer_engine is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return client.peer_engine


def closed_by_peer(s: socket.socket, within: float = 5.0) -> bool:
    s.settimeout(within)
    try:
        while s.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_a_stranger_is_refused_and_told_nothing(server) -> None:
    srv, inbox = server
    s = dial(srv)
    challenge = proto.recv_message(s)
    assert set(challenge) == {"type", "version", "nonce"} and challenge["type"] == "challenge"
    proto.send_message(s, hello())  # the old plain hello, no HMAC
    assert proto.recv_message(s) == {"type": "refuse", "version": proto.PROTOCOL_VERSION, "reason": proto.REFUSED}
    assert closed_by_peer(s)
    assert inbox.empty() and srv.refused == 1


def test_a_wrong_secret_is_refused_and_a_right_one_served(server) -> None:
    srv, inbox = server
    s, reply = handshake(srv, secret=b"not-the-secret")
    assert reply == {"type": "refuse", "version": proto.PROTOCOL_VERSION, "reason": proto.REFUSED}
    s.close()
    assert inbox.empty()
    s, reply = handshake(srv)
    assert reply["type"] == "welcome" and reply["engine_id"] == "prefill-P" and reply["lease"] == 30.0
    kind, engine, got = inbox.get(timeout=5)
    assert (kind, engine) == ("hello", "decode-A") and got["workers"] == {0: META}
    proto.send_message(s, {"type": "dst", "xfer": "x1", "mode": "push", "dsts": [{"seq": "r1", "blocks": [3, 4]}]})
    assert proto.as_lists(inbox.get(timeout=5)) == ["msg", "decode-A", {
        "type": "dst", "xfer": "x1", "mode": "push", "dsts": [{"seq": "r1", "blocks": [3, 4], "offset": 0}]}]
    s.close()


def test_peer_client_proves_the_secret_and_fails_its_requests_on_a_wrong_one(server) -> None:
    srv, inbox = server
    good = sc.PeerClient(srv.host, srv.port, hello, compat, queue.Queue(), timeout=5, secret=SECRET)
    assert inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    assert welcomed(good) == "prefill-P" and not good.dead  # (the server is told before the client)
    good.close()
    decode_inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    bad = sc.PeerClient(srv.host, srv.port, hello, compat, decode_inbox, timeout=5, secret=b"wrong")
    bad.send({"type": "dst", "xfer": "x", "dsts": [{"seq": "r9", "blocks": [1]}]})
    kind, seq, reason = decode_inbox.get(timeout=5)
    assert (kind, seq) == ("fail", "r9") and "KV_TRANSPORT_SECRET" in reason


def test_the_client_refuses_a_prefill_that_does_not_prove_the_secret() -> None:
    """Mutual: a fake prefill that answers with a welcome sealed by another secret is not trusted."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        def fake_prefill() -> None:
            conn, _ = lsock.accept()
            with conn:
                proto.send_message(conn, {"type": "challenge", "version": proto.PROTOCOL_VERSION,
                                          "nonce": proto.new_nonce().hex()})
                got = proto.unseal(proto.recv_frame(conn), None, b"")  # (no secret: the HMAC is not checked)
                welcome = {"type": "welcome", "version": proto.PROTOCOL_VERSION, "engine_id": "impostor",
                           "compat": COMPAT, "compat_info": COMPAT_INFO, "lease": 30.0}
                proto.send_frame(conn, proto.seal(welcome, b"impostor-secret", bytes.fromhex(got["nonce"])))
                conn.recv(1)

        threading.Thread(target=fake_prefill, daemon=True).start()
        inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        client = sc.PeerClient("127.0.0.1", lsock.getsockname()[1], hello, compat, inbox, timeout=5, secret=SECRET)
        client.send({"type": "dst", "xfer": "x", "dsts": [{"seq": "r1", "blocks": [1]}]})
        kind, seq, reason = inbox.get(timeout=5)
        assert (kind, seq) == ("fail", "r1") and "did not prove KV_TRANSPORT_SECRET" in reason
        assert client.peer_engine is None


def test_garbage_and_invalid_messages_are_dropped_and_the_connection_stays(server) -> None:
    srv, inbox = server
    s, _ = handshake(srv)
    assert inbox.get(timeout=5)[0] == "hello"
    junk = b"\xff\xfe not json at all"
    s.sendall(struct.pack("!I", len(junk)) + junk)
    for bad in ({"type": "dst", "xfer": "x", "dsts": [{"seq": "r", "blocks": ["3"]}]},
                {"type": "dst", "xfer": "x", "dsts": [{"seq": "r", "blocks": [-1]}]},
                {"type": "dst", "xfer": "x", "dsts": [{"seq": "r", "blocks": [1], "offset": float("inf")}]},
                {"type": "dst", "xfer": "x", "dsts": [{"seq": "r", "blocks": [True]}]},
                {"type": "cancel", "xfer": {"nested": 1}, "seqs": []},
                {"type": "renew", "xfers": ["x"] * (proto.MAX_IDS + 1)},
                {"type": "shutdown-everything"}):
        body = json.dumps(bad).encode()
        s.sendall(struct.pack("!I", len(body)) + body)
    proto.send_message(s, {"type": "renew", "xfers": ["x1"]})
    assert inbox.get(timeout=5) == ("msg", "decode-A", {"type": "renew", "xfers": ["x1"]})
    assert srv.dropped == 8 and inbox.empty()
    s.close()


def test_oversized_frames_end_only_their_connection(server) -> None:
    srv, inbox = server
    stranger = dial(srv)
    proto.recv_message(stranger)  # challenge
    stranger.sendall(struct.pack("!I", proto.MAX_HELLO + 1))  # before authenticating: more than a hello may be
    assert closed_by_peer(stranger), "an unauthenticated peer may announce a frame larger than MAX_HELLO"
    s, _ = handshake(srv)
    assert inbox.get(timeout=5)[0] == "hello"
    s.sendall(struct.pack("!I", proto.MAX_MESSAGE + 1))
    assert closed_by_peer(s)
    assert inbox.get(timeout=5)[:2] == ("bye", "decode-A")
    s2, reply = handshake(srv)  # the server still serves
    assert reply["type"] == "welcome"
    s2.close()


def test_metadata_that_connect_would_reject_is_refused_at_hello(server) -> None:
    srv, inbox = server
    for workers in ({"0": proto.b64(b"KVTMjunk")}, {"0": "not base64!"}, {"-1": proto.b64(META)}, {"x": 3}):
        s, reply = handshake(srv, body=hello(workers=workers))
        assert reply["type"] == "refuse" and reply["reason"].startswith("malformed hello"), reply
        s.close()
    assert inbox.empty()


def test_incompatible_authenticated_peer_learns_field_names_not_values(server) -> None:
    srv, _ = server
    body = {**hello(), "compat": "other", "compat_info": {**COMPAT_INFO, "block_size": 32}}
    s, reply = handshake(srv, body=body)
    assert reply["type"] == "refuse" and reply["reason"].endswith("fields that differ: block_size")
    assert "16" not in reply["reason"] and "tiny-secret-model" not in reply["reason"]
    assert closed_by_peer(s, within=2.0)  # and the connection is closed, not left open
    s.close()


def test_idle_strangers_cost_no_thread_and_do_not_lock_out_a_real_decode(server) -> None:
    """300 connections take their challenge and then say nothing (more than MAX_HANDSHAKES, fewer than the
    admission's MAX_PENDING): none gets a thread, and a real decode engine is welcomed meanwhile. Closed, they
    are forgotten."""
    srv, _ = server
    before = {t.name for t in threading.enumerate()}
    idle = [dial(srv) for _ in range(300)]
    for s in idle:
        proto.recv_message(s)  # each got its challenge
    time.sleep(0.2)
    assert sum(t.name == "kvt-sc-in" for t in threading.enumerate()) == sum(n == "kvt-sc-in" for n in before)
    s, reply = handshake(srv)
    assert reply["type"] == "welcome"
    s.close()
    for s in idle:
        s.close()
    deadline = time.monotonic() + 5
    while srv.admission.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.admission.pending == 0


def test_a_hello_announced_beyond_the_bound_is_dropped_unread(server) -> None:
    srv, _ = server
    s = dial(srv)
    proto.recv_message(s)
    s.sendall(struct.pack("!I", proto.MAX_HELLO + 1))  # announces more than a stranger may send
    assert closed_by_peer(s, within=1.0)  # at once, not by the 5-s pre-authentication timeout
    s, reply = handshake(srv)
    assert reply["type"] == "welcome"


# ----------------------------------------------------------------------------- ownership (scheduler)
@pytest.fixture
def prefill():
    side = SchedulerSide(settings=resolve_settings({"lease": 30}, env={}), engine_id="P", block_size=16,
                         producer=True, consumer=False, compat_info={})
    yield side.prefill
    side.shutdown()


def dst(xfer: str, seq: str, blocks: list[int]) -> dict[str, Any]:
    """A dst message as the side channel delivers it (packed on the wire, checked)."""
    msg = {"type": "dst", "xfer": xfer, "mode": "push", "dsts": [{"seq": seq, "blocks": blocks}]}
    return proto.check_message(proto.parse_message(proto.encode_message(msg)[4:]))


def cancel(xfer: str, seqs: list[str], count: int = 0) -> dict[str, Any]:
    return proto.check_message({"type": "cancel", "xfer": xfer, "mode": "push", "seqs": seqs, "count": count})


def test_a_decode_cannot_act_on_another_decodes_request(prefill) -> None:
    now = time.monotonic()
    prefill._on_message("A", dst("x1", "rA", [5, 6]), now)  # destination before its prefill request (orphan)
    prefill._on_message("B", cancel("x1", ["rA"]), now)
    prefill._on_message("B", dst("x1", "rA", [9]), now)
    assert [(d.engine, d.seq, list(d.blocks)) for d in prefill.orphans["x1"][1]] == [("A", "rA", [5, 6])]
    req = SimpleNamespace(request_id="p1", kv_transfer_params={"do_remote_decode": True, "kvt_xfer": "x1",
                                                                "kvt_fanout": 1}, num_prompt_tokens=20)
    src = prefill.register_source(req)
    prefill._on_message("B", cancel("x1", ["rA"]), now)
    prefill._on_message("B", cancel("x1", [], count=1), now)  # B does not hold x1
    assert [(d.engine, d.seq, d.cancelled) for d in src.dsts] == [("A", "rA", False)] and src.cancels == 0
    assert prefill.foreign_refused == 4
    prefill._on_message("A", cancel("x1", ["rA"]), now)  # its owner may
    assert src.dsts[0].cancelled


def answer_pings(s: socket.socket, stop: threading.Event) -> threading.Thread:
    """A raw client's reader that answers every ping with its pong (what PeerClient does)."""
    def run() -> None:
        s.settimeout(5)  # a whole message once one starts: a timeout inside one would lose the stream's framing
        while not stop.is_set():
            try:
                if not select.select([s], [], [], 0.2)[0]:
                    continue
                msg = proto.recv_message(s)
            except (OSError, ValueError, proto.ProtocolFailure):
                return
            if msg.get("type") == "ping":
                proto.send_message(s, {"type": "pong", "token": msg["token"]})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_second_peer_under_a_live_engines_id_is_refused_and_a_reconnect_after_its_death_gets_in(server) -> None:
    """The connection holding an engine id answers pings: a second claimant is refused (retry), the holder
    stays. Gone, its id goes to the next claimant at once."""
    srv, inbox = server
    first, reply = handshake(srv)
    assert reply["type"] == "welcome" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    stop = threading.Event()
    answer_pings(first, stop)
    t0 = time.monotonic()
    second, reply = handshake(srv)  # same engine id, proves the secret too: the live one is probed first
    assert reply == {"type": "refuse", "version": proto.PROTOCOL_VERSION,
                     "reason": "engine id decode-A is already connected", "retry": True}
    assert time.monotonic() - t0 < sc.RECONNECT_PROBE_S
    assert srv.send("decode-A", {"type": "ready", "xfers": []})  # still the first's
    second.close()
    stop.set()
    first.close()  # the engine goes away; it reconnects under its id
    again, reply = handshake(srv)
    assert reply["type"] == "welcome"
    again.close()


def test_an_impostor_holding_a_decodes_id_loses_it_to_the_real_decode_within_one_ping(server) -> None:
    """An impostor (it proved the secret: any holder can) takes decode-A's id first and ignores pings. The real
    decode-A (a PeerClient, which answers them) gets in within RECONNECT_PROBE_S, the impostor's connection is
    closed, and what the prefill sends to decode-A from then on reaches the real one only."""
    srv, inbox = server
    impostor, reply = handshake(srv)
    assert reply["type"] == "welcome" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    decode_inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    t0 = time.monotonic()
    real = sc.PeerClient(srv.host, srv.port, hello, compat, decode_inbox, timeout=10, secret=SECRET)
    try:
        engine = welcomed(real)
        took = time.monotonic() - t0
        assert engine == "prefill-P" and not real.dead
        assert took < sc.RECONNECT_PROBE_S + 1.5, took  # one probe interval (+ slack for a loaded CI host)
        events = [inbox.get(timeout=5)]  # the real one's hello (its connection is held), maybe the impostor's end
        while events[-1][0] != "hello":
            events.append(inbox.get(timeout=5))
        assert [e[:2] for e in events] in ([("hello", "decode-A")], [("bye", "decode-A"), ("hello", "decode-A")])
        assert srv.send("decode-A", {"type": "ready", "xfers": ["x7"]})
        assert decode_inbox.get(timeout=5) == ("ready", (srv.host, srv.port), ["x7"])
        impostor.settimeout(5)
        got = []
        try:
            while True:
                got.append(proto.recv_message(impostor))
        except (OSError, proto.ProtocolFailure):
            pass
        assert [m["type"] for m in got] == ["ping"]  # the probe, then its connection closed: nothing else
    finally:
        real.close()
        impostor.close()


def test_a_claimant_right_behind_the_holders_welcome_is_refused(server, monkeypatch) -> None:
    """The engine id is taken before the welcome leaves: a second handshake of the same id that starts the moment
    the first got its welcome is refused (it was welcomed while the first connection was still being registered,
    which a slow registration, here 0.5 s, makes certain)."""
    real = sc._Conn

    class SlowConn(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kw: Any) -> None:
            time.sleep(0.5)
            super().__init__(*args, **kw)

    monkeypatch.setattr(sc, "_Conn", SlowConn)
    srv, inbox = server
    first, reply = handshake(srv)
    assert reply["type"] == "welcome"
    stop = threading.Event()
    answer_pings(first, stop)
    second, reply = handshake(srv)
    assert reply["type"] == "refuse" and reply["retry"] is True
    assert inbox.get(timeout=5)[:2] == ("hello", "decode-A") and inbox.empty()
    second.close()
    stop.set()
    first.close()


def test_refusals_of_a_claimant_are_logged_at_a_bounded_rate(server, caplog, monkeypatch) -> None:
    """60 claimants of a live engine's id in a row: each refused, the log says so a bounded number of times."""
    monkeypatch.setattr(sc, "RECONNECT_PROBE_S", 10.0)  # a loaded host may answer one of 60 pings late
    srv, _ = server
    first, reply = handshake(srv)
    assert reply["type"] == "welcome"
    stop = threading.Event()
    answer_pings(first, stop)
    with caplog.at_level("ERROR", logger="vllm.kvtransport"):
        for _ in range(60):
            s, reply = handshake(srv)
            assert reply["type"] == "refuse" and reply["retry"] is True
            s.close()
    lines = [r for r in caplog.records if "refusing decode engine" in r.getMessage()]
    assert len(lines) == 1, len(lines)  # the first at once; the rest within the interval suppressed
    stop.set()
    first.close()


def test_a_connection_whose_peer_does_not_read_is_closed_past_its_backlog_bound(monkeypatch) -> None:
    monkeypatch.setattr(sc, "MAX_BACKLOG_BYTES", 256 << 10)
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        b = socket.socket()
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, set before connecting
        b.connect(lsock.getsockname()[:2])
        a, _ = lsock.accept()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        conn = sc._Conn(a, "hoarder", send_timeout=30)  # the send bound alone would wait 30 s
        blob = "x" * (64 << 10)
        t0 = time.monotonic()
        for i in range(64):  # 4 MiB for a peer that reads nothing: past 256 KiB queued, the connection closes
            conn.send({"type": "fill", "i": i, "blob": blob})
        assert conn.closed.wait(5) and conn._queued == 0
        assert time.monotonic() - t0 < 5
    finally:
        a.close()
        b.close()


def test_a_peer_that_floods_the_inbox_is_dropped_and_the_schedulers_own_events_never_wait(monkeypatch) -> None:
    monkeypatch.setattr(sc, "MAX_INBOX", 4)
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    for i in range(4):
        sc._deliver(inbox, ("msg", "e", {"i": i}), timeout=1)
    t0 = time.monotonic()
    with pytest.raises(proto.ProtocolFailure, match="floods"):
        sc._deliver(inbox, ("msg", "e", {"i": 4}), timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2 and inbox.qsize() == 4
    inbox.get()
    sc._deliver(inbox, ("msg", "e", {"i": 5}), timeout=0.2)  # room again: delivered
    assert inbox.qsize() == 4
    # a reader waiting on the full inbox gets its event in soon after the scheduler drains one (it polls often)
    import threading

    waiter = threading.Thread(target=sc._deliver, args=(inbox, ("msg", "e", {"i": 6}), 10.0))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and inbox.qsize() == 4
    inbox.get()
    t0 = time.monotonic()
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - t0 < 0.5 and inbox.qsize() == 4


def test_a_handshake_thread_that_cannot_start_refuses_only_that_peer(server, monkeypatch, caplog) -> None:
    """That peer's connection is closed and the reason logged with its address; the server keeps serving."""
    srv, _inbox = server
    caplog.set_level("WARNING")
    real_start = threading.Thread.start
    failed = []

    def start(self: threading.Thread) -> None:
        if self.name == "kvt-sc-in" and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    s = dial(srv)
    challenge = proto.recv_message(s)
    proto.send_frame(s, proto.seal({**hello(), "nonce": proto.new_nonce().hex()}, SECRET,
                                   bytes.fromhex(challenge["nonce"])))
    assert closed_by_peer(s) and failed == ["kvt-sc-in"]
    lines = [r.getMessage() for r in caplog.records if "cannot start a thread" in r.getMessage()]
    assert lines == [f"side channel: cannot start a thread for 127.0.0.1:{s.getsockname()[1]} (can't start new "
                     "thread); closed"], lines
    s.close()
    s, reply = handshake(srv)  # the server keeps serving
    assert reply["type"] == "welcome"
    s.close()


def test_first_token_messages_are_checked_before_the_scheduler_sees_them() -> None:
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        host, port = lsock.getsockname()[:2]
        client = sc.PeerClient(host, port, hello, compat, inbox, timeout=5)
        s, _ = lsock.accept()
        s.settimeout(5)
        nonce = proto.new_nonce()
        proto.send_message(s, {"type": "challenge", "version": proto.PROTOCOL_VERSION, "nonce": nonce.hex()})
        theirs = proto.unseal(proto.recv_frame(s), None, nonce)
        proto.send_frame(s, proto.seal({"type": "welcome", "version": proto.PROTOCOL_VERSION, "engine_id": "P",
                                          "compat": COMPAT, "compat_info": COMPAT_INFO, "lease": 30, "senders": {}},
                                         None, bytes.fromhex(theirs["nonce"])))
        for bad in ({"type": "first", "xfer": "x", "token": -1}, {"type": "first", "xfer": "x", "token": True},
                    {"type": "first", "xfer": "x", "token": 1 << 40}, {"type": "first", "xfer": 5, "token": 3},
                    {"type": "first", "xfer": "x" * 600, "token": 3}, {"type": "first", "xfer": "x"}):
            proto.send_message(s, bad)
        proto.send_message(s, {"type": "first", "xfer": "x1", "token": 42})
        assert inbox.get(timeout=5) == ("first", (host, port), "x1", 42)  # the first well-formed one only
        assert inbox.empty()
        client.close()
        s.close()


def test_one_decode_cannot_take_every_place_for_early_destinations() -> None:
    side = SchedulerSide(settings=resolve_settings({}), engine_id="P", block_size=16, producer=True, consumer=False,
                         compat_info=COMPAT_INFO)
    sent: list[tuple[str, dict]] = []
    side.server.send = lambda engine, msg: sent.append((engine, msg)) or True  # type: ignore[union-attr]
    try:
        from kvtransport_vllm import producer as producer_mod

        for i in range(producer_mod.MAX_ORPHANS_PER_ENGINE + 3):
            side.prefill._on_message("greedy", {"type": "dst", "xfer": f"x{i}", "mode": "push",
                                        "dsts": [{"seq": f"s{i}", "blocks": [1], "offset": 0}]}, time.monotonic())
        assert len(side.prefill.orphans) == producer_mod.MAX_ORPHANS_PER_ENGINE
        assert [m["seqs"] for _, m in sent if m["type"] == "fail"] == [[f"s{i}"] for i in range(
            producer_mod.MAX_ORPHANS_PER_ENGINE, producer_mod.MAX_ORPHANS_PER_ENGINE + 3)]
        side.prefill._on_message("other", {"type": "dst", "xfer": "y", "mode": "push",
                                   "dsts": [{"seq": "t", "blocks": [1], "offset": 0}]}, time.monotonic())
        assert "y" in side.prefill.orphans  # another decode still has room
    finally:
        side.shutdown()


def test_a_wrong_secret_fails_the_waiting_request_at_once_not_at_the_connect_timeout(server) -> None:
    """Issue 32: a refusal for the secret is final (no retry until connect_timeout): a decode with a 30 s
    connect timeout fails its request in well under a second."""
    srv, _ = server
    decode_inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    t0 = time.monotonic()
    bad = sc.PeerClient(srv.host, srv.port, hello, compat, decode_inbox, timeout=30, secret=b"wrong")
    bad.send({"type": "dst", "xfer": "x", "dsts": [{"seq": "r9", "blocks": [1]}]})
    kind, seq, reason = decode_inbox.get(timeout=5)
    assert (kind, seq) == ("fail", "r9") and "KV_TRANSPORT_SECRET" in reason
    assert time.monotonic() - t0 < 2.0
    assert srv.refused == 1


@pytest.mark.parametrize("welcome_frame", ["zero-tag", "plain-json"])
def test_a_welcome_without_a_valid_tag_is_refused_by_a_decode_with_a_secret(welcome_frame: str) -> None:
    """Issue 32: a fake prefill answers a decode that has a secret with a welcome sealed without an HMAC (the
    32 zero bytes a secret-less side sends) or with a plain JSON welcome: the decode trusts neither."""
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        def fake_prefill() -> None:
            conn, _ = lsock.accept()
            with conn:
                proto.send_message(conn, {"type": "challenge", "version": proto.PROTOCOL_VERSION,
                                          "nonce": proto.new_nonce().hex()})
                got = proto.unseal(proto.recv_frame(conn), None, b"")
                welcome = {"type": "welcome", "version": proto.PROTOCOL_VERSION, "engine_id": "impostor",
                           "compat": COMPAT, "compat_info": COMPAT_INFO, "lease": 30.0}
                if welcome_frame == "zero-tag":
                    proto.send_frame(conn, proto.seal(welcome, None, bytes.fromhex(got["nonce"])))
                else:
                    proto.send_message(conn, welcome)
                conn.recv(1)

        threading.Thread(target=fake_prefill, daemon=True).start()
        inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        client = sc.PeerClient("127.0.0.1", lsock.getsockname()[1], hello, compat, inbox, timeout=5, secret=SECRET)
        client.send({"type": "dst", "xfer": "x", "dsts": [{"seq": "r1", "blocks": [1]}]})
        kind, seq, reason = inbox.get(timeout=5)
        assert (kind, seq) == ("fail", "r1") and "did not prove KV_TRANSPORT_SECRET" in reason
        assert client.peer_engine is None


def test_a_holder_that_does_not_answer_the_probe_loses_its_id_to_the_first_claimant(server) -> None:
    """A holder that reads its ping and does not answer (hung, or an impostor that does not play along): the
    claimant's own first handshake is welcomed, after one probe interval, not refused into a retry, and the
    silent holder's connection is closed."""
    srv, inbox = server
    holder, reply = handshake(srv)
    assert reply["type"] == "welcome" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    t0 = time.monotonic()
    claimant, reply = handshake(srv)
    took = time.monotonic() - t0
    assert reply["type"] == "welcome", reply
    assert sc.RECONNECT_PROBE_S - 0.05 <= took < sc.RECONNECT_PROBE_S + 3.0, took  # slack: a loaded CI host
    holder.settimeout(5)
    assert proto.recv_message(holder)["type"] == "ping"
    assert closed_by_peer(holder)
    assert srv.send("decode-A", {"type": "ready", "xfers": ["x3"]})
    claimant.settimeout(5)
    assert proto.recv_message(claimant) == {"type": "ready", "xfers": ["x3"]}
    holder.close()
    claimant.close()


def test_a_holder_that_goes_away_during_the_probe_hands_its_id_over_at_once(server, monkeypatch) -> None:
    """The holder closes its connection when the ping comes: the claimant is welcomed as soon as the prefill
    sees it gone, well inside the probe interval (5 s here: the server's timeout bounds it)."""
    monkeypatch.setattr(sc, "RECONNECT_PROBE_S", 10.0)
    srv, inbox = server
    holder, reply = handshake(srv)
    assert reply["type"] == "welcome" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")

    def leave_on_ping() -> None:
        holder.settimeout(5)
        try:
            if proto.recv_message(holder)["type"] == "ping":
                holder.shutdown(socket.SHUT_RDWR)
        except (OSError, proto.ProtocolFailure):
            pass

    t = threading.Thread(target=leave_on_ping, daemon=True)
    t.start()
    t0 = time.monotonic()
    claimant, reply = handshake(srv)
    took = time.monotonic() - t0
    t.join(5)
    assert reply["type"] == "welcome", reply
    assert took < 3.0, took
    claimant.close()
    holder.close()


def test_a_live_peer_client_answers_the_probe_and_keeps_its_id(server) -> None:
    """The decode's own client (PeerClient) answers the prefill's ping with its token: a second claimant of its
    id is refused (retry) within the probe interval, and the prefill's messages still reach the PeerClient."""
    srv, inbox = server
    decode_inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    real = sc.PeerClient(srv.host, srv.port, hello, compat, decode_inbox, timeout=10, secret=SECRET)
    try:
        assert welcomed(real) == "prefill-P" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")
        t0 = time.monotonic()
        claimant, reply = handshake(srv)
        assert reply == {"type": "refuse", "version": proto.PROTOCOL_VERSION,
                         "reason": "engine id decode-A is already connected", "retry": True}
        assert time.monotonic() - t0 < sc.RECONNECT_PROBE_S
        assert srv.refused == 1
        assert srv.send("decode-A", {"type": "ready", "xfers": ["x9"]})
        assert decode_inbox.get(timeout=5) == ("ready", (srv.host, srv.port), ["x9"])
        claimant.close()
    finally:
        real.close()


def test_refusals_are_counted_one_each_and_logged_with_the_engine_and_the_peer_at_a_bounded_rate(server, caplog) -> None:
    srv, _ = server
    caplog.set_level("ERROR")
    for engine in ("decode-X", "decode-Y"):
        s, reply = handshake(srv, body={**hello(engine), "compat": "another-model"})
        assert reply["type"] == "refuse" and reply["retry"] is False
        s.close()
    assert srv.refused == 2
    lines = [r.getMessage() for r in caplog.records if "refusing decode engine" in r.getMessage()]
    assert len(lines) == 1, lines  # the second within the rate limit's interval is not logged
    assert lines[0].startswith("refusing decode engine decode-X from 127.0.0.1:"), lines[0]
    assert lines[0].endswith(": incompatible KV caches: hashes differ"), lines[0]


def test_send_to_an_engine_that_is_not_connected_says_so(server) -> None:
    srv, inbox = server
    assert srv.send("nobody", {"type": "ready", "xfers": []}) is False
    s, reply = handshake(srv)
    assert reply["type"] == "welcome" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    assert srv.send("decode-A", {"type": "ready", "xfers": []}) is True
    s.close()
    deadline = time.monotonic() + 5
    while srv.send("decode-A", {"type": "ready", "xfers": []}) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.send("decode-A", {"type": "ready", "xfers": []}) is False  # gone: its connection closed


@pytest.mark.parametrize("kind", ["malformed", "incompatible", "compat_info not a dict", "id held"])
def test_each_refusal_is_logged_with_the_claimants_id_its_address_and_the_reason(server, caplog, kind: str) -> None:
    """What the prefill's operator reads (the values) and what the refused peer is told (names only)."""
    srv, inbox = server
    caplog.set_level("ERROR")
    stop = threading.Event()
    holder = None
    if kind == "id held":
        holder, _ = handshake(srv)
        assert inbox.get(timeout=5)[:2] == ("hello", "decode-A")
        answer_pings(holder, stop)
    body = {"malformed": hello(workers={"x": 3}),
            "incompatible": {**hello(), "compat": "other", "compat_info": {**COMPAT_INFO, "block_size": 32}},
            "compat_info not a dict": {**hello(), "compat": "other", "compat_info": "garbage"},
            "id held": hello()}[kind]
    s, reply = handshake(srv, body=body)
    logged, told = {
        "malformed": ("worker 'x': bad rank or base64", "malformed hello: worker 'x': bad rank or base64"),
        "incompatible": ("incompatible KV caches: block_size: ours=16 peer=32",
                         "incompatible KV caches, fields that differ: block_size"),
        "compat_info not a dict": ("incompatible KV caches: block_size: ours=16 peer=None; model: "
                                   "ours='tiny-secret-model' peer=None",
                                   "incompatible KV caches, fields that differ: block_size, model"),
        "id held": ("an engine with this id is connected and alive", "engine id decode-A is already connected"),
    }[kind]
    assert reply == {"type": "refuse", "version": proto.PROTOCOL_VERSION, "reason": told, "retry": kind == "id held"}
    port = s.getsockname()[1]
    lines = [r.getMessage() for r in caplog.records if "refusing decode engine" in r.getMessage()]
    assert lines == [f"refusing decode engine decode-A from 127.0.0.1:{port}: {logged}"]
    s.close()
    stop.set()
    if holder is not None:
        holder.close()


def test_a_connection_that_breaks_the_protocol_says_why_in_its_bye(server) -> None:
    srv, inbox = server
    s, _ = handshake(srv)
    assert inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    s.sendall(struct.pack("!I", proto.MAX_MESSAGE + 1))
    assert closed_by_peer(s)
    assert inbox.get(timeout=5) == ("bye", "decode-A",
                                    f"peer announced a {proto.MAX_MESSAGE + 1}-byte message (limit {proto.MAX_MESSAGE})")
    s.close()


def test_strangers_are_counted_one_each_and_logged_with_their_address_and_why(server, caplog) -> None:
    srv, inbox = server
    caplog.set_level("WARNING")
    ports = []
    for _ in range(2):
        s = dial(srv)
        proto.recv_message(s)  # the challenge
        proto.send_message(s, hello())  # a plain hello, no HMAC
        assert proto.recv_message(s)["reason"] == proto.REFUSED
        ports.append(s.getsockname()[1])
        s.close()
    assert srv.refused == 2 and inbox.empty()
    lines = [r.getMessage() for r in caplog.records if "side-channel peer" in r.getMessage()]
    assert lines == [f"refusing a side-channel peer from 127.0.0.1:{ports[0]}: unauthenticated: "
                     "unsealed frame"], lines


def test_a_closed_peer_client_fails_what_is_sent_to_it_with_closed(server) -> None:
    srv, inbox = server
    decode_inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    client = sc.PeerClient(srv.host, srv.port, hello, compat, decode_inbox, timeout=5, secret=SECRET)
    assert inbox.get(timeout=5)[:2] == ("hello", "decode-A")
    client.close()
    assert client.dead and client.error == "closed"
    client.send({"type": "dst", "xfer": "x", "dsts": [{"seq": "r1", "blocks": [1]}, {"seq": "r2", "blocks": [2]}]})
    assert [decode_inbox.get(timeout=5) for _ in range(2)] == [("fail", "r1", "closed"), ("fail", "r2", "closed")]
    assert decode_inbox.empty()


def test_a_worker_link_answers_the_probe_keeps_its_id_and_sends_what_was_queued(server) -> None:
    """A decode's link to a prefill worker's destination channel (``worker=True``) acts on nothing the peer sends
    but its pings, which it answers: a second claimant of its id is refused, and what was queued before the
    welcome arrives in order."""
    srv, inbox = server
    link = sc.PeerClient(srv.host, srv.port, hello, compat, queue.Queue(), timeout=10, secret=SECRET, worker=True)
    try:
        link.send({"type": "renew", "xfers": ["x1"]})
        link.send({"type": "renew", "xfers": ["x2"]})
        assert inbox.get(timeout=5)[:2] == ("hello", "decode-A")
        assert [inbox.get(timeout=5) for _ in range(2)] == [("msg", "decode-A", {"type": "renew", "xfers": ["x1"]}),
                                                            ("msg", "decode-A", {"type": "renew", "xfers": ["x2"]})]
        claimant, reply = handshake(srv)
        assert reply["type"] == "refuse" and reply["retry"] is True, reply
        claimant.close()
        assert srv.send("decode-A", {"type": "ready", "xfers": []}) and not link.dead
    finally:
        link.close()


def test_a_hello_waits_for_a_free_handshake_slot_while_admission_goes_on(server) -> None:
    """Every handshake slot busy (MAX_HANDSHAKES run): a proved hello waits, neither refused nor lost, and the
    admission thread meanwhile still answers others (a stranger is refused at once); once a slot frees, the
    waiting hello is served."""
    import threading

    srv, inbox = server
    taken = 0
    while srv._handshakes.acquire(blocking=False):  # occupy every slot
        taken += 1
    assert taken == sc.MAX_HANDSHAKES == 32
    result: list[Any] = []
    client = threading.Thread(target=lambda: result.append(handshake(srv)))
    client.start()
    time.sleep(0.5)
    assert not result and inbox.empty()  # proved, waiting for a slot
    t0 = time.monotonic()
    s = dial(srv)
    proto.recv_message(s)
    proto.send_message(s, hello())  # a stranger (no HMAC)
    assert proto.recv_message(s)["type"] == "refuse" and time.monotonic() - t0 < 1.0
    s.close()
    srv._handshakes.release()
    client.join(5)
    assert result and result[0][1]["type"] == "welcome"
    assert inbox.get(timeout=5)[0] == "hello"
    result[0][0].close()
    for _ in range(taken - 1):
        srv._handshakes.release()


def test_a_second_server_cannot_take_a_port_in_use(server) -> None:
    """Two engines configured with one side-channel port: the second fails to start (no SO_REUSEPORT sharing,
    where the kernel would hand each of them half of the decodes)."""
    srv, _ = server
    with pytest.raises(OSError):
        sc.SideChannelServer("127.0.0.1", srv.port, "prefill-Q", compat, queue.Queue(), timeout=5.0, lease=30.0,
                             secret=SECRET)


def test_what_the_prefill_answers_at_once_goes_back_to_its_sender_and_the_rest_to_the_inbox() -> None:
    """``answer_now`` (the producer's refusal of a destination for a freed transfer) sees the sender's engine id
    and each message; what it answers goes back on that connection, what it does not goes to the inbox."""
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    seen: list[tuple[str, str]] = []

    def answer_now(engine: str, msg: dict[str, Any]) -> dict[str, Any] | None:
        seen.append((engine, str(msg.get("xfer"))))
        return {"type": "fail", "seqs": ["r1"], "reason": "freed"} if msg.get("xfer") == "gone" else None

    srv = sc.SideChannelServer("127.0.0.1", 0, "prefill-P", compat, inbox, timeout=5.0, lease=30.0, secret=SECRET,
                               answer_now=answer_now)
    try:
        s, reply = handshake(srv)
        assert reply["type"] == "welcome" and inbox.get(timeout=5)[:2] == ("hello", "decode-A")
        proto.send_message(s, {"type": "dst", "xfer": "gone", "dsts": [{"seq": "r1", "blocks": [1]}]})
        assert proto.recv_message(s) == {"type": "fail", "seqs": ["r1"], "reason": "freed"}
        live = {"type": "dst", "xfer": "live", "dsts": [{"seq": "r2", "blocks": [2]}]}
        proto.send_message(s, live)
        event = inbox.get(timeout=5)
        assert event[:2] == ("msg", "decode-A") and event[2]["xfer"] == "live" and inbox.empty()
        assert seen == [("decode-A", "gone"), ("decode-A", "live")]
        s.close()
    finally:
        srv.close()
