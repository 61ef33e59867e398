"""Wire format: peer metadata and side-channel frames. No pickle: JSON for descriptive messages, packed
integers for the hot path. Every decoder validates sizes and types and raises :class:`ProtocolError`.

Metadata (``CommManager.metadata()``)::

    b"KVTM" | u16 version | UTF-8 JSON object (see ``encode_metadata``)

Side-channel frame::

    b"KVTF" | u8 version | u8 type | u16 reserved(0) | u32 payload length | payload

Frame types and payloads:
    CHALLENGE  server->client  JSON {"nonce": hex}
    HELLO      client->server  JSON {"metadata": {...}, "request": {...}, "auth": hex|null}
    WELCOME    server->client  JSON {"reply": {...}}
    REFUSE     server->client  JSON {"error": class name, "message": text}
    PUT        client->server  seq | u32 layer | u32 nruns | nruns x (i64 src, i64 dst, i64 count)
    SIGNAL     client->server  seq | i32 layer (-1: whole sequence) [| u64 doorbell ticket
                                 [| u32 puts | u64 bytes issued on a one-sided link since its last SIGNAL]]
    NACK       server->client  seq | JSON {"error": class name, "message": text}
    ABORT      server->client  seq | u64 token   (receiver aborts: stop writing, flush, then ABORT_ACK)
    ABORT_ACK  client->server  seq | u64 token   (no write for seq can land after this)
    CANCEL     client->server  seq               (sender gave the sequence up; receiver's waits fail)
    CHECKSUM   client->server  seq | u32 layer | u32 crc32 | u32 nruns | runs  (debug option ``checksum``)
    PING/PONG  either way      empty
where ``seq`` is u16 length + UTF-8 JSON of the id (a string or an integer).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from typing import Any

from . import errors
from .coalesce import BlockRun
from .errors import ProtocolError, VersionMismatch
from .semaphores import SeqId

METADATA_MAGIC = b"KVTM"
METADATA_VERSION = 1
FRAME_MAGIC = b"KVTF"
FRAME_VERSION = 1
FRAME_HEADER = struct.Struct("!4sBBHI")
MAX_FRAME_BYTES = 16 << 20
"""Largest payload accepted; a 2k-token request's runs for one layer take a few KiB."""
MAX_METADATA_BYTES = 4 << 20
MAX_SEQ_ID_BYTES = 1024
MAX_RUNS_PER_PUT = 1 << 20


