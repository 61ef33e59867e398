"""kvtransport: the KV-cache transport for disaggregated LLM serving.

Public API::

    cm = kvtransport.open(layout, backend=None, ifname=None, capacity=..., timeout=..., ...)  # -> CommManager
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
    ForeignSequence,
    IncompatiblePeer,
    InterfaceNotFound,
    InvalidArgument,
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
    map_errors,
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
    capacity: int | None = None,
    timeout: float | None = None,
    port: int | None = None,
    secret: str | bytes | None = None,
    coalesce: bool | None = None,
    checksum: bool | None = None,
    doorbell: bool | None = None,
    **backend_options: Any,
) -> CommManager:
    """Create a :class:`CommManager` for ``layout``.

    Each option left at None comes from its environment variable, else its default (kvtransport.config):

    * ``backend`` (``KV_TRANSPORT``): a name, or ``auto``: the best available for the layout's memory.
    * ``ifname`` (``NET_IFNAME``): interface for side channel and backend; loopback when unset.
    * ``capacity`` (``KV_TRANSPORT_CAPACITY``, 1024): sequence slots of the receiver.
    * ``timeout`` (``KV_TRANSPORT_TIMEOUT``, 30): seconds, default bound for connect/handshake/internal waits.
    * ``port`` (``KV_TRANSPORT_PORT``, 0 = any free one): side-channel port.
    * ``secret`` (``KV_TRANSPORT_SECRET``): peers must prove it (HMAC) in the handshake.
    * ``coalesce`` (``KV_TRANSPORT_COALESCE``, True): merge adjacent blocks into runs.
    * ``checksum`` (``KV_TRANSPORT_CHECKSUM``, False): debug option, CRC-32 of every put checked (host memory).
    * ``doorbell`` (``KV_TRANSPORT_DOORBELL``, True): False keeps completions on the side channel only.

    Other keyword options are the backend's own (e.g. ucx ``tls``, nccl ``strategy``); a name that neither
    the core nor the chosen backend knows is refused, naming the closest valid one. Blocking only for backend
    set-up. Raises ConfigurationError subclasses (each names the fix) or LayoutError.
    """
    if not isinstance(layout, KVLayout):
        raise LayoutError(f"open() needs a KVLayout (KVLayout.from_tensors(...)), got {type(layout).__name__}")
    settings = resolve(backend, ifname, capacity=capacity, timeout=timeout, port=port, secret=secret,
                       coalesce=coalesce, checksum=checksum, doorbell=doorbell, **backend_options)
    if settings.checksum and layout.is_cuda:
        raise ConfigurationError("checksum=True (a debug option) verifies host memory only; turn it off for CUDA caches")
    spec = registry.choose(settings.backend, layout.memory_kind)
    registry.check_options(spec, backend_options)
    with map_errors(BackendUnavailable, f"backend {spec.name} could not start"):  # a library's error, typed
        transport = spec.create(layout, settings)
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
    "ForeignSequence",
    "IncompatiblePeer",
    "InterfaceNotFound",
    "InvalidArgument",
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
