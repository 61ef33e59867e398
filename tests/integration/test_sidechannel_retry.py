"""A decode's side-channel client meets a busy prefill: a handshake that breaks off before the welcome (reset,
closed, or refused with ``retry``) is tried again within the connect timeout instead of failing the waiting
requests; what cannot pass later (a refusal, another secret) still fails them at once. Fake prefills on loopback."""

from __future__ import annotations

import json
import queue
import socket
import struct
import threading
import time
from typing import Any

import pytest

sc = pytest.importorskip("kvtransport_vllm.sidechannel", reason="kvtransport-vllm is not installed")
from kvtransport_vllm import protocol as proto  # noqa: E402

pytestmark = pytest.mark.timeout(60)

SECRET = b"retry-secret"
COMPAT_INFO = {"model": "tiny-retry-model", "block_size": 16}
COMPAT = proto.compat_hash(COMPAT_INFO)
KEPT: list[socket.socket] = []
DST = {"type": "dst", "xfer": "x1", "dsts": [{"seq": "r1", "blocks": [1, 2]}]}


def compat() -> tuple[str, dict[str, Any]]:
    return COMPAT, dict(COMPAT_INFO)


def hello() -> dict[str, Any]:
    return {"type": "hello", "version": proto.PROTOCOL_VERSION, "engine_id": "decode-R", "compat": COMPAT,
            "compat_info": COMPAT_INFO, "tp_size": 1, "workers": {}}


def fake_prefill(lsock: socket.socket, answers: list[str], got: queue.Queue[Any]) -> None:
    """Serves one connection per entry of ``answers``: "reset" (closes with RST after the hello), "close" (plain
    close after the hello), "refuse-retry" / "refuse" / "refuse-long" (a refusal with / without ``retry``, the last
    with a 5,000-character reason), "huge-welcome" (announces a reply larger than MAX_HELLO), "welcome" or "lease=<json>" (a welcome with that lease; then forwards what it
    receives to ``got``); before any hello: "silent" (says nothing), "huge-challenge" (announces an opening larger
    than MAX_HELLO), "not-a-challenge" (opens with something else)."""
    for answer in answers:
        conn, _ = lsock.accept()
        conn.settimeout(10)
        if answer == "silent":  # takes the connection and never says a word
            KEPT.append(conn)
            got.put(("hello", answer))
            continue
        if answer == "huge-challenge":  # announces an opening larger than a hello may be, sends none of it
            conn.sendall(struct.pack("!I", proto.MAX_HELLO + 1))
            KEPT.append(conn)
            got.put(("hello", answer))
            continue
        if answer == "not-a-challenge":
            proto.send_message(conn, {"type": "welcome", "version": proto.PROTOCOL_VERSION, "nonce": "00" * 16})
            KEPT.append(conn)
            got.put(("hello", answer))
            continue
        proto.send_message(conn, {"type": "challenge", "version": proto.PROTOCOL_VERSION,
                                  "nonce": proto.new_nonce().hex()})
        sealed = proto.unseal(proto.recv_frame(conn), None, b"")  # (the HMAC not checked: a fake prefill)
        got.put(("hello", answer))
        if answer == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()
        elif answer == "close":
            conn.close()
        elif answer == "huge-welcome":  # announces a reply larger than a hello may be, sends none of it
            conn.sendall(struct.pack("!I", proto.MAX_HELLO + 1))
            KEPT.append(conn)
        elif answer.startswith("refuse"):
            reason = "r" * 5000 if answer == "refuse-long" else "engine id decode-R is already connected"
            proto.send_message(conn, {"type": "refuse", "version": proto.PROTOCOL_VERSION, "reason": reason,
                                      "retry": answer == "refuse-retry"})
            conn.close()
        else:  # "welcome", or "lease=<json>": a welcome with that lease
            lease = json.loads(answer[6:]) if answer.startswith("lease=") else 30.0
            welcome = {"type": "welcome", "version": proto.PROTOCOL_VERSION, "engine_id": "prefill-P",
                       "compat": COMPAT, "compat_info": COMPAT_INFO, "lease": lease, "senders": {"0": "w0"}}
            proto.send_frame(conn, proto.seal(welcome, SECRET, bytes.fromhex(sealed["nonce"])))
            got.put(("msg", proto.recv_message(conn)))
            KEPT.append(conn)  # stays open: the test ends it


def run_client(answers: list[str], timeout: float = 10,
               worker: bool = False) -> tuple[queue.Queue[Any], queue.Queue[Any], Any, float]:
    lsock = socket.create_server(("127.0.0.1", 0))
    got: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=fake_prefill, args=(lsock, answers, got), daemon=True).start()
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    t0 = time.monotonic()
    client = sc.PeerClient("127.0.0.1", lsock.getsockname()[1], hello, compat, inbox, timeout=timeout,
                           secret=SECRET, worker=worker)
    client.send(DST)
    return got, inbox, client, t0


