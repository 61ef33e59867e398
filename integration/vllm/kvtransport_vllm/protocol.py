"""The connector's scheduler-to-scheduler side channel: versioned, length-prefixed JSON messages.

Handshake (both sides prove ``KV_TRANSPORT_SECRET`` when it is set, with the core's HMAC, ``kvtransport.wire``)::

    server -> client  {"type": "challenge", "version", "nonce": server nonce}          (nothing else)
    client -> server  sealed hello: SEALED, HMAC(secret, server nonce, body) (32 bytes), body (JSON)
                      body: engine id, compatibility hash, its workers' kvtransport metadata, a client nonce
    server -> client  sealed welcome (HMAC over the client nonce: the server proves it too), or
                      {"type": "refuse", "reason"}: a peer that did not prove the secret gets ``REFUSED`` and
                      nothing else; an authenticated incompatible one the *names* of the differing fields

A sealed frame is bytes, not JSON: its HMAC is checked over the raw body before anything of it is parsed (a
stranger's frame costs the bytes it sent and nothing more). Before it proves the secret a peer may send one
frame of at most ``MAX_HELLO`` bytes within the handshake timeout; after, frames of at most ``MAX_MESSAGE``.
Every JSON frame passes :func:`guard_json` before ``json.loads``: its containers and strings are counted on the
raw bytes, so what a parse can allocate is bounded by the frame (see the limits below and docs/notes.md). A prefill's welcome names its workers' destination channels (``worker_at``); a decode opens one
to each (the same handshake, without the compatibility check, which the scheduler's channel made) and sends its
``dst`` messages there too, so they reach the workers without the prefill's engine loop. Then the client sends
``dst`` / ``cancel`` / ``renew`` messages (checked by :func:`check_message`;
a malformed one is dropped, the connection stays), the server sends ``fail``, ``ready``, ``first`` (the first
token a prefill request sampled, which the decode continues from) and ``ping`` with a token, which the client
answers with a ``pong`` carrying it: an engine id belongs to the connection that answers (see
``SideChannelServer``).
Pure Python, no vLLM import.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import socket
import struct
from collections.abc import Mapping
from typing import Any

from kvtransport import wire
from kvtransport.errors import KVTransportError

PROTOCOL_VERSION = 4
MAX_MESSAGE = 8 << 20
"""Bytes of one message after the handshake. The largest the protocol needs is one ``dst`` of a request of the
longest context: 1M tokens at block size 16 are 65,536 block ids of at most 13 digits (~0.9 MiB), or with
MAX_GROUPS hybrid groups ~2 MiB; 8 MiB leaves room for parallel-sampling children. Was 64 MiB: one message of
empty objects then cost the receiver ~1.7 GB to parse."""
MAX_HELLO = 4 << 20
"""Bytes an unauthenticated peer may send (its one hello frame, carrying up to 1,024 workers' metadata)."""
MAX_CONTAINERS = 65536
"""Objects and arrays (``{`` and ``[`` on the raw bytes, strings included) in one JSON frame. A ``dst`` needs
three per destination (itself, its blocks, its groups) plus one per group: MAX_IDS destinations of a plain model
are 12,288. Each costs the parser 56-64 bytes or more, so this bounds them to ~4 MiB per frame."""
MAX_STRINGS = 131072
"""Double quotes in one JSON frame (two per string; escaped ones counted too). A ``dst`` has ~10 per
destination (keys and its ``seq``); a hello's JSON-in-JSON a few per worker. Each string costs the parser
~50 bytes or more: ~3 MiB per frame."""
SEALED = b"KVS1"
"""First bytes of a sealed frame (then the 32-byte HMAC, zeros without a secret, then the JSON body)."""
MAX_IDS = 4096
"""Destinations, sequence ids or transfer ids in one message."""
MAX_BLOCKS = 1 << 20
"""Block ids in one destination."""
MAX_ID_CHARS = 512
MAX_GROUPS = 16
"""KV cache groups beyond the first in one destination (hybrid models)."""
REFUSED = "refused: this peer did not prove KV_TRANSPORT_SECRET (set the same secret on both sides)"
_HEADER = struct.Struct("!I")


class ProtocolFailure(Exception):
    """Malformed or oversized side-channel data, or a closed connection."""


class MalformedMessage(ProtocolFailure):
    """One well-framed message that is not valid: the stream is still in sync, the message is dropped."""


class AuthFailure(ProtocolFailure):
    """The peer did not prove the shared secret."""


class ConnectionClosed(ProtocolFailure):
    """The peer closed the connection (end of stream before a whole message)."""


def guard_json(raw: bytes) -> None:
    """Refuse a JSON frame whose parse could cost more than a bounded multiple of its size: more than
    MAX_CONTAINERS objects and arrays or MAX_STRINGS/2 strings, counted on the raw bytes (a count, not a parse).
    Numbers are bounded by the frame (a list of small integers costs 4x its text, of large ones up to 7x; only
    an authenticated peer gets to send MAX_MESSAGE bytes). Raises MalformedMessage."""
    if raw.count(b"{") + raw.count(b"[") > MAX_CONTAINERS:
        raise MalformedMessage(f"more than {MAX_CONTAINERS} objects and arrays in one message")
    if raw.count(b'"') > MAX_STRINGS:
        raise MalformedMessage(f"more than {MAX_STRINGS // 2} strings in one message")


def encode_message(msg: Mapping[str, Any]) -> bytes:
    """One message as it goes on the wire (length prefix and JSON). Raises ProtocolFailure when too large."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolFailure(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    """Send one message (blocking; the socket's timeout applies). Raises OSError or ProtocolFailure."""
    sock.sendall(encode_message(msg))


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one frame of raw ``payload`` (a sealed message; blocking, the socket's timeout applies)."""
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes, read into one buffer (a frame costs its size once, not once per copy)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionClosed("connection closed by peer")
        got += k
    view.release()
    return buf  # type: ignore[return-value]  # a bytearray: json.loads and bytes.count take it as it is


def recv_frame(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytes:
    """The payload of one frame of at most ``limit`` bytes, unparsed (blocking; the socket's timeout applies).
    Raises ProtocolFailure (oversized: not read), ConnectionClosed or OSError."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise ProtocolFailure(f"peer announced a {size}-byte message (limit {limit})")
    return _recv_exact(sock, size)


def recv_message(sock: socket.socket, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    """Read one JSON message of at most ``limit`` bytes (blocking; the socket's timeout applies). Raises
    MalformedMessage (frame consumed: the stream is in sync), ProtocolFailure (oversized: not read) or OSError."""
    return parse_message(recv_frame(sock, limit))


def check_senders(raw: Any) -> dict[int, str]:
    """A welcome's ``senders`` (tp rank -> kvtransport instance id) as {int: str}; what does not fit (types,
    more than MAX_IDS entries, ids of more than 64 characters) is left out. Never raises."""
    if not isinstance(raw, dict) or len(raw) > MAX_IDS:
        return {}
    out: dict[int, str] = {}
    for rank, instance in raw.items():
        if isinstance(rank, str) and rank.isdigit() and isinstance(instance, str) and 0 < len(instance) <= 64:
            out[int(rank)] = instance
    return out


MAX_WORKER_LINKS = 64
"""Prefill workers a decode opens a direct destination channel to (per prefill engine); a welcome naming more
is trimmed to the lowest ranks (the rest still get their destinations through the prefill's scheduler)."""


def check_worker_at(raw: Any) -> dict[int, tuple[str, int]]:
    """A welcome's ``worker_at`` (tp rank -> [host, port] of that prefill worker's destination channel) as
    {int: (str, int)}: what does not fit (types, a host that is not an IP address or a hostname of at most 253
    characters, a port outside 1..65535) is left out, and at most MAX_WORKER_LINKS ranks are kept. Never
    raises."""
    import ipaddress
    import re

    if not isinstance(raw, dict):
        return {}
    out: dict[int, tuple[str, int]] = {}
    for rank, at in raw.items():
        if not (isinstance(rank, str) and rank.isdigit() and len(rank) <= 4 and isinstance(at, list)
                and len(at) == 2):
            continue
        host, port = at
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            continue
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not (0 < len(host) <= 253 and re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host)):
                continue
        out[int(rank)] = (host, port)
    return dict(sorted(out.items())[:MAX_WORKER_LINKS])


def parse_message(raw: bytes) -> dict[str, Any]:
    """A JSON object with a string ``type``, parsed only after :func:`guard_json` passed. Raises
    MalformedMessage."""
    guard_json(raw)
    try:
        msg = json.loads(raw)
    except ValueError as exc:
        raise MalformedMessage(f"malformed message: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise MalformedMessage("message is not an object with a 'type'")
    return msg


def new_nonce() -> bytes:
    import secrets

    return secrets.token_bytes(16)


def parse_nonce(value: Any) -> bytes:
    """A peer's nonce (hex, 16 to 64 bytes). Raises ProtocolFailure."""
    try:
        nonce = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        nonce = b""
    if not 16 <= len(nonce) <= 64:
        raise ProtocolFailure("malformed nonce")
    return nonce


_NO_TAG = bytes(32)


def seal(msg: Mapping[str, Any], secret: bytes | None, nonce: bytes) -> bytes:
    """``msg`` as a sealed frame's payload: SEALED, its HMAC over the peer's ``nonce`` and the body (32 zero
    bytes without a secret), the JSON body. Send it with :func:`send_frame`."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    tag = bytes.fromhex(wire.auth_tag(secret, nonce, body)) if secret is not None else _NO_TAG
    return SEALED + tag + body


def is_sealed(payload: bytes) -> bool:
    return payload[:len(SEALED)] == SEALED


def unseal(payload: bytes, secret: bytes | None, nonce: bytes) -> dict[str, Any]:
    """The message inside a sealed frame's ``payload``. Raises AuthFailure when a secret is set and the HMAC over
    our ``nonce`` is wrong (checked on the raw bytes before any of them is parsed) or the frame is not sealed,
    MalformedMessage for a bad body."""
    if not is_sealed(payload) or len(payload) < len(SEALED) + 32:
        raise AuthFailure("unsealed frame") if secret is not None else MalformedMessage("unsealed frame")
    tag, body = payload[len(SEALED):len(SEALED) + 32], payload[len(SEALED) + 32:]
    if secret is not None and not wire.auth_ok(secret, nonce, body, tag.hex()):
        raise AuthFailure("wrong or missing HMAC")
    return parse_message(body)


def _ident(value: Any, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise MalformedMessage(f"{what} must be a string or an integer")
    text = str(value)
    if not 0 < len(text) <= MAX_ID_CHARS:
        raise MalformedMessage(f"{what} must have 1 to {MAX_ID_CHARS} characters")
    return text


def _count(value: Any, what: str, limit: int = 1 << 62) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
        raise MalformedMessage(f"{what} must be an integer in [0, {limit})")
    return value


def _items(value: Any, what: str, limit: int = MAX_IDS) -> list[Any]:
    if not isinstance(value, list) or len(value) > limit:
        raise MalformedMessage(f"{what} must be a list of at most {limit} items")
    return value


def check_message(msg: Mapping[str, Any]) -> dict[str, Any]:
    """A decode's ``dst`` / ``cancel`` / ``renew`` / ``pong`` message with every field checked (types, ranges, sizes) and
    normalised (ids as strings). Raises MalformedMessage; called on the server's reader thread, so nothing
    malformed reaches the scheduler."""
    mtype = msg.get("type")
    mode = msg.get("mode")
    if mode is not None and mode not in ("push", "pull"):
        raise MalformedMessage("mode must be 'push' or 'pull'")
    if mtype == "pong":  # the answer to a ping: proves the connection's peer is alive (SideChannelServer)
        token = msg.get("token")
        if not isinstance(token, str) or len(token) > 128:
            raise MalformedMessage("pong without a token")
        return {"type": "pong", "token": token}
    if mtype == "renew":
        return {"type": "renew", "xfers": [_ident(x, "xfer") for x in _items(msg.get("xfers"), "xfers")]}
    xfer = _ident(msg.get("xfer"), "xfer")
    if mtype == "dst":
        dsts = []
        for d in _items(msg.get("dsts"), "dsts"):
            if not isinstance(d, dict):
                raise MalformedMessage("a destination must be an object")
            blocks = [_count(b, "block id", 1 << 40) for b in _items(d.get("blocks"), "blocks", MAX_BLOCKS)]
            groups = [[_count(b, "block id", 1 << 40) for b in _items(g, "blocks", MAX_BLOCKS)]
                      for g in _items(d.get("groups", []), "groups", MAX_GROUPS)]
            dst = {"seq": _ident(d.get("seq"), "seq"), "blocks": blocks,
                   "offset": _count(d.get("offset", 0), "offset", 1 << 40)}
            if groups:  # hybrid models: the blocks of KV cache groups 1.., aligned with ``blocks``
                dst["groups"] = groups
            dsts.append(dst)
        return {"type": "dst", "xfer": xfer, "mode": mode, "dsts": dsts}
    if mtype == "cancel":
        return {"type": "cancel", "xfer": xfer, "mode": mode,
                "seqs": [_ident(s, "seq") for s in _items(msg.get("seqs", []), "seqs")],
                "count": _count(msg.get("count", 0), "count", MAX_IDS)}
    raise MalformedMessage(f"unknown message type {str(mtype)[:32]!r}")


def check_hello(hello: Mapping[str, Any]) -> dict[str, Any]:
    """A decode's hello with its workers' metadata decoded and validated by the core's own
    ``kvtransport.wire.decode_metadata`` (what ``connect()`` would reject is rejected here, before the
    scheduler keeps it): ``workers`` becomes ``{rank: metadata bytes}``. Raises MalformedMessage."""
    out = dict(hello)
    out["engine_id"] = _ident(hello.get("engine_id"), "engine_id")
    tp = hello.get("tp_size", 1)
    out["tp_size"] = _count(tp, "tp_size", 1025) if tp is not None else 1
    raw = hello.get("workers") or {}
    if not isinstance(raw, dict) or len(raw) > 1024:
        raise MalformedMessage("workers must be an object of at most 1024 ranks")
    workers: dict[int, bytes] = {}
    for rank, meta in raw.items():
        try:
            r = int(rank)
            data = base64.b64decode(meta.encode(), validate=True) if isinstance(meta, str) else None
        except (ValueError, binascii.Error):
            raise MalformedMessage(f"worker {str(rank)[:16]!r}: bad rank or base64") from None
        if data is None or not 0 <= r < 1024:
            raise MalformedMessage(f"worker {str(rank)[:16]!r}: bad rank or metadata")
        try:
            wire.decode_metadata(data)
        except KVTransportError as exc:
            raise MalformedMessage(f"worker {r}: {exc}") from None
        workers[r] = data
    out["workers"] = workers
    return out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()



def compat_hash(info: Mapping[str, Any]) -> str:
    """Stable digest of the compatibility fields (model, dtype, layers, heads, block size, layout, backend...)."""
    blob = json.dumps(info, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def describe_mismatch(ours: Mapping[str, Any], theirs: Mapping[str, Any], values: bool = True) -> str:
    """The differing compatibility fields, in words (with both sides' values, or only their names)."""
    keys = sorted(set(ours) | set(theirs))
    if not values:
        return ", ".join(k for k in keys if ours.get(k) != theirs.get(k)) or "hashes differ"
    diffs = [f"{k}: ours={ours.get(k)!r} peer={theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]
    return "; ".join(diffs) or "hashes differ"
