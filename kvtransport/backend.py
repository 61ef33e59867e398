"""The backend interface (SPI). A backend moves bytes; everything else (coalescing, sequence slots,
handshake, signals, timeouts, errors) is generic code in :mod:`kvtransport.manager` (its sending and
receiving sides: :mod:`kvtransport.sending`, :mod:`kvtransport.receiving`).

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

What an outbound link can do beyond puts is declared, never looked up by name: a link class lists the
optional capabilities it implements among its bases (:class:`CompletionMarks`, :class:`FlushAndSend`), and
the core checks them once, with ``isinstance``, when the link is set up. A device-written doorbell is the
link's typed ``doorbell`` attribute (a :class:`DoorbellWriter`, or None), since a link has one on some paths
only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .coalesce import BlockRun
from .config import Settings
from .layout import KVLayout
from .parking import Parking

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


class DoorbellWriter(Protocol):
    """A device-written completion word (:mod:`kvtransport.doorbell`), offered by a link whose puts are device
    launches into peer-mapped memory on one host (``OutboundLink.doorbell``); the receiver then sees completion
    without the side channel. Called by the core's sending side (:mod:`kvtransport.sending`), one thread at a
    time per link; only ``doorbell_unmap`` may wait (briefly, bounded)."""

    def doorbell_map(self, address: int, size: int) -> int | None:
        """Make ``size`` bytes of host memory at ``address`` writable from the device: its device address, or
        None when that is not possible (the link then signals by frame only). Called once, right after
        connect; an exception is treated like None."""
        ...

    def doorbell_write(self, device_address: int, value: int) -> None:
        """Enqueue a store of ``value`` (u64) at ``device_address`` that runs after every put issued so far
        has landed. Non-blocking; called under the link's put lock, in order with the puts. An exception
        makes the core stop using the doorbell (signals go by frame only)."""
        ...

    def doorbell_unmap(self, address: int) -> None:
        """Undo :meth:`doorbell_map` once the stores headed there have run (waiting for them briefly, bounded;
        else leave it mapped). Called once, at the link's close, after the link's own ``close``, under the
        link's put lock; exceptions are logged."""
        ...


class Mailbox(Protocol):
    """The one-slot mailbox of a :meth:`FlushAndSend.flush_and_send` wait in progress (see there)."""

    def append(self, data: bytes) -> bool:
        """Have ``data`` (whole frames) written right after the wait's bytes; False when the wait ended or
        the slot is taken (the core then sends ``data`` itself). Non-blocking; called by the core under its
        lock, from a thread other than the waiting one."""
        ...

    def close(self) -> tuple[bytes | None, int]:
        """Close the slot once the wait returned: (the appended bytes or None, how many of them the wait
        wrote). Called by the core on the waiting thread."""
        ...


class OutboundLink(ABC):
    """Sender side of one peer link. Used from one thread at a time (the CommManager serialises).

    Optional capabilities, declared by listing them among the link class's bases (the core checks with
    ``isinstance`` once, when the link is set up, and uses what it finds from then on):

    * :class:`CompletionMarks` (``mark``/``landed``): a signal whose puts already landed is sent from the
      caller's thread instead of the signaller thread (ucx, mscclpp).
    * :class:`FlushAndSend` (``flush_and_send``): the signaller's flush writes the signal batch to the side
      channel from the same GIL-free wait that saw the puts land (ucx's C helper).
    * ``doorbell`` (below): a :class:`DoorbellWriter`, or None.
    """

    doorbell: DoorbellWriter | None = None
    """The link's device-written doorbell, or None (the default). Read once, right after connect: set it in
    the constructor. Links whose puts are device launches into peer-mapped memory on one host offer one."""

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


class CompletionMarks(ABC):
    """Optional capability of an :class:`OutboundLink`: what has landed, known without waiting.

    Called by the core's sending side: ``mark`` on a caller's thread for each frame queued behind puts
    (signal, cancel, checksum), with no core lock held and possibly while another thread puts; ``landed``
    after puts and signals, on a caller's thread or the signaller thread, one call at a time (under the
    link's ``_send_order``) and possibly while the core holds the link's state lock. So neither may block,
    take a lock another thread holds for long, or call back into the core. Neither should raise: an
    exception reaches the API call during which it was asked (caller's thread), or fails the link's queued
    signals (signaller thread)."""

    @abstractmethod
    def mark(self) -> Any:
        """An opaque token for everything issued so far (compared only by :meth:`landed`). Non-blocking."""

    @abstractmethod
    def landed(self, token: Any) -> bool:
        """Whether everything issued before ``token`` was taken has landed, as far as is known without
        progressing or waiting (False when unsure). Non-blocking."""


class FlushAndSend(ABC):
    """Optional capability of an :class:`OutboundLink` of a one-sided backend: flush, then write bytes to the
    side channel's socket from the same wait, so a signal leaves the moment its puts land (not when the
    signaller thread next gets the interpreter)."""

    @abstractmethod
    def flush_and_send(
        self,
        timeout: float,
        fd: int = -1,
        data: bytes = b"",
        parking: Parking | None = None,
        on_wait: Callable[[Mailbox], None] | None = None,
    ) -> int:
        """Like :meth:`OutboundLink.flush`; then, from the wait that saw the puts land, write ``data`` (whole
        frames) to the socket ``fd``. Returns how many bytes of ``data`` it wrote (0 when the flush had
        nothing to wait for, or when it cannot write from the wait); the core writes the rest. ``fd`` -1 and
        no ``data``: a plain flush.

        Called by the core's signaller thread only, while it holds the side channel's send lock (nobody else
        writes to ``fd`` meanwhile). Blocking, bounded by ``timeout``; raises like ``flush``
        (TransferTimeout, PeerDisconnected, TransferError). ``parking`` (the link's :class:`Parking`, or
        None): call its ``park()`` before each wait without the GIL, and have the wait set its ``since`` and
        clear its ``flag`` when the thread needs the interpreter again. ``on_wait(mailbox)``, when given, is
        called before a wait that can write from its end (never otherwise, at most once): while the wait is
        on, the core may ``mailbox.append(bytes)`` from another thread to have them written right after
        ``data``, and closes the mailbox after this returns."""


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