@pytest.mark.parametrize("first", ["reset", "close", "refuse-retry"])
def test_a_handshake_that_breaks_off_is_tried_again_and_the_queued_dst_arrives(first: str) -> None:
    got, inbox, client, _ = run_client([first, first, "welcome"])
    assert got.get(timeout=10) == ("hello", first)
    assert got.get(timeout=10) == ("hello", first)
    assert got.get(timeout=10) == ("hello", "welcome")
    assert proto.as_lists(got.get(timeout=10)) == ["msg", DST]  # the message queued before the connection reached the prefill
    assert inbox.get(timeout=5) == ("senders", ("127.0.0.1", client.port), {0: "w0"})
    assert inbox.empty(), "a retried handshake failed a waiting request"
    assert not client.dead and client.peer_engine == "prefill-P"
    client.close()
    for conn in KEPT:
        conn.close()


def test_a_refusal_without_retry_fails_the_waiting_request_at_once() -> None:
    got, inbox, client, t0 = run_client(["refuse", "welcome"])
    kind, seq, reason = inbox.get(timeout=5)
    assert (kind, seq) == ("fail", "r1") and "refused us: engine id decode-R is already connected" in reason
    assert time.monotonic() - t0 < 3 and client.dead
    assert got.get(timeout=5) == ("hello", "refuse") and got.empty()  # never tried again


def test_retries_end_with_the_connect_timeout_and_fail_the_request_with_the_last_reason() -> None:
    got, inbox, _client, t0 = run_client(["close"] * 1000, timeout=2)
    kind, seq, reason = inbox.get(timeout=10)
    took = time.monotonic() - t0
    assert (kind, seq) == ("fail", "r1") and "broke off" in reason, reason
    assert 1.0 < took < 15.0, took  # ends with the 2 s connect timeout, not at the first break (loaded hosts: slack)
    assert got.qsize() >= 3, "gave up without trying again"
    assert got.qsize() <= 12, "retried without backing off (0.05 s doubling to 1 s: about 6 tries in 2 s)"


@pytest.mark.parametrize(("lease", "read"), [(30.0, 30.0), (0.5, 0.5), (1, 1.0), (0, None), (-3, None), ("30", None),
                                             (None, None), ([30], None)])
def test_the_prefills_lease_is_taken_only_when_it_is_a_positive_number(lease: Any, read: float | None) -> None:
    got, _inbox, client, _ = run_client([f"lease={json.dumps(lease)}"])
    assert got.get(timeout=10) == ("hello", f"lease={json.dumps(lease)}")
    assert proto.as_lists(got.get(timeout=10)) == ["msg", DST]  # connected: the welcome was taken
    assert client.peer_lease == read and not client.dead
    client.close()
    for conn in KEPT:
        conn.close()


def test_before_its_welcome_a_client_knows_no_lease() -> None:
    got, _, client, _ = run_client(["silent"], timeout=5)
    assert got.get(timeout=10) == ("hello", "silent")
    assert client.peer_lease is None and client.peer_engine is None
    client.close()


def test_a_silent_prefill_fails_the_request_within_the_connect_timeout() -> None:
    """A prefill that takes the connection and never sends its challenge: each attempt's read is bounded by what
    is left of the connect timeout (0.3 s), so the waiting request fails within it, not at a fixed floor."""
    _got, inbox, _client, t0 = run_client(["silent"] * 100, timeout=0.3)
    kind, seq, reason = inbox.get(timeout=10)
    took = time.monotonic() - t0
    assert (kind, seq) == ("fail", "r1") and "broke off" in reason and "timed out" in reason, reason
    assert took < 1.0, took
    for conn in KEPT:
        conn.close()


@pytest.mark.parametrize(("answer", "why"), [
    ("huge-challenge", f"peer announced a {4 * 2**20 + 1}-byte message (limit {4 * 2**20})"),
    ("huge-welcome", f"peer announced a {4 * 2**20 + 1}-byte message (limit {4 * 2**20})"),
    ("not-a-challenge", "unexpected handshake opening 'welcome'"),
    ("refuse-long", "refused us: " + "r" * 2000),
])
def test_what_a_prefill_opens_with_is_bounded_and_checked_and_its_refusal_cut(answer: str, why: str) -> None:
    got, inbox, client, t0 = run_client([answer] * 3)
    kind, seq, reason = inbox.get(timeout=10)
    assert (kind, seq) == ("fail", "r1") and client.dead
    assert reason.endswith(why) if answer == "refuse-long" else why in reason, reason
    assert time.monotonic() - t0 < 3  # at once: not tried again
    assert got.get(timeout=5) == ("hello", answer) and got.empty()
    for conn in KEPT:
        conn.close()


def _connected(answers: list[str], worker: bool = False) -> tuple[Any, queue.Queue[Any], socket.socket]:
    """A client connected to a fake prefill (welcome): (client, its inbox, the prefill's end of the connection)."""
    KEPT.clear()
    got, inbox, client, _ = run_client(answers, worker=worker)
    assert got.get(timeout=10) == ("hello", "welcome")
    assert proto.as_lists(got.get(timeout=10)) == ["msg", DST]
    if not worker:
        assert inbox.get(timeout=5)[0] == "senders"
    return client, inbox, KEPT[-1]


