"""The kvtransport exception tree.

Every error raised by kvtransport (core or backend) is a subclass of :class:`KVTransportError`;
backends translate their library's failures into these types so callers never have to catch a
backend-specific exception. ``error.fix`` says what to do about it where the message alone does not (the
``kvtransport`` command prints it under the one-line error)::

    KVTransportError
    ├── ConfigurationError          bad option / environment value (names the fix)
    │   ├── UnknownBackend          KV_TRANSPORT names a backend that is not installed
    │   ├── BackendUnavailable      installed, but cannot run here (the reason says why)
    │   └── InterfaceNotFound       NET_IFNAME names no interface (lists the ones present)
    ├── LayoutError                 a KV cache that cannot be described / used as given
    ├── InvalidArgument             a call's argument of the wrong type or out of range (a timeout that is not
    │   │                           a finite number of seconds, a layer that is not an int, not a Peer ...)
    │   ├── InvalidBlockIds         block id lists (or a layer index) rejected before any byte moves
    │   └── InvalidSequenceId       a sequence id that is not a str/int or too long for the wire
    ├── ProtocolError               malformed, truncated, oversized or unauthenticated wire data
    │   └── VersionMismatch         peer speaks another wire/metadata version
    ├── IncompatiblePeer            peer's layout / backend / capacity does not match ours
    ├── TransferError               a transfer did not complete
    │   ├── TransferTimeout         a bounded wait ran out
    │   ├── PeerDisconnected        the peer went away; its in-flight sequences failed
    │   ├── SequenceAborted         the sequence was released/cancelled while in flight
    │   ├── SlotsExhausted          the receiver's sequence table is full (back-pressure), or this sender
    │   │                           holds its share of it
    │   └── ForeignSequence         the sequence belongs to another sender; this sender's event was refused
    └── CommClosed                  the CommManager was closed

Where a caller needs to know *which* sequence or peer an error concerns, it reads ``error.seq_id`` and
``error.peer`` (None when the error is not about one). A backend turns its library's exceptions into these
types with :func:`map_errors`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class KVTransportError(Exception):
    """Base of every kvtransport error. ``fix``: what to do about it (a class default, or ``fix=`` at the
    raise site), empty when the message already says it."""

    fix: str = ""
    seq_id: str | int | None = None
    """The sequence the error concerns, where there is one (a wait that timed out, a refused signal...)."""
    peer: str | None = None
    """The peer the error concerns (its instance id or ``host:port``), where there is one."""

    def __init__(self, *args: object, fix: str | None = None, seq_id: str | int | None = None,
                 peer: str | None = None) -> None:
        super().__init__(*args)
        if fix is not None:
            self.fix = fix
        if seq_id is not None:
            self.seq_id = seq_id
        if peer is not None:
            self.peer = peer


class ConfigurationError(KVTransportError):
    """An option or environment variable has a value we cannot use; the message names the fix."""


class UnknownBackend(ConfigurationError):
    """The requested backend name is not registered."""

    fix = "pick one with --backend, backend= or KV_TRANSPORT (`kvtransport backends` lists them)"


class BackendUnavailable(ConfigurationError):
    """The backend is registered but cannot run on this machine (the message says why)."""

    fix = "`kvtransport doctor` checks this machine; or pick another backend with --backend / KV_TRANSPORT"


class InterfaceNotFound(ConfigurationError):
    """NET_IFNAME (or ``ifname=``) names an interface that does not exist or has no address."""

    fix = "set NET_IFNAME to one of the interfaces listed, or unset it for peers on this host (loopback)"


class LayoutError(KVTransportError):
    """The KV cache cannot be described as per-layer block regions, or is used inconsistently."""


class InvalidArgument(KVTransportError, ValueError):
    """An argument of a public call has the wrong type or is out of range; rejected before anything
    happens (no byte moved, no state changed)."""


class InvalidBlockIds(InvalidArgument):
    """Block id lists are malformed (length mismatch, negative, duplicate destination, out of range)."""


class InvalidSequenceId(InvalidArgument):
    """A sequence id is not a str or int (bool excluded), or is longer than the wire allows; rejected
    before any byte moves."""


class ProtocolError(KVTransportError):
    """Wire data is malformed, truncated, oversized or fails authentication."""


class VersionMismatch(ProtocolError):
    """The peer uses a different wire/metadata version."""


class IncompatiblePeer(KVTransportError):
    """The peer's KV layout, backend or settings are incompatible with ours; nothing was moved."""


class TransferError(KVTransportError):
    """A transfer did not complete."""


class TransferTimeout(TransferError, TimeoutError):
    """A bounded wait ran out before the awaited event happened."""


class PeerDisconnected(TransferError):
    """The peer disconnected or became unreachable; sequences in flight with it failed."""


class SequenceAborted(TransferError):
    """The sequence was released or cancelled before it completed."""


class SlotsExhausted(TransferError):
    """The receiving side has no free sequence slot (capacity is part of the handshake)."""


class ForeignSequence(TransferError):
    """The receiver refused an event (put, signal, cancel) for a sequence that another sender owns: the
    first sender to claim a sequence id (or the one named by ``expect``) owns it until it is released."""


class CommClosed(KVTransportError):
    """The CommManager was closed; no further operations are possible."""


@contextmanager
def map_errors(to: type[KVTransportError], what: str, **fields: Any) -> Iterator[None]:
    r"""Inside the block, an exception that is not a :class:`KVTransportError` (a library's error a backend
    let through: UCX, NCCL, CUDA, OS errors) becomes ``to(f"{what}: {type}: {message}", **fields)``, chained to
    the original (``raise ... from``); kvtransport errors and ``BaseException``\s that are not ``Exception``
    (KeyboardInterrupt, SystemExit) pass unchanged. ``fields``: ``fix``, ``seq_id``, ``peer``. The pattern of
    httpx's ``map_exceptions``: one place decides how foreign errors look to our callers.

        with map_errors(TransferError, f"{backend} flush failed", peer=label):
            link.flush(timeout)
    """
    try:
        yield
    except KVTransportError:
        raise
    except Exception as exc:
        raise to(f"{what}: {type(exc).__name__}: {exc}", **fields) from exc


__all__ = [
    "BackendUnavailable",
    "CommClosed",
    "ConfigurationError",
    "ForeignSequence",
    "IncompatiblePeer",
    "InterfaceNotFound",
    "InvalidArgument",
    "InvalidBlockIds",
    "InvalidSequenceId",
    "KVTransportError",
    "LayoutError",
    "PeerDisconnected",
    "ProtocolError",
    "SequenceAborted",
    "SlotsExhausted",
    "TransferError",
    "TransferTimeout",
    "UnknownBackend",
    "VersionMismatch",
    "map_errors",
]
