"""The backend interface (SPI). A backend moves bytes; everything else (coalescing, sequence slots,
handshake, signals, timeouts, errors) is generic code in :mod:`kvtransport.manager`.

A distribution registers a :class:`BackendSpec` under the entry-point group ``kvtransport.backends``::

    [project.entry-points."kvtransport.backends"]
    mine = "my_pkg.spec:SPEC"

The spec module must import nothing heavy; ``probe()`` and ``create()`` import the backend's libraries.

Connection set-up is two-phase, driven by the core's side channel (sender = the side that calls
``connect``, receiver = the side whose metadata was passed to it)::

    sender:   dialer = transport.dial(peer)            -> dialer.request (JSON-able) sent in HELLO
    receiver: answer = transport.answer(peer, request) -> answer.reply   sent in WELCOME
    receiver: inbound = answer.complete(timeout)       (may block for the rendezvous, e.g. a process group)
    sender:   outbound = dialer.complete(reply, timeout)

Capabilities decide what the generic code does: with ``one_sided`` the receiver never takes part in a
put, and the sender flushes before signalling; without it, the receiver's ``InboundLink.receive`` is
called for each put, in order, from the side-channel thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .coalesce import BlockRun
from .config import Settings
from .layout import KVLayout

JSONDict = dict[str, Any]


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; generic code branches on these, never on backend names."""

    one_sided: bool
    """Puts land without the receiver's participation (RDMA/IPC); the sender must flush before signalling."""
    memory_kinds: frozenset[str]
    """Memory a backend reads and writes: ``{"cpu"}``, ``{"cuda"}`` or both."""
    cross_host: bool = True
    """Can reach peers on other hosts."""
    notes: str = ""


@dataclass(frozen=True)
class Availability:
    """Outcome of :meth:`BackendSpec.probe`: usable, or not with the reason and the fix."""

    ok: bool
    reason: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Finding:
    """One preflight check of ``kvtransport doctor``: level ``ok``/``warn``/``fail``, what, and the fix."""

    level: str
    check: str
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        tail = f"\n        fix: {self.fix}" if self.fix else ""
        return f"[{self.level:>4}] {self.check}: {self.detail}{tail}"


@dataclass(frozen=True)
class PeerInfo:
    """What the generic layer knows about a peer when the backend is asked to link to it."""

    instance: str
    host: str
    layout: KVLayout
    transport: JSONDict
    """The peer's ``Transport.describe()`` output, from its metadata."""


class OutboundLink(ABC):
    """Sender side of one peer link. Used from one thread at a time (the CommManager serialises).

    Optional completion hooks (looked up by name; a backend offers all of a pair or none):

    * ``mark() -> token`` and ``landed(token) -> bool``, both non-blocking: a token for everything issued
      so far, and whether all of it has landed as far as is known without waiting (False when unsure).
      With them, a signal whose puts already landed is sent from the caller's thread instead of the
      signaller thread (ucx, mscclpp).
    * ``flush_and_send(timeout, fd, data, parking, on_wait) -> int``: flush, then write ``data`` to the side
      channel's socket ``fd`` from the same GIL-free wait; returns the bytes written (ucx's C helper).
    * ``doorbell``: an object with ``doorbell_map(address, size) -> int | None`` (make host memory
      writable from the device; its device address, or None), ``doorbell_write(device_address, value)``
      (enqueue a store that runs after every put so far has landed; non-blocking) and
      ``doorbell_unmap(address)``; or None. Links whose puts are device launches into peer-mapped memory
      on one host offer it (kvtransport.doorbell: the receiver sees completion without the side channel).
    """

    doorbell: Any = None

    @abstractmethod
    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        """Start moving ``runs`` of ``layer`` to the peer. Non-blocking where the backend allows.

        Two-sided backends: called right after the PUT header went out; the receiver's ``receive`` gets the
        same runs. One-sided: the bytes must be in the peer's memory once ``flush`` returns."""

    def put_layers(self, layers: Sequence[int], runs: Sequence[BlockRun]) -> None:
        """The same ``runs`` of every layer in ``layers``, in one call (a whole request). Same contract as
        :meth:`put`, layer by layer; this default calls it per layer. Backends that can move many layers in
        one operation (one device launch) override it; two-sided backends keep the default (their receiver
        takes one PUT per layer)."""
        for layer in layers:
            self.put(layer, runs)

    @abstractmethod
    def flush(self, timeout: float) -> None:
        """Block until every earlier put is complete at the peer (one-sided) or handed off in order
        (two-sided). Raises TransferTimeout / PeerDisconnected / TransferError."""

    def describe(self) -> str:
        """The path in use, for users and metrics (e.g. ``"gloo tcp over lo"``, ``"ucx cma"``)."""
        return ""

    @abstractmethod
    def close(self) -> None:
        """Release resources; must return promptly even with work in flight."""


