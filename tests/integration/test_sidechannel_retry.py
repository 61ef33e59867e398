"""A decode's side-channel client meets a busy prefill: a handshake that breaks off before the welcome (reset,
closed, or refused with ``retry``) is tried again within the connect timeout instead of failing the waiting
requests; what cannot pass later (a refusal, another secret) still fails them at once. Fake prefills on loopback."""

from __future__ import annotations

import queue
import socket
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
    close after the hello), "refuse-retry" / "refuse" (a refusal with / without ``retry``), "welcome" (then
    forwards what it receives to ``got``)."""
    for answer in answers:
        conn, _ = lsock.accept()
        conn.settimeout(10)
        proto.send_message(conn, {"type": "challenge", "version": proto.PROTOCOL_VERSION,
                                  "nonce": proto.new_nonce().hex()})
        sealed = proto.unseal(proto.recv_frame(conn), None, b"")  # (the HMAC not checked: a fake prefill)
        got.put(("hello", answer))
        if answer == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()
        elif answer == "close":
            conn.close()
        elif answer.startswith("refuse"):
            proto.send_message(conn, {"type": "refuse", "version": proto.PROTOCOL_VERSION,
                                      "reason": "engine id decode-R is already connected",
                                      "retry": answer == "refuse-retry"})
            conn.close()
        else:
            welcome = {"type": "welcome", "version": proto.PROTOCOL_VERSION, "engine_id": "prefill-P",
                       "compat": COMPAT, "compat_info": COMPAT_INFO, "lease": 30.0, "senders": {"0": "w0"}}
            proto.send_frame(conn, proto.seal(welcome, SECRET, bytes.fromhex(sealed["nonce"])))
            got.put(("msg", proto.recv_message(conn)))
            KEPT.append(conn)  # stays open: the test ends it


def run_client(answers: list[str], timeout: float = 10) -> tuple[queue.Queue[Any], queue.Queue[Any], Any, float]:
    lsock = socket.create_server(("127.0.0.1", 0))
    got: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=fake_prefill, args=(lsock, answers, got), daemon=True).start()
    inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
    t0 = time.monotonic()
    client = sc.PeerClient("127.0.0.1", lsock.getsockname()[1], hello, compat, inbox, timeout=timeout,
                           secret=SECRET)
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