class FrameType(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    REFUSE = 4
    PUT = 5
    SIGNAL = 6
    NACK = 7
    PING = 8
    PONG = 9
    ABORT = 10
    ABORT_ACK = 11
    CANCEL = 12
    CHECKSUM = 13
    DOORBELL = 14


# ---------------------------------------------------------------------- metadata
METADATA_AUTH_CONTEXT = b"kvtransport metadata v1"


def encode_metadata(fields: dict[str, Any], secret: bytes | None = None) -> bytes:
    """Versioned metadata bytes from a JSON-able dict; with ``secret``, sealed: a NUL and an HMAC of the JSON
    follow it, so that a peer holding the same secret can tell it came from one of us, unaltered."""
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    out = METADATA_MAGIC + struct.pack("!H", METADATA_VERSION) + body
    if secret is not None:
        out += b"\0" + auth_tag(secret, METADATA_AUTH_CONTEXT, body).encode()
    return out


REQUIRED_METADATA: dict[str, type | tuple[type, ...]] = {
    "instance": str,
    "backend": str,
    "host": str,
    "port": int,
    "capacity": int,
    "layout_hash": str,
    "layout_signature": dict,
    "layout": dict,
    "transport": dict,
    "auth_required": bool,
}


def decode_metadata(data: bytes, secret: bytes | None = None) -> dict[str, Any]:
    """Parse and validate metadata bytes; with ``secret``, they must be sealed with it (see
    :func:`encode_metadata`), before anything of them is used. Raises ProtocolError / VersionMismatch;
    never anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"peer metadata must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) > MAX_METADATA_BYTES:
        raise ProtocolError(f"peer metadata is {len(data)} bytes; the limit is {MAX_METADATA_BYTES}")
    if len(data) < 6 or data[:4] != METADATA_MAGIC:
        raise ProtocolError("not kvtransport metadata (bad magic); pass the bytes of the peer's cm.metadata()")
    (version,) = struct.unpack("!H", data[4:6])
    if version != METADATA_VERSION:
        raise VersionMismatch(
            f"peer metadata version {version}, ours {METADATA_VERSION}: run the same kvtransport version on both sides"
        )
    body, sealed, tag = data[6:].partition(b"\0")
    if secret is not None and not (sealed and auth_ok(secret, METADATA_AUTH_CONTEXT, body, tag.decode("latin-1"))):
        raise ProtocolError("peer metadata is not sealed with our KV_TRANSPORT_SECRET: it comes from a peer without "
                            "the secret (or another one), or was altered; set the same secret on both sides")
    fields = _json_object(body, "metadata")
    for key, typ in REQUIRED_METADATA.items():
        if not isinstance(fields.get(key), typ) or isinstance(fields.get(key), bool) is not (typ is bool):
            raise ProtocolError(f"peer metadata field {key!r} missing or not {getattr(typ, '__name__', typ)}")
    if not 0 < fields["port"] < 65536 or fields["capacity"] < 1:
        raise ProtocolError("peer metadata has an out-of-range port or capacity")
    return fields


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"malformed {what}: {exc.__class__.__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"malformed {what}: expected a JSON object")
    return obj


# ---------------------------------------------------------------------- frames
def frame(kind: FrameType, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(FRAME_MAGIC, FRAME_VERSION, int(kind), 0, len(payload)) + payload


def parse_header(header: bytes) -> tuple[FrameType, int]:
    """Validate a frame header; returns (type, payload length)."""
    if len(header) != FRAME_HEADER.size:
        raise ProtocolError("truncated frame header")
    magic, version, kind, reserved, length = FRAME_HEADER.unpack(header)
    if magic != FRAME_MAGIC:
        raise ProtocolError("bad frame magic: the peer is not a kvtransport side channel")
    if version != FRAME_VERSION:
        raise VersionMismatch(f"peer frame version {version}, ours {FRAME_VERSION}")
    if reserved != 0:
        raise ProtocolError("nonzero reserved field in frame header")
    try:
        ftype = FrameType(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame type {kind}") from None
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame payload of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return ftype, length


def json_payload(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def parse_json_payload(payload: bytes, what: str) -> dict[str, Any]:
    return _json_object(payload, what)


def check_seq_id(seq: Any) -> None:
    """Raise InvalidSequenceId unless ``seq`` can be a sequence id on the wire (str or int, not bool,
    at most MAX_SEQ_ID_BYTES encoded). Callers validate before moving any byte."""
    _encode_seq(seq)


def _encode_seq(seq: SeqId) -> bytes:
    if isinstance(seq, bool) or not isinstance(seq, str | int):
        raise errors.InvalidSequenceId(f"sequence ids are str or int, got {type(seq).__name__}")
    return _encode_seq_cached(seq)


@functools.lru_cache(maxsize=4096, typed=True)
def _encode_seq_cached(seq: SeqId) -> bytes:
    """Every layer of a request encodes the same id (json.dumps costs µs); typed: 1 and "1" stay apart."""
    raw = json.dumps(seq).encode()
    if len(raw) > MAX_SEQ_ID_BYTES:
        raise errors.InvalidSequenceId(f"sequence id too long ({len(raw)} bytes encoded; limit {MAX_SEQ_ID_BYTES})")
    return struct.pack("!H", len(raw)) + raw


def _decode_seq(payload: bytes, offset: int) -> tuple[SeqId, int]:
    if len(payload) < offset + 2:
        raise ProtocolError("truncated sequence id")
    (n,) = struct.unpack_from("!H", payload, offset)
    end = offset + 2 + n
    if n > MAX_SEQ_ID_BYTES or len(payload) < end:
        raise ProtocolError("truncated or oversized sequence id")
    try:
        seq = json.loads(payload[offset + 2 : end].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("malformed sequence id") from None
    if isinstance(seq, bool) or not isinstance(seq, str | int):
        raise ProtocolError("sequence id must be a string or an integer")
    return seq, end


_RUN = struct.Struct("!qqq")


def encode_put(seq: SeqId, layer: int, runs: Sequence[BlockRun]) -> bytes:
    head = _encode_seq(seq) + struct.pack("!II", layer, len(runs))
    body = b"".join(_RUN.pack(r.src, r.dst, r.count) for r in runs)
    return head + body


def decode_put(payload: bytes) -> tuple[SeqId, int, list[BlockRun]]:
    seq, off = _decode_seq(payload, 0)
    if len(payload) < off + 8:
        raise ProtocolError("truncated PUT frame")
    layer, nruns = struct.unpack_from("!II", payload, off)
    off += 8
    if nruns > MAX_RUNS_PER_PUT or len(payload) != off + nruns * _RUN.size:
        raise ProtocolError(f"PUT frame length does not match its {nruns} runs")
    runs = []
    for i in range(nruns):
        src, dst, count = _RUN.unpack_from(payload, off + i * _RUN.size)
        if src < 0 or dst < 0 or count < 1:
            raise ProtocolError(f"PUT frame run {i} is invalid: ({src}, {dst}, {count})")
        runs.append(BlockRun(src, dst, count))
    return seq, layer, runs


def encode_checksum(seq: SeqId, layer: int, crc: int, runs: Sequence[BlockRun]) -> bytes:
    put = encode_put(seq, layer, runs)
    head = _encode_seq(seq)
    return head + struct.pack("!I", crc) + put[len(head):]


def decode_checksum(payload: bytes) -> tuple[SeqId, int, int, list[BlockRun]]:
    seq, off = _decode_seq(payload, 0)
    if len(payload) < off + 4:
        raise ProtocolError("truncated CHECKSUM frame")
    (crc,) = struct.unpack_from("!I", payload, off)
    _, layer, runs = decode_put(payload[:off] + payload[off + 4 :])
    return seq, layer, crc, runs


_SIGNAL_COUNTS = struct.Struct("!QIQ")  # ticket, puts, bytes


def encode_signal(seq: SeqId, layer: int | None, ticket: int = 0, puts: int = 0, nbytes: int = 0) -> bytes:
    """SIGNAL payload; ``ticket`` (> 0) when the signal was also announced on the link's doorbell; ``puts`` and
    ``nbytes``: what a one-sided link issued since its previous SIGNAL (the receiver counts them, since it
    sees no PUT frames)."""
    body = _encode_seq(seq) + struct.pack("!i", -1 if layer is None else layer)
    if puts or nbytes:
        return body + _SIGNAL_COUNTS.pack(ticket, puts, nbytes)
    return body + struct.pack("!Q", ticket) if ticket else body


def decode_signal(payload: bytes) -> tuple[SeqId, int | None]:
    seq, layer, _ = decode_signal_ticket(payload)
    return seq, layer


def decode_signal_ticket(payload: bytes) -> tuple[SeqId, int | None, int]:
    """(sequence, layer or None, doorbell ticket or 0)."""
    seq, layer, ticket, _, _ = decode_signal_full(payload)
    return seq, layer, ticket


def decode_signal_full(payload: bytes) -> tuple[SeqId, int | None, int, int, int]:
    """(sequence, layer or None, doorbell ticket or 0, puts, bytes) of a SIGNAL payload."""
    seq, off = _decode_seq(payload, 0)
    if len(payload) not in (off + 4, off + 12, off + 4 + _SIGNAL_COUNTS.size):
        raise ProtocolError("SIGNAL frame has the wrong length")
    (layer,) = struct.unpack_from("!i", payload, off)
    if layer < -1:
        raise ProtocolError(f"SIGNAL frame has invalid layer {layer}")
    ticket = puts = nbytes = 0
    if len(payload) == off + 12:
        (ticket,) = struct.unpack_from("!Q", payload, off + 4)
    elif len(payload) > off + 12:
        ticket, puts, nbytes = _SIGNAL_COUNTS.unpack_from(payload, off + 4)
    return seq, (None if layer == -1 else layer), ticket, puts, nbytes


def encode_abort(seq: SeqId, token: int) -> bytes:
    return _encode_seq(seq) + struct.pack("!Q", token)


def decode_abort(payload: bytes) -> tuple[SeqId, int]:
    seq, off = _decode_seq(payload, 0)
    if len(payload) != off + 8:
        raise ProtocolError("ABORT frame has the wrong length")
    (token,) = struct.unpack_from("!Q", payload, off)
    return seq, token


def encode_cancel(seq: SeqId) -> bytes:
    return _encode_seq(seq)


def decode_cancel(payload: bytes) -> SeqId:
    seq, off = _decode_seq(payload, 0)
    if len(payload) != off:
        raise ProtocolError("CANCEL frame has the wrong length")
    return seq


def encode_error(seq: SeqId | None, exc: BaseException) -> bytes:
    body = json_payload({"error": type(exc).__name__, "message": str(exc)})
    return (_encode_seq(seq) if seq is not None else _encode_seq("")) + body


_ERROR_TYPES: dict[str, type[errors.KVTransportError]] = {
    name: obj
    for name, obj in vars(errors).items()
    if isinstance(obj, type) and issubclass(obj, errors.KVTransportError)
}


def error_from_wire(obj: dict[str, Any]) -> errors.KVTransportError:
    """Rebuild a typed error a peer reported; unknown names become TransferError (never eval'd)."""
    cls = _ERROR_TYPES.get(str(obj.get("error")), errors.TransferError)
    return cls(f"peer reported: {obj.get('message', '')}")


def decode_nack(payload: bytes) -> tuple[SeqId, errors.KVTransportError]:
    seq, off = _decode_seq(payload, 0)
    return seq, error_from_wire(_json_object(payload[off:], "NACK"))


# ---------------------------------------------------------------------- authentication
def auth_tag(secret: bytes, nonce: bytes, body: bytes) -> str:
    """HMAC-SHA256 over the server's nonce and the HELLO body (hex)."""
    return hmac.new(secret, nonce + body, hashlib.sha256).hexdigest()


def auth_ok(secret: bytes, nonce: bytes, body: bytes, tag: object) -> bool:
    return isinstance(tag, str) and hmac.compare_digest(auth_tag(secret, nonce, body), tag)
