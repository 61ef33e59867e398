"""kvtransport: the KV-cache transport for disaggregated LLM serving.

Public API::

    cm = kvtransport.open(layout, backend=None, ifname=None, **options)   # -> CommManager
    peer = cm.connect(other_cm_metadata)                                   # sender side
    cm.put_layer(peer, seq_id, layer, src_block_ids, dst_block_ids)        # async, coalesced
    cm.signal_layer(peer, seq_id, layer); cm.signal(peer, seq_id)
    cm.wait(seq_id, timeout=...); cm.wait_layer(seq_id, layer, timeout=...)  # receiver side
    cm.poll(); cm.release(seq_id); cm.close()

Nothing heavy is imported here: backends load their libraries when selected.
"""

from __future__ import annotations

from typing import Any

from . import registry
from .coalesce import BlockRun, coalesce, expand_runs
from .config import Settings, list_interfaces, resolve
from .errors import (
    BackendUnavailable,
    CommClosed,
    ConfigurationError,
    IncompatiblePeer,
    InterfaceNotFound,
    InvalidBlockIds,
    InvalidSequenceId,
    KVTransportError,
    LayoutError,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    SlotsExhausted,
    TransferError,
    TransferTimeout,
    UnknownBackend,
    VersionMismatch,
)
from .layout import KVLayout, LayerRegion, Plane
from .manager import CommManager, Peer
from .registry import BackendInfo, available_backends
from .semaphores import SeqId

__version__ = "0.1.0"


def open(  # noqa: A001 - the name the contract asks for
    layout: KVLayout,
    *,
    backend: str | None = None,
    ifname: str | None = None,
    **options: Any,
) -> CommManager:
    """Create a :class:`CommManager` for ``layout``.

    Backend: ``backend`` argument, else ``KV_TRANSPORT``, else the best available for the layout's memory.
    Interface: ``ifname``, else ``NET_IFNAME``, else loopback. Core options: ``capacity`` (sequence slots),
    ``timeout`` (seconds, default bound for connect/handshake), ``port``, ``secret``, ``coalesce``,
    ``checksum``, ``doorbell`` (False: completions only by the side channel; see kvtransport.doorbell);
    other keyword options go to the backend. Blocking only for backend set-up. Raises
    ConfigurationError subclasses (each names the fix) or LayoutError.
    """
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"open() needs a KVLayout (KVLayout.from_tensors(...)), got {type(layout).__name__}")
    settings = resolve(backend, ifname, **options)
    if settings.checksum and layout.is_cuda:
        raise ConfigurationError("checksum=True (a debug option) verifies host memory only; turn it off for CUDA caches")
    spec = registry.choose(settings.backend, layout.memory_kind)
    try:
        transport = spec.create(layout, settings)
    except KVTransportError:
        raise
    except Exception as exc:  # a backend that leaked its library's error: still typed, and says which
        raise BackendUnavailable(f"backend {spec.name} could not start: {type(exc).__name__}: {exc}") from exc
    try:
        return CommManager(layout, settings, transport)
    except BaseException:
        transport.close()
        raise


__all__ = [
    "BackendInfo",
    "BackendUnavailable",
    "BlockRun",
    "CommClosed",
    "CommManager",
    "ConfigurationError",
    "IncompatiblePeer",
    "InterfaceNotFound",
    "InvalidBlockIds",
    "InvalidSequenceId",
    "KVLayout",
    "KVTransportError",
    "LayerRegion",
    "LayoutError",
    "Peer",
    "PeerDisconnected",
    "Plane",
    "ProtocolError",
    "SeqId",
    "SequenceAborted",
    "Settings",
    "SlotsExhausted",
    "TransferError",
    "TransferTimeout",
    "UnknownBackend",
    "VersionMismatch",
    "available_backends",
    "coalesce",
    "expand_runs",
    "list_interfaces",
    "open",
]
