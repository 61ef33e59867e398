"""Wire format: peer metadata and side-channel frames. No pickle: JSON for descriptive messages, packed
integers for the hot path. Every decoder validates sizes and types and raises :class:`ProtocolError`.

Metadata (``CommManager.metadata()``)::

    b"KVTM" | u16 version | UTF-8 JSON object (see ``encode_metadata``)

Side-channel frame::

    b"KVTF" | u8 version | u8 type | u16 reserved(0) | u32 payload length | payload

Frame types and payloads:
    CHALLENGE  server->client  JSON {"nonce": hex}
    HELLO      client->server  {"auth":hex|null,"body":"<JSON {"metadata","nonce","request"}, escaped>"}, byte for
                                 byte (:func:`encode_hello`); at most MAX_HELLO_BYTES, its tag checked first
    WELCOME    server->client  JSON {"reply": {...}}
    REFUSE     server->client  JSON {"error": class name, "message": text}
    PUT        client->server  seq | u32 layer | u32 nruns | nruns x (i64 src, i64 dst, i64 count)
    SIGNAL     client->server  seq | i32 layer (-1: whole sequence) [| u64 doorbell ticket
                                 [| u32 puts | u64 bytes issued on a one-sided link since its last SIGNAL]]
    NACK       server->client  seq | JSON {"error": class name, "message": text}
    ABORT      server->client  seq | u64 token   (receiver aborts: stop writing, flush, then ABORT_ACK)
    ABORT_ACK  client->server  seq | u64 token   (no write for seq can land after this)
    CANCEL     client->server  seq               (sender gave the sequence up; receiver's waits fail)
    CHECKSUM   client->server  seq | u32 crc32 | u32 layer | u32 nruns | runs  (debug option ``checksum``)
    PING/PONG  either way      empty
where ``seq`` is u16 length + UTF-8 JSON of the id (a string or an integer).
"""

from __future__ import annotations

import array
import enum
import functools
import hashlib
import hmac
import json
import mmap
import operator
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import Any, overload

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
"""Largest peer metadata: a 128-layer model with 64 planes a layer (the most a layer may have) takes 340 KB
with ucx's keys; twelve times that."""
MAX_HELLO_BYTES = 2 * MAX_METADATA_BYTES + (64 << 10)
"""Largest HELLO, checked on its header before a byte of it is read: the sender's metadata (at most
MAX_METADATA_BYTES) with its backend's request and nonce (64 KiB; a few hundred bytes today), the whole
JSON-escaped once more as the frame's body string (every quote escaped: at most twice)."""
MAX_SEQ_ID_BYTES = 1024
MAX_RUNS_PER_PUT = 1 << 20
MAX_PEER_MESSAGE = 4096
"""Characters of a peer's error message (NACK, REFUSE) kept in the typed error raised here."""
MAX_WIRE_INT = 1 << 64
"""Ints of peer metadata (ports, counts, addresses, strides, sizes) are below it: one machine's memory."""


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
    if not 0 < fields["port"] < 65536 or not 0 < fields["capacity"] < MAX_WIRE_INT:
        raise ProtocolError("peer metadata has an out-of-range port or capacity")
    _check_layout_numbers(fields["layout"], fields["layout_signature"])
    return fields


