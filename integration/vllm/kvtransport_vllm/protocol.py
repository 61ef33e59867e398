"""The connector's scheduler-to-scheduler side channel: versioned, length-prefixed JSON messages (a ``dst``
goes PACKED: a JSON header, then its block ids as u32).

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
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvtransport import wire
from kvtransport.errors import KVTransportError

PROTOCOL_VERSION = 5
MAX_MESSAGE = 8 << 20
"""Bytes of one message after the handshake. The largest the protocol needs is one ``dst`` of a request of the
longest context: 1M tokens at block size 16 are 65,536 block ids (256 KiB packed), or with MAX_GROUPS hybrid
groups ~4.3 MiB; 8 MiB leaves room for parallel-sampling children. Was 64 MiB: one message of empty objects
then cost the receiver ~1.7 GB to parse."""
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
MAX_COMMAS = 65536
"""Commas in one JSON frame: a bound on its numbers (each costs the parser 8 bytes of list slot and up to 32 of
int or float object for 2-4 bytes of text: an 8 MiB list of integers cost ~9x its size). Every list of block ids
goes packed (PACKED); the JSON messages left need a few per id (a ``renew`` of MAX_IDS transfers: 4,096)."""
PACKED = b"KVP1"
"""First bytes of a ``dst`` frame: then the JSON header's length (u32, little-endian), the JSON header (each
destination's ``blocks`` and ``groups`` replaced by their lengths, ``n`` and ``g``), then every block id as a
little-endian u32, destination by destination (its blocks, then each group's). The ids become ``array('I')``
of 4 bytes each: the frame costs its receiver about its size again, not 9x (block ids as JSON numbers)."""
MAX_PACKED_HEADER = 2 << 20
"""Bytes of a packed frame's JSON header (MAX_IDS destinations with ids of up to MAX_ID_CHARS characters)."""
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
_PACKED_LEN = struct.Struct("<I")
_U32 = "I"
assert array(_U32).itemsize == 4, "this platform's array('I') is not 4 bytes"


class ProtocolFailure(Exception):
    """Malformed or oversized side-channel data, or a closed connection."""


class MalformedMessage(ProtocolFailure):
    """One well-framed message that is not valid: the stream is still in sync, the message is dropped."""


class AuthFailure(ProtocolFailure):
    """The peer did not prove the shared secret."""


class ConnectionClosed(ProtocolFailure):
    """The peer closed the connection (end of stream before a whole message)."""


def guard_json(raw: bytes | bytearray) -> None:
    """Refuse a JSON frame whose parse could cost more than a bounded multiple of its size: more than
    MAX_CONTAINERS objects and arrays or MAX_STRINGS/2 strings, counted on the raw bytes (a count, not a parse).
    Numbers are bounded by MAX_COMMAS. Raises MalformedMessage."""
    if raw.count(b"{") + raw.count(b"[") > MAX_CONTAINERS:
        raise MalformedMessage(f"more than {MAX_CONTAINERS} objects and arrays in one message")
    if raw.count(b'"') > MAX_STRINGS:
        raise MalformedMessage(f"more than {MAX_STRINGS // 2} strings in one message")
    if raw.count(b",") > MAX_COMMAS:
        raise MalformedMessage(f"more than {MAX_COMMAS} commas in one message (lists of block ids go packed)")


def _pack_dst(msg: Mapping[str, Any]) -> bytes:
    """A ``dst`` message as a PACKED frame's payload. Raises ProtocolFailure for a block id outside u32."""
    ids: array[int] = array(_U32)
    dsts = []
    try:
        for d in msg.get("dsts", []):
            entry = {k: v for k, v in d.items() if k not in ("blocks", "groups")}
            blocks, groups = d.get("blocks", ()), d.get("groups", ())
            entry["n"] = len(blocks)
            ids.extend(blocks)
            if groups:
                entry["g"] = [len(g) for g in groups]
                for g in groups:
                    ids.extend(g)
            dsts.append(entry)
    except (OverflowError, TypeError) as exc:
        raise ProtocolFailure(f"a block id does not fit the protocol's u32: {exc}") from None
    header = json.dumps({**{k: v for k, v in msg.items() if k != "dsts"}, "dsts": dsts},
                        separators=(",", ":")).encode()
    if sys.byteorder != "little":
        ids.byteswap()
    return PACKED + _PACKED_LEN.pack(len(header)) + header + ids.tobytes()


def _packed_header(header: bytes | bytearray, tail_bytes: int) -> tuple[dict[str, Any], list[int]]:
    """A PACKED frame's JSON header parsed (guarded) and the length of each block id list it announces, in
    frame order; checked to add up to ``tail_bytes``. Raises MalformedMessage."""
    msg = _json_object(header)
    dsts = msg.get("dsts")
    if msg.get("type") != "dst" or not isinstance(dsts, list) or len(dsts) > MAX_IDS:
        raise MalformedMessage("a packed frame carries one dst message of at most MAX_IDS destinations")
    counts: list[int] = []
    for d in dsts:
        if not isinstance(d, dict):
            raise MalformedMessage("a destination must be an object")
        counts.append(_count(d.get("n"), "block count", MAX_BLOCKS + 1))
        counts += [_count(n, "block count", MAX_BLOCKS + 1) for n in _items(d.get("g", []), "groups", MAX_GROUPS)]
    if tail_bytes % 4:
        raise MalformedMessage("packed block ids are not whole u32s")
    if sum(counts) != tail_bytes // 4:
        more = "fewer" if sum(counts) > tail_bytes // 4 else "more"
        raise MalformedMessage(f"packed frame holds {more} block ids than its header counts")
    return msg, counts


def _place(msg: dict[str, Any], lists: list[array[int]]) -> dict[str, Any]:
    """Put the block id ``lists`` (frame order) in place of the header's counts: ``blocks`` and ``groups``."""
    it = iter(lists)
    for d in msg["dsts"]:
        del d["n"]
        d["blocks"] = next(it)
        if "g" in d:
            d["groups"] = [next(it) for _ in d.pop("g")]
    return msg


def as_lists(value: Any) -> Any:
    """``value`` (a message) with every ``array`` in it as a list: what was sent, for logs and comparisons."""
    if isinstance(value, array):
        return value.tolist()
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_lists(v) for v in value]
    return value