def test_what_a_prefill_sends_is_checked_bounded_and_delivered_exactly_and_its_loss_reported() -> None:
    client, inbox, prefill = _connected(["welcome"])
    at = ("127.0.0.1", client.port)
    long_id = "i" * proto.MAX_ID_CHARS
    for msg in (
        {"type": "fail", "seqs": ["a", "b"], "reason": "x" * 3000},
        {"type": "fail", "seqs": ["c"]},  # no reason
        {"type": "fail", "seqs": "not-a-list"},  # dropped, and the reader goes on
        {"type": "ready", "xfers": "not-a-list"},  # dropped
        {"type": "ready", "xfers": ["x1", "x2"]},
        {"type": "first", "xfer": "y", "token": 0},
        {"type": "first", "xfer": long_id, "token": (1 << 31) - 1},
        {"type": "first", "xfer": "", "token": 1},  # dropped: no transfer id
        {"type": "first", "xfer": long_id + "i", "token": 1},  # dropped: too long
        {"type": "first", "xfer": "z", "token": 1 << 31},  # dropped: past 31 bits
        {"type": "first", "xfer": "z", "token": -1},  # dropped
        {"type": "first", "xfer": "z", "token": True},  # dropped: a bool is no token
        {"type": "ping", "token": 123},  # not a string: no pong
        {"type": "ping", "token": "t" * 129},  # longer than a token may be: no pong
        {"type": "ping", "token": "t" * 128},
        {"type": "ping", "token": "t1"},
    ):
        proto.send_message(prefill, msg)
    assert proto.recv_message(prefill) == {"type": "pong", "token": "t" * 128}
    assert proto.recv_message(prefill) == {"type": "pong", "token": "t1"}
    events = [inbox.get(timeout=5) for _ in range(6)]
    assert events == [
        ("fail", "a", "x" * 2000), ("fail", "b", "x" * 2000), ("fail", "c", "prefill failed"),
        ("ready", at, ["x1", "x2"]), ("first", at, "y", 0), ("first", at, long_id, (1 << 31) - 1),
    ]
    assert inbox.empty() and not client.dead
    prefill.close()  # the prefill goes away: the decode learns it, once
    kind, where, reason = inbox.get(timeout=5)
    assert (kind, where) == ("lost", at) and reason.startswith(f"side channel to prefill 127.0.0.1:{client.port} lost: ")
    assert client.error == reason
    time.sleep(0.2)
    assert inbox.empty()


def test_our_own_close_reports_no_lost_prefill() -> None:
    client, inbox, prefill = _connected(["welcome"])
    client.close()
    time.sleep(0.3)
    assert inbox.empty() and client.error == "closed"
    prefill.close()


def test_a_worker_link_answers_every_ping_skips_garbage_and_reports_no_loss() -> None:
    client, inbox, prefill = _connected(["welcome"], worker=True)
    for i in range(3):
        body = b"{not json"
        prefill.sendall(struct.pack("!I", len(body)) + body)  # dropped
        proto.send_message(prefill, {"type": "ping", "token": f"t{i}"})
        assert proto.recv_message(prefill) == {"type": "pong", "token": f"t{i}"}
    prefill.sendall(struct.pack("!I", proto.MAX_HELLO + 1))  # more than a worker link takes: it ends at once
    deadline = time.monotonic() + 3
    while not client.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.dead and "announced" in client.error
    time.sleep(0.2)
    assert inbox.empty()  # a worker link's loss fails nothing
    prefill.close()


def test_retries_are_logged_once_as_a_warning_then_quietly_and_paced(caplog) -> None:
    import logging

    caplog.set_level(logging.DEBUG, logger="vllm.kvtransport")
    got, _inbox, client, _ = run_client(["close"] * 3 + ["welcome"])
    for _ in range(4):
        got.get(timeout=10)
    assert proto.as_lists(got.get(timeout=10)) == ["msg", DST]
    retries = [r for r in caplog.records if "retrying for" in r.getMessage()]
    assert [r.levelno for r in retries] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "broke off" in retries[0].getMessage()
    client.close()
    for conn in KEPT:
        conn.close()


def test_a_late_attempt_reads_only_for_what_is_left_of_the_connect_timeout() -> None:
    """Four attempts break off (at ~0, 0.05, 0.15, 0.35 s), the fifth (~0.75 s) meets a silent prefill: its read is
    bounded by what is left of the 1-s connect timeout, so the request fails at ~1 s, not a full timeout later."""
    _got, inbox, _client, t0 = run_client(["close"] * 4 + ["silent"] * 10, timeout=1.0)
    kind, seq, reason = inbox.get(timeout=10)
    took = time.monotonic() - t0
    assert (kind, seq) == ("fail", "r1") and "timed out" in reason, reason
    assert 0.7 < took < 1.5, took
    for conn in KEPT:
        conn.close()
