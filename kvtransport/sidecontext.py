"""What a :class:`~kvtransport.manager.CommManager` hands the two sides it is made of (:mod:`kvtransport.sending`,
:mod:`kvtransport.receiving`): its settings, layout and identity, the backend, the sequence table, the counters and
a thread starter. Neither side sees the manager; the manager composes them.

Lock: :attr:`Counters.lock` is a leaf (nothing is taken while it is held); the whole order is in
:mod:`kvtransport.manager`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backend import Capabilities, Transport
from .config import Settings
from .errors import IncompatiblePeer
from .layout import KVLayout
from .semaphores import SequenceTable


@dataclass
class Stats:
    """Counters of one manager (``cm.stats()`` returns them as a dict)."""

    puts: int = 0
    runs: int = 0
    pieces: int = 0
    bytes_sent: int = 0
    signals: int = 0
    puts_received: int = 0
    bytes_received: int = 0
    sequences_completed: int = 0
    doorbell_signals: int = 0
    """Signals the receiver applied from a device-written doorbell before their SIGNAL frame came."""
    failures: int = 0
    refused_peers: int = 0
    foreign_refused: int = 0
    """Events (puts, signals, cancels) refused because their sequence belongs to another sender."""
    aborted: int = 0


class Counters:
    """A manager's :class:`Stats` and the lock they are updated under (several fields of one event under one
    round: ``with counters.lock: counters.stats.puts += 1; ...``). Any thread."""

    __slots__ = ("lock", "stats")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stats = Stats()

    def add(self, name: str, n: int = 1) -> None:
        """``stats.<name> += n`` under the lock."""
        with self.lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return dict(vars(self.stats))


@dataclass(eq=False)
class SideContext:
    """What the sender's and the receiver's objects use of their manager, handed to them when they are made."""

    settings: Settings
    layout: KVLayout
    instance: str
    """This manager's instance id (what its peers know it by)."""
    transport: Transport
    backend: str
    """``transport.name``."""
    capabilities: Capabilities
    """``transport.capabilities``."""
    table: SequenceTable
    """The receiver's sequence slots (the sender side does not use it)."""
    counters: Counters
    spawn: Callable[..., threading.Thread]
    """``spawn(fn, name, *args)``: start a daemon thread the manager joins at close (RuntimeError when none can
    be started)."""

    def count_failure(self) -> None:
        self.counters.add("failures")

    def check_compatible(self, meta: dict[str, Any]) -> None:
        """Raise IncompatiblePeer unless the peer's backend and layout (``meta``: decoded metadata) match ours."""
        if meta["backend"] != self.backend:
            raise IncompatiblePeer(
                f"peer uses backend {meta['backend']!r}, we use {self.backend!r}: set the same KV_TRANSPORT on both sides"
            )
        if meta["layout_hash"] != self.layout.compat_hash():
            raise IncompatiblePeer(
                "KV layouts differ, transfers would corrupt data: "
                + self.layout.describe_mismatch(meta["layout_signature"])
                + " (same model, dtype, block size and VLLM_KV_CACHE_LAYOUT are needed on both sides)"
            )
        if meta["instance"] == self.instance:
            raise IncompatiblePeer("cannot connect a CommManager to itself")