def _unpack_dst(raw: bytes | bytearray) -> dict[str, Any]:
    """A PACKED frame's message from its bytes in memory: the socket's parser (:func:`_recv_packed`) reading
    them. Raises MalformedMessage."""
    with memoryview(raw) as view:
        return _recv_packed(_BufferReader(view, len(PACKED)), len(raw))


def encode_message(msg: Mapping[str, Any]) -> bytes:
    """One message as it goes on the wire (length prefix, then JSON, or a PACKED frame for ``dst``). Raises
    ProtocolFailure when too large."""
    body = _pack_dst(msg) if msg.get("type") == "dst" else json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolFailure(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    return _HEADER.pack(len(body)) + body


def send_message(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    """Send one message (blocking; the socket's timeout applies). Raises OSError or ProtocolFailure."""
    sock.sendall(encode_message(msg))


def send_frame(sock: socket.socket, payload: bytes) -> None:
    """Send one frame of raw ``payload`` (a sealed message; blocking, the socket's timeout applies)."""
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class _Reader(Protocol):
    """What the frame readers need of a socket."""

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int: ...


class _BufferReader:
    """Bytes in memory read as a socket is (:class:`_Reader`), from ``at`` on; 0 at their end."""

    def __init__(self, view: memoryview, at: int = 0) -> None:
        self._view, self._at = view, at

    def recv_into(self, buffer: memoryview, nbytes: int = 0, /) -> int:
        n = min(nbytes or len(buffer), len(self._view) - self._at)
        buffer[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n


def _recv_into(sock: _Reader, view: memoryview) -> None:
    """Fill ``view`` (bytes) from ``sock``. Raises ConnectionClosed or OSError."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionClosed("connection closed by peer")
        got += k


def _recv_exact(sock: _Reader, n: int) -> bytearray:
    """Exactly ``n`` bytes, read into one buffer (a frame costs its size once, not once per copy)."""
    buf = bytearray(n)
    with memoryview(buf) as view:
        _recv_into(sock, view)
    return buf


def _skip(sock: _Reader, n: int) -> None:
    """Read and drop ``n`` bytes (a refused frame's rest: the stream stays in sync), 64 KiB at a time."""
    chunk = bytearray(min(n, 1 << 16))
    with memoryview(chunk) as view:
        while n:
            k = min(n, len(view))
            _recv_into(sock, view[:k])
            n -= k


def _recv_packed(sock: _Reader, size: int) -> dict[str, Any]:
    """The rest of a PACKED frame of ``size`` bytes whose magic was read: the header parsed, then each block id
    list read off the socket straight into its ``array('I')`` (the frame is never held whole: it costs its
    size once). Raises MalformedMessage with the frame consumed, ConnectionClosed or OSError."""
    rest = size - len(PACKED)
    if rest < _PACKED_LEN.size:
        _skip(sock, rest)
        raise MalformedMessage("packed frame shorter than its header")
    (hlen,) = _PACKED_LEN.unpack(_recv_exact(sock, _PACKED_LEN.size))
    rest -= _PACKED_LEN.size
    if hlen > MAX_PACKED_HEADER or hlen > rest:
        _skip(sock, rest)
        raise MalformedMessage(f"packed frame header of {hlen} bytes does not fit")
    rest -= hlen
    try:
        msg, counts = _packed_header(_recv_exact(sock, hlen), rest)
    except MalformedMessage:
        _skip(sock, rest)
        raise
    lists: list[array[int]] = []
    for n in counts:
        ids: array[int] = array(_U32, [0]) * n
        with memoryview(ids) as view, view.cast("B") as raw:
            _recv_into(sock, raw)
        if sys.byteorder != "little":
            ids.byteswap()
        lists.append(ids)
    return _place(msg, lists)


def recv_frame(sock: socket.socket, limit: int = MAX_MESSAGE) -> bytearray:
    """The payload of one frame of at most ``limit`` bytes, unparsed (blocking; the socket's timeout applies).
    Raises ProtocolFailure (oversized: not read), ConnectionClosed or OSError."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise ProtocolFailure(f"peer announced a {size}-byte message (limit {limit})")
    return _recv_exact(sock, size)


def recv_message(sock: socket.socket, limit: int = MAX_MESSAGE) -> dict[str, Any]:
    """Read one message of at most ``limit`` bytes, JSON or PACKED (blocking; the socket's timeout applies).
    Raises MalformedMessage (frame consumed: the stream is in sync), ProtocolFailure (oversized: not read) or
    OSError."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise ProtocolFailure(f"peer announced a {size}-byte message (limit {limit})")
    if size < len(PACKED):
        return parse_message(_recv_exact(sock, size))
    magic = _recv_exact(sock, len(PACKED))
    if magic == PACKED:
        return _recv_packed(sock, size)
    buf = bytearray(size)  # a JSON frame: read whole, once
    buf[:len(PACKED)] = magic
    with memoryview(buf) as view:
        _recv_into(sock, view[len(PACKED):])
    return parse_message(buf)


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


def parse_message(raw: bytes | bytearray) -> dict[str, Any]:
    """A JSON object with a string ``type``, parsed only after :func:`guard_json` passed (a PACKED frame: its
    header so, its block ids as arrays). Raises MalformedMessage."""
    if raw[:len(PACKED)] == PACKED:
        return _unpack_dst(raw)
    return _json_object(raw)


def _json_object(raw: bytes | bytearray) -> dict[str, Any]:
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


def is_sealed(payload: bytes | bytearray) -> bool:
    return payload[:len(SEALED)] == SEALED


def unseal(payload: bytes | bytearray, secret: bytes | None, nonce: bytes) -> dict[str, Any]:
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


def _ids(value: Any) -> Sequence[int]:
    """A destination's block ids: an ``array('I')`` of at most MAX_BLOCKS from a PACKED frame (ids as JSON
    numbers are refused: they cost the parser up to 9x their text)."""
    if not isinstance(value, array) or value.typecode != _U32 or len(value) > MAX_BLOCKS:
        raise MalformedMessage(f"block ids must come packed ({PACKED.decode()}), at most {MAX_BLOCKS}")
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
            blocks = _ids(d.get("blocks"))
            groups = [_ids(g) for g in _items(d.get("groups", []), "groups", MAX_GROUPS)]
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
