"""The connector's scheduler-to-scheduler side channel: versioned, length-prefixed JSON messages.

A decode scheduler (client) connects to a prefill scheduler (server) and sends ``hello`` with its engine id,
its compatibility hash and its workers' kvtransport metadata; the server answers ``welcome`` or ``refuse``
(with the first differing field). Then the client sends ``dst`` (destination blocks of a transfer) and
``cancel`` messages, the server sends ``fail`` messages back. Pure Python, no vLLM import.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import struct
from collections.abc import Mapping
from typing import Any

PROTOCOL_VERSION = 1
MAX_MESSAGE = 64 << 20
_HEADER = struct.Struct("!I")


class ProtocolFailure(Exception):
    """Malformed or oversized side-channel data, or a closed connection."""


def send_message(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    """Send one message (blocking; the socket's timeout applies). Raises OSError."""
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ProtocolFailure(f"message of {len(body)} bytes exceeds {MAX_MESSAGE}")
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ProtocolFailure("connection closed by peer")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """Read one message (blocking; the socket's timeout applies). Raises ProtocolFailure or OSError."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_MESSAGE:
        raise ProtocolFailure(f"peer announced a {size}-byte message (limit {MAX_MESSAGE})")
    try:
        msg = json.loads(_recv_exact(sock, size))
    except ValueError as exc:
        raise ProtocolFailure(f"malformed message: {exc}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolFailure("message is not an object with a 'type'")
    return msg


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode())


def compat_hash(info: Mapping[str, Any]) -> str:
    """Stable digest of the compatibility fields (model, dtype, layers, heads, block size, layout, backend...)."""
    blob = json.dumps(info, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def describe_mismatch(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    """The differing compatibility fields, in words."""
    keys = sorted(set(ours) | set(theirs))
    diffs = [f"{k}: ours={ours.get(k)!r} peer={theirs.get(k)!r}" for k in keys if ours.get(k) != theirs.get(k)]
    return "; ".join(diffs) or "hashes differ"
