"""KV_TRANSPORT_SECRET proves both ends: a sender with a secret refuses a receiver without one (its metadata is
not sealed, and it cannot answer the sender's nonce), a receiver with one refuses a sender without it, and a
captured handshake replayed later is refused on either side."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

import kvtransport as kt
from kvtransport import wire
from kvtransport.sidechannel import FramedSocket
from kvtransport.testing.cache import CacheSpec, HostCache

SPEC = CacheSpec(num_layers=2, num_blocks=8, heads=2, block_size=4, head_dim=8, order="NHD")


def _open(secret: str | None = None) -> kt.CommManager:
    return kt.open(HostCache(SPEC).layout, backend="inproc", secret=secret, timeout=5)


def test_a_sender_with_a_secret_refuses_a_receiver_without_one() -> None:
    with _open() as open_receiver, _open("s3cret") as sender:
        with pytest.raises(kt.ProtocolError, match="not sealed with our KV_TRANSPORT_SECRET"):
            sender.connect(open_receiver.metadata())
        assert open_receiver._admission.stats.accepted == 0  # refused before any connection


def test_a_receiver_with_a_secret_refuses_a_sender_without_it() -> None:
    with _open("s3cret") as receiver, _open() as sender:
        with pytest.raises(kt.ProtocolError, match="authentication failed"):
            sender.connect(receiver.metadata())
        assert receiver.stats()["refused_peers"] == 1 and receiver.inbound_peers() == []


def test_sealed_metadata_that_was_altered_is_refused() -> None:
    with _open("s3cret") as receiver, _open("s3cret") as sender:
        meta = bytearray(receiver.metadata())
        i = meta.index(b'"capacity":') + len(b'"capacity":')
        meta[i] = ord("9")  # 1024 -> 9024
        with pytest.raises(kt.ProtocolError, match="altered"):
            sender.connect(bytes(meta))
        sender.connect(receiver.metadata())  # the genuine one still works


def _record(monkeypatch: pytest.MonkeyPatch, what: str) -> list[bytes]:
    """Frames of type ``what`` that pass through any FramedSocket in this process (sent or received)."""
    seen: list[bytes] = []
    send, recv = FramedSocket.send, FramedSocket.recv

    def spy_send(self: FramedSocket, kind: wire.FrameType, payload: bytes = b"") -> None:
        if kind.name == what:
            seen.append(wire.frame(kind, payload))
        send(self, kind, payload)

    def spy_recv(self: FramedSocket, deadline: float | None = None) -> tuple[wire.FrameType, bytes]:
        kind, payload = recv(self, deadline)
        if kind.name == what:
            seen.append(wire.frame(kind, payload))
        return kind, payload

    monkeypatch.setattr(FramedSocket, "send", spy_send)
    monkeypatch.setattr(FramedSocket, "recv", spy_recv)
    return seen


def test_a_replayed_hello_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eavesdropper that captured a sender's HELLO cannot replay it: the receiver's CHALLENGE nonce is
    fresh for every connection, and the HELLO's HMAC covers it."""
    with _open("s3cret") as receiver, _open("s3cret") as sender:
        hellos = _record(monkeypatch, "HELLO")
        sender.connect(receiver.metadata())
        assert hellos
        info = wire.decode_metadata(receiver.metadata())
        with socket.create_connection((info["host"], info["port"]), timeout=5) as raw:
            conn = FramedSocket(raw, "replay", 5)
            kind, _ = conn.recv(time.monotonic() + 5)
            assert kind == wire.FrameType.CHALLENGE
            raw.sendall(hellos[0])
            kind, payload = conn.recv(time.monotonic() + 5)
        assert kind == wire.FrameType.REFUSE and b"authentication failed" in payload
        assert receiver.stats()["refused_peers"] == 1 and len(receiver.inbound_peers()) == 1


def test_a_replayed_welcome_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake receiver that replays a genuine receiver's WELCOME (on the genuine one's address, after it went
    away) does not fool a sender: the WELCOME must prove the secret over the sender's own fresh nonce."""
    receiver = _open("s3cret")
    meta = receiver.metadata()
    info = wire.decode_metadata(meta)
    with _open("s3cret") as sender:
        welcomes = _record(monkeypatch, "WELCOME")
        sender.connect(meta)
        assert welcomes  # (sent and received in this process: the same frame twice)
        receiver.close()
        monkeypatch.undo()
        fake = socket.create_server((info["host"], info["port"]))
        got: dict[str, Any] = {}

        def serve() -> None:
            c, _ = fake.accept()
            with c:
                c.sendall(wire.frame(wire.FrameType.CHALLENGE, wire.json_payload({"nonce": "00" * 16})))
                conn = FramedSocket(c, "fake", 5)
                got["hello"] = conn.recv(time.monotonic() + 5)[0]
                c.sendall(welcomes[0])
                time.sleep(0.5)

        t = threading.Thread(target=serve)
        t.start()
        try:
            with pytest.raises(kt.ProtocolError, match="did not prove KV_TRANSPORT_SECRET"):
                sender.connect(meta)
        finally:
            t.join(5)
            fake.close()
        assert got["hello"] == wire.FrameType.HELLO