def _wire_int(value: object, what: str, low: int = 0) -> int:
    """``value`` if it is an int (not a bool) in [low, MAX_WIRE_INT); ProtocolError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_WIRE_INT:
        raise ProtocolError(f"peer metadata: {what} is not an int in [{low}, 2**64)")
    return value


def _check_layout_numbers(layout: dict[str, Any], signature: dict[str, Any]) -> None:
    """What a peer's layout description holds of what ``KVLayout.from_wire`` and ``describe_mismatch`` take on
    trust: its ints are ints (not bools, not floats) of at most 64 bits, its signature's layers strings. A
    field that is absent is ``from_wire``'s to refuse (LayoutError), as are the layout's own rules."""
    if "num_blocks" in layout:
        _wire_int(layout["num_blocks"], "layout.num_blocks", 1)
    layers = layout.get("layers", [])
    if not isinstance(layers, list):
        raise ProtocolError("peer metadata: layout.layers is not a list")
    for i, layer in enumerate(layers):
        planes = layer.get("planes", []) if isinstance(layer, dict) else None
        if not isinstance(planes, list):
            raise ProtocolError(f"peer metadata: layout layer {i} is not an object with a list of planes")
        for plane in planes:
            if not isinstance(plane, list) or len(plane) != 3:
                raise ProtocolError(f"peer metadata: a plane of layout layer {i} is not three ints")
            for x in plane:
                _wire_int(x, f"a plane number of layout layer {i}")
    if "version" in signature:
        _wire_int(signature["version"], "layout_signature.version")
    sig_layers = signature.get("layers", [])
    if not isinstance(sig_layers, list) or not all(isinstance(x, str) for x in sig_layers):
        raise ProtocolError("peer metadata: layout_signature.layers is not a list of strings")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    """A JSON object (RFC 8259: NaN and the infinities are refused); ProtocolError for anything else."""
    try:
        obj = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
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
    encode_seq(seq)


_SEQ_INT_BITS = 4 * MAX_SEQ_ID_BYTES
"""An int of more bits has more than MAX_SEQ_ID_BYTES digits (log10(2) < 1/3), and is refused before its
conversion to text (which costs quadratic time, and raises ValueError past 4,300 digits)."""


def encode_seq(seq: SeqId) -> bytes:
    if isinstance(seq, bool) or not isinstance(seq, str | int):
        raise errors.InvalidSequenceId(f"sequence ids are str or int, got {type(seq).__name__}")
    if isinstance(seq, int) and seq.bit_length() > _SEQ_INT_BITS:
        raise errors.InvalidSequenceId(f"sequence id too long (an int of {seq.bit_length()} bits; "
                                       f"limit {MAX_SEQ_ID_BYTES} characters encoded)")
    return _encode_seq_cached(seq)


@functools.lru_cache(maxsize=4096, typed=True)
def _encode_seq_cached(seq: SeqId) -> bytes:
    """Every layer of a request encodes the same id (json.dumps costs µs); typed: 1 and "1" stay apart."""
    raw = json.dumps(seq).encode()
    if len(raw) > MAX_SEQ_ID_BYTES:
        raise errors.InvalidSequenceId(f"sequence id too long ({len(raw)} bytes encoded; limit {MAX_SEQ_ID_BYTES})")
    return struct.pack("!H", len(raw)) + raw


def decode_seq(payload: bytes, offset: int) -> tuple[SeqId, int]:
    if len(payload) < offset + 2:
        raise ProtocolError("truncated sequence id")
    (n,) = struct.unpack_from("!H", payload, offset)
    end = offset + 2 + n
    if n > MAX_SEQ_ID_BYTES or len(payload) < end:
        raise ProtocolError("truncated or oversized sequence id")
    try:
        seq = json.loads(payload[offset + 2 : end].decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError("malformed sequence id") from None
    if isinstance(seq, bool) or not isinstance(seq, str | int):
        raise ProtocolError("sequence id must be a string or an integer")
    return seq, end


_RUN = struct.Struct("!qqq")


def encode_put(seq: SeqId, layer: int, runs: Sequence[BlockRun]) -> bytes:
    head = encode_seq(seq) + struct.pack("!II", layer, len(runs))
    body = b"".join(_RUN.pack(r.src, r.dst, r.count) for r in runs)
    return head + body


def decode_put(payload: bytes) -> tuple[SeqId, int, list[BlockRun]]:
    seq, off = decode_seq(payload, 0)
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
    head = encode_seq(seq)
    return head + struct.pack("!I", crc) + put[len(head):]


def decode_checksum(payload: bytes) -> tuple[SeqId, int, int, list[BlockRun]]:
    seq, off = decode_seq(payload, 0)
    if len(payload) < off + 4:
        raise ProtocolError("truncated CHECKSUM frame")
    (crc,) = struct.unpack_from("!I", payload, off)
    _, layer, runs = decode_put(payload[:off] + payload[off + 4 :])
    return seq, layer, crc, runs


class PackedRuns(Sequence[BlockRun]):
    """Block runs kept as they came on the wire (``raw``: 24 bytes each), validated once, read back one at a
    time: what a receiver holds of a run costs its 24 bytes, not a Python object. ``dst_end``/``src_end``:
    the largest ``dst + count`` / ``src + count`` (0 without runs)."""

    __slots__ = ("dst_end", "raw", "src_end")
    _WINDOW_RUNS = 1 << 16
    """Runs validated at a time (the validation's own memory: a few of these windows)."""

    def __init__(self, raw: bytes) -> None:
        if len(raw) % _RUN.size or len(raw) // _RUN.size > MAX_RUNS_PER_PUT:
            raise ProtocolError(f"{len(raw)} bytes are not a whole number of runs (at most {MAX_RUNS_PER_PUT})")
        self.raw = raw
        self.dst_end = self.src_end = 0
        step = self._WINDOW_RUNS * _RUN.size
        with memoryview(raw) as view:
            for at in range(0, len(raw), step):
                ints = array.array("q")
                ints.frombytes(view[at : at + step])
                if sys.byteorder == "little":
                    ints.byteswap()
                src, dst, count = ints[0::3], ints[1::3], ints[2::3]
                if min(src) < 0 or min(dst) < 0 or min(count) < 1:
                    raise ProtocolError("a run of the frame is invalid (negative block or count below 1)")
                self.dst_end = max(self.dst_end, max(map(operator.add, dst, count)))
                self.src_end = max(self.src_end, max(map(operator.add, src, count)))

    def __len__(self) -> int:
        return len(self.raw) // _RUN.size

    @overload
    def __getitem__(self, i: int) -> BlockRun: ...
    @overload
    def __getitem__(self, i: slice) -> list[BlockRun]: ...
    def __getitem__(self, i: int | slice) -> BlockRun | list[BlockRun]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("run index out of range")
        return BlockRun(*_RUN.unpack_from(self.raw, (i % n) * _RUN.size))

    def __iter__(self) -> Iterator[BlockRun]:
        return map(BlockRun._make, _RUN.iter_unpack(self.raw))


def decode_checksum_packed(payload: bytes) -> tuple[SeqId, int, int, PackedRuns]:
    """What :func:`decode_checksum` gives, with the runs packed (:class:`PackedRuns`): a receiver keeps a
    CHECKSUM at the size it came. Same checks, same ProtocolError."""
    seq, off = decode_seq(payload, 0)
    if len(payload) < off + 12:
        raise ProtocolError("truncated CHECKSUM frame")
    crc, layer, nruns = struct.unpack_from("!III", payload, off)
    off += 12
    if nruns > MAX_RUNS_PER_PUT or len(payload) != off + nruns * _RUN.size:
        raise ProtocolError(f"CHECKSUM frame length does not match its {nruns} runs")
    return seq, layer, crc, PackedRuns(payload[off:])


_SIGNAL_COUNTS = struct.Struct("!QIQ")  # ticket, puts, bytes


def encode_signal(seq: SeqId, layer: int | None, ticket: int = 0, puts: int = 0, nbytes: int = 0) -> bytes:
    """SIGNAL payload; ``ticket`` (> 0) when the signal was also announced on the link's doorbell; ``puts`` and
    ``nbytes``: what a one-sided link issued since its previous SIGNAL (the receiver counts them, since it
    sees no PUT frames)."""
    body = encode_seq(seq) + struct.pack("!i", -1 if layer is None else layer)
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
    seq, off = decode_seq(payload, 0)
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
    return encode_seq(seq) + struct.pack("!Q", token)


def decode_abort(payload: bytes) -> tuple[SeqId, int]:
    seq, off = decode_seq(payload, 0)
    if len(payload) != off + 8:
        raise ProtocolError("ABORT frame has the wrong length")
    (token,) = struct.unpack_from("!Q", payload, off)
    return seq, token


def encode_cancel(seq: SeqId) -> bytes:
    return encode_seq(seq)


def decode_cancel(payload: bytes) -> SeqId:
    seq, off = decode_seq(payload, 0)
    if len(payload) != off:
        raise ProtocolError("CANCEL frame has the wrong length")
    return seq


def encode_error(seq: SeqId | None, exc: BaseException) -> bytes:
    body = json_payload({"error": type(exc).__name__, "message": str(exc)})
    return (encode_seq(seq) if seq is not None else encode_seq("")) + body


_ERROR_TYPES: dict[str, type[errors.KVTransportError]] = {
    name: obj
    for name, obj in vars(errors).items()
    if isinstance(obj, type) and issubclass(obj, errors.KVTransportError)
}


def error_from_wire(obj: dict[str, Any]) -> errors.KVTransportError:
    """Rebuild a typed error a peer reported; unknown names (and fields that are not strings) become
    TransferError (never eval'd); the message is cut at MAX_PEER_MESSAGE characters."""
    name, message = obj.get("error"), obj.get("message")
    cls = _ERROR_TYPES.get(name, errors.TransferError) if isinstance(name, str) else errors.TransferError
    text = message[:MAX_PEER_MESSAGE] if isinstance(message, str) else ""
    return cls(f"peer reported: {text}")


def decode_nack(payload: bytes) -> tuple[SeqId, errors.KVTransportError]:
    seq, off = decode_seq(payload, 0)
    return seq, error_from_wire(_json_object(payload[off:], "NACK"))


# ---------------------------------------------------------------------- authentication
def auth_tag(secret: bytes, nonce: bytes, body: bytes | bytearray) -> str:
    """HMAC-SHA256 over the server's nonce and the HELLO body (hex; the body is not copied)."""
    mac = hmac.new(secret, nonce, hashlib.sha256)
    mac.update(body)
    return mac.hexdigest()


def auth_ok(secret: bytes, nonce: bytes, body: bytes | bytearray, tag: object) -> bool:
    return isinstance(tag, str) and hmac.compare_digest(auth_tag(secret, nonce, body), tag)


# ---------------------------------------------------------------------- the HELLO, authenticated before it is parsed
# A HELLO's payload is ``json_payload({"body": body, "auth": tag})``: with its keys sorted and no spaces, and the
# body ASCII JSON itself (json_payload escapes every other character), the frame is always one of
#     {"auth":"<64 hex digits>","body":"<body, with each " and \ escaped by a \>"}
#     {"auth":null,"body":"<same>"}
# so it is checked by its bytes, the HMAC computed over the body as it is unescaped, window by window, and
# the JSON of the body parsed only once it is authentic: an unauthenticated HELLO costs a window (_WINDOW)
# beyond the bytes it sent, whatever they hold.
_HELLO_TAGGED = b'{"auth":"'
_HELLO_TAG_END = b'","body":"'
_HELLO_UNTAGGED = b'{"auth":null,"body":"'
_HELLO_END = b'"}'
_TAG_HEX = 64
_HEX_DIGITS = b"0123456789abcdef"
_PRINTABLE = bytes(range(0x20, 0x7F))
"""What an escaped body consists of: printable ASCII."""
_WINDOW = 256 << 10


def encode_hello(body: bytes, auth: str | None) -> bytes:
    """A HELLO payload: ``body`` (ASCII JSON, as :func:`json_payload` makes it) and its ``auth`` tag (hex) or
    None; byte for byte ``json_payload({"body": body.decode(), "auth": auth})``."""
    return json_payload({"body": body.decode("ascii"), "auth": auth})


def hello_body(payload: bytes | mmap.mmap, secret: bytes | None, nonce: bytes) -> bytes | None:
    """The body of a HELLO payload (see :func:`encode_hello`), unparsed. With ``secret``: None unless its tag is
    the HMAC of ``nonce`` and the body under ``secret`` (checked over the raw bytes, before anything is parsed
    or the body assembled); without one, any tag or none is taken. ProtocolError for a payload that is not
    what our senders send, or longer than MAX_HELLO_BYTES. Memory: a window beyond ``payload`` until the
    tag is checked, then the body."""
    n = len(payload)
    if n > MAX_HELLO_BYTES:
        raise ProtocolError(f"HELLO of {n} bytes; the limit is {MAX_HELLO_BYTES}")
    tag: bytes | None = None
    if payload[: len(_HELLO_UNTAGGED)] == _HELLO_UNTAGGED:
        start = len(_HELLO_UNTAGGED)
    elif (payload[: len(_HELLO_TAGGED)] == _HELLO_TAGGED
          and payload[len(_HELLO_TAGGED) + _TAG_HEX : len(_HELLO_TAGGED) + _TAG_HEX + len(_HELLO_TAG_END)]
          == _HELLO_TAG_END):
        tag = payload[len(_HELLO_TAGGED) : len(_HELLO_TAGGED) + _TAG_HEX]
        start = len(_HELLO_TAGGED) + _TAG_HEX + len(_HELLO_TAG_END)
        if tag.translate(None, _HEX_DIGITS):
            raise ProtocolError("malformed HELLO: its tag is not lowercase hex")
    elif payload[:1] != b"{":
        raise ProtocolError("malformed HELLO: expected a JSON object")
    else:
        raise ProtocolError('malformed HELLO: not {"auth":...,"body":...} as our senders send it')
    if n < start + len(_HELLO_END) or payload[n - len(_HELLO_END) :] != _HELLO_END:
        raise ProtocolError("malformed HELLO: truncated")
    end = n - len(_HELLO_END)
    if secret is not None:
        if tag is None:
            return None
        mac = hmac.new(secret, nonce, hashlib.sha256)
        for chunk in _unescaped(payload, start, end):
            mac.update(chunk)
        if not hmac.compare_digest(mac.hexdigest().encode(), tag):
            return None
    return b"".join(_unescaped(payload, start, end))


def _unescaped(payload: bytes | mmap.mmap, start: int, end: int) -> Iterator[bytes]:
    """``payload[start:end]`` (a JSON string's inside, escaped as json.dumps escapes printable ASCII) unescaped,
    window by window; each window ends on a character that is not a backslash (so no escape is split) or
    after an even number of them. ProtocolError for any other character or escape."""
    i = start
    while i < end:
        chunk = payload[i : min(end, i + _WINDOW)]
        if i + len(chunk) < end:
            keep = len(chunk.rstrip(b"\\"))
            chunk = chunk[: keep or len(chunk) & ~1]
        i += len(chunk)
        yield _unescape(chunk)


def _unescape(chunk: bytes) -> bytes:
    if chunk.translate(None, _PRINTABLE):
        raise ProtocolError("malformed HELLO: its body is not printable ASCII")
    pairs = chunk.replace(b"\\\\", b"\0")  # escaped backslashes, paired from the left as JSON does
    if pairs.count(b'"') != pairs.count(b'\\"'):
        raise ProtocolError("malformed HELLO: a quote inside its body is not escaped")
    quotes = pairs.replace(b'\\"', b'"')
    if b"\\" in quotes:
        raise ProtocolError("malformed HELLO: an escape other than \\\" or \\\\ in its body")
    return quotes.replace(b"\0", b"\\")
