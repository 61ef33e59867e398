"""KV_TRANSPORT_SECRET proves both ends: a sender with a secret refuses a receiver without one (its metadata is
not sealed, and it cannot answer the sender's nonce), a receiver with one refuses a sender without it, and a
captured handshake replayed later is refused on either side. Over the in-process reference backend and the
real ucx and nccl (gloo) backends, sender and receiver in this process."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

import kvtransport as kt
from kvtransport import registry, wire
from kvtransport.sidechannel import FramedSocket
from kvtransport.workload.caches import CacheSpec, HostCache

SPEC = CacheSpec(num_layers=2, num_blocks=8, heads=2, block_size=4, head_dim=8, order="NHD")
BACKENDS = ["inproc"] + [
    pytest.param(b, marks=pytest.mark.skipif(not registry.probe(b).ok, reason=f"{b}: {registry.probe(b).reason}"))
    for b in ("ucx", "nccl")]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _open(backend: str, secret: str | None = None) -> kt.CommManager:
    return kt.open(HostCache(SPEC).layout, backend=backend, secret=secret, timeout=5)


def test_a_sender_with_a_secret_refuses_a_receiver_without_one(backend: str) -> None:
    with _open(backend) as open_receiver, _open(backend, "s3cret") as sender:
        with pytest.raises(kt.ProtocolError, match="not sealed with our KV_TRANSPORT_SECRET"):
            sender.connect(open_receiver.metadata())
        assert open_receiver._admission.stats.accepted == 0  # refused before any connection


def test_a_receiver_with_a_secret_refuses_a_sender_without_it(backend: str) -> None:
    with _open(backend, "s3cret") as receiver, _open(backend) as sender:
        with pytest.raises(kt.ProtocolError, match="authentication failed"):
            sender.connect(receiver.metadata())
        assert receiver.stats()["refused_peers"] == 1 and receiver.inbound_peers() == []


def test_sealed_metadata_that_was_altered_is_refused(backend: str) -> None:
    with _open(backend, "s3cret") as receiver, _open(backend, "s3cret") as sender:
        meta = bytearray(receiver.metadata())
        i = meta.index(b'"capacity":') + len(b'"capacity":')
        meta[i] = ord("9")  # 1024 -> 9024
        with pytest.raises(kt.ProtocolError, match="altered"):
            sender.connect(bytes(meta))
        sender.connect(receiver.metadata())  # the genuine one still works


def test_sealed_metadata_whose_backend_part_was_altered_never_reaches_the_backend(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's part of sealed metadata (``transport``: a ucx worker address, nccl's process-group kind)
    altered under the original seal: refused as altered before the sender's backend sees any of it."""
    with _open(backend, "s3cret") as receiver, _open(backend, "s3cret") as sender:
        genuine = receiver.metadata()
        tag = genuine.rpartition(b"\0")[2]
        fields = wire.decode_metadata(genuine, b"s3cret")
        fields["transport"] = {**fields["transport"], "altered": True}
        forged = wire.encode_metadata(fields) + b"\0" + tag
        dialed: list[Any] = []
        real_dial = sender.transport.dial

        def spy_dial(info: Any) -> Any:
            dialed.append(info)
            return real_dial(info)

        monkeypatch.setattr(sender.transport, "dial", spy_dial)
        with pytest.raises(kt.ProtocolError, match="altered"):
            sender.connect(forged)
        assert dialed == [] and receiver._admission.stats.accepted == 0
        sender.connect(genuine)  # the genuine one still works
        assert len(dialed) == 1


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


def test_a_replayed_hello_is_refused(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An eavesdropper that captured a sender's HELLO cannot replay it: the receiver's CHALLENGE nonce is
    fresh for every connection, and the HELLO's HMAC covers it."""
    with _open(backend, "s3cret") as receiver, _open(backend, "s3cret") as sender:
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


def test_a_replayed_welcome_is_refused(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake receiver that replays a genuine receiver's WELCOME (on the genuine one's address, after it went
    away) does not fool a sender: the WELCOME must prove the secret over the sender's own fresh nonce."""
    receiver = _open(backend, "s3cret")
    meta = receiver.metadata()
    info = wire.decode_metadata(meta)
    with _open(backend, "s3cret") as sender:
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
