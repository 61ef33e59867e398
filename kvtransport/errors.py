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
"""

from __future__ import annotations


class KVTransportError(Exception):
    """Base of every kvtransport error. ``fix``: what to do about it (a class default, or ``fix=`` at the
    raise site), empty when the message already says it."""

    fix: str = ""

    def __init__(self, *args: object, fix: str | None = None) -> None:
        super().__init__(*args)
        if fix is not None:
            self.fix = fix


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
]