class InboundLink(ABC):
    """Receiver side of one peer link (two-sided backends receive here; one-sided ones only clean up)."""

    def receive(self, layer: int, runs: Sequence[BlockRun], timeout: float) -> None:
        """Receive the data of one PUT into the local blocks, blocking until it is in place."""
        raise NotImplementedError("one-sided backends do not receive")

    def discard(self, layer: int, runs: Sequence[BlockRun], timeout: float) -> None:
        """Consume the data of a PUT whose sequence was dropped, without writing local blocks."""
        raise NotImplementedError("one-sided backends do not receive")

    @abstractmethod
    def close(self) -> None:
        """Release resources; must return promptly."""


class Dialer(ABC):
    """Sender-side state between HELLO and WELCOME."""

    request: JSONDict

    @abstractmethod
    def complete(self, reply: JSONDict, timeout: float) -> OutboundLink: ...

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Called instead of ``complete`` when the handshake failed."""


class Answer(ABC):
    """Receiver-side state between HELLO and the link being usable."""

    reply: JSONDict

    @abstractmethod
    def complete(self, timeout: float) -> InboundLink: ...

    def abort(self) -> None:  # noqa: B027 - optional hook
        """Called instead of ``complete`` when the handshake failed."""


class Transport(ABC):
    """One backend instance bound to one local layout (created by ``BackendSpec.create``)."""

    name: str
    capabilities: Capabilities

    def describe(self) -> JSONDict:
        """JSON-able facts a peer needs (e.g. remote keys); goes into ``cm.metadata()``."""
        return {}

    @abstractmethod
    def dial(self, peer: PeerInfo) -> Dialer: ...

    @abstractmethod
    def answer(self, peer: PeerInfo, request: JSONDict) -> Answer: ...

    def stats(self) -> JSONDict:
        return {}

    @abstractmethod
    def close(self) -> None: ...


class BackendSpec(ABC):
    """A registry entry: cheap to import, probes and creates the real backend lazily."""

    name: str
    priority: int = 0
    """``auto`` picks the available backend with the highest priority for the layout's memory kind."""
    auto_select: bool = True
    install_hint: str = ""
    memory_kinds: frozenset[str] = frozenset({"cpu"})
    cross_process: bool = True
    """False for a backend whose peers must live in one process (the in-process reference backend)."""
    test_only: bool = False
    """True for a backend meant for tests (``inproc``): usable by name, left out of user listings
    (``kvtransport backends``, doctor, the demo's and set-up's printouts) and never chosen by ``auto``."""
    options: tuple[str, ...] | None = None
    """Names of the backend's own keyword options of ``kvtransport.open()`` (``()``: none). With it, a
    misspelt option is refused before the backend starts, naming the closest valid one; None (undeclared)
    hands every unknown option to :meth:`create`."""

    @abstractmethod
    def probe(self) -> Availability:
        """Can this backend run here? Never raises; imports the backend's libraries."""

    def doctor(self) -> list[Finding]:
        """Backend-specific preflight findings for ``kvtransport doctor`` (build, devices, limits). Never
        raises; called only when the backend's distribution is installed."""
        return []

    @abstractmethod
    def create(self, layout: KVLayout, settings: Settings) -> Transport:
        """Build a transport for ``layout``. Raises typed kvtransport errors."""
