"""The sending side of the CommManager: one :class:`Outbound` per connected receiver (its puts, the queue
of frames that must follow them, the signaller and reader threads), and the sender's input check of explicit
runs and link set-up helper. An ``Outbound`` gets what it uses of its manager in a
:class:`~kvtransport.sidecontext.SideContext` (settings, the backend's name and capabilities, the layout's block
sizes, the counters, the thread starter); it never sees the manager.

What a link offers beyond puts is found once, when its ``Outbound`` is created, from the capabilities its
class declares (:class:`~kvtransport.backend.CompletionMarks`, :class:`~kvtransport.backend.FlushAndSend`)
and its ``doorbell`` attribute (:class:`~kvtransport.backend.DoorbellWriter`).

Locks held here, in the order they nest: ``_put_lock`` or ``_send_order`` (never both), the side channel's send lock,
``_lock`` with its conditions ``_idle``/``_wake``, then the parking object's lock; the whole order, with the
manager's locks: :mod:`kvtransport.manager`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import doorbell, wire
from .backend import CompletionMarks, DoorbellWriter, FlushAndSend, Mailbox, OutboundLink, PeerInfo
from .coalesce import BlockRun
from .doorbell import BellWriter
from .errors import (
    CommClosed,
    InvalidBlockIds,
    KVTransportError,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    TransferError,
    TransferTimeout,
    map_errors,
)
from .parking import Parking
from .semaphores import SeqId
from .sidechannel import FramedSocket
from .sidecontext import SideContext
from .wire import FrameType

log = logging.getLogger("kvtransport")
MAX_FAILED_RECORDS = 65536
"""Failed sequences a sender remembers per link (until release()); the oldest go first past it."""

FlushAndSendFn = Callable[[float, int, bytes, Parking | None, Callable[[Mailbox], None] | None], int]
"""A link's bound :meth:`~kvtransport.backend.FlushAndSend.flush_and_send`."""


def checked_runs(runs: Any, src_blocks: int, dst_blocks: int) -> tuple[BlockRun, ...]:
    """Explicit runs ``(src, dst, count)`` validated (InvalidBlockIds): counts >= 1, every block inside the
    sender's ``src_blocks`` and the receiver's ``dst_blocks``, no destination block written twice."""
    if isinstance(runs, str | bytes | bytearray | dict) or not hasattr(runs, "__iter__"):
        raise InvalidBlockIds(f"runs must be a sequence of (src, dst, count), got {type(runs).__name__}")
    out: list[BlockRun] = []
    for r in runs:
        try:
            s, d, c = (int(x) if type(x) is int or _int_like(x) else _not_int(x) for x in r)
        except (TypeError, ValueError):
            raise InvalidBlockIds(f"a run must be three integers (src, dst, count), got {r!r}") from None
        if c < 1 or s < 0 or d < 0:
            raise InvalidBlockIds(f"run {r!r}: ids must be >= 0 and count >= 1")
        if s + c > src_blocks:
            raise InvalidBlockIds(f"run {r!r} reads beyond the sender's {src_blocks} blocks")
        if d + c > dst_blocks:
            raise InvalidBlockIds(f"run {r!r} writes beyond the receiver's {dst_blocks} blocks")
        out.append(BlockRun(s, d, c))
    end = -1
    for r in sorted(out, key=lambda r: r.dst):
        if r.dst < end:
            raise InvalidBlockIds(f"destination block {r.dst} is written twice; each is written once")
        end = r.dst + r.count
    return tuple(out)


def _int_like(x: object) -> bool:
    """numpy integer scalars pass; bool, float and str do not."""
    return hasattr(x, "__index__") and not isinstance(x, bool) and type(x).__name__.startswith(("int", "uint"))


def _not_int(x: object) -> int:
    raise TypeError(f"not an integer: {x!r}")


def complete_watching_refusal(conn: FramedSocket, dialer: Any, reply: dict[str, Any], deadline: float,
                              label: str) -> OutboundLink:
    """``dialer.complete(reply, ...)`` on a helper thread while this thread watches the side channel.

    Between WELCOME and a working link the receiver sends nothing unless its own half of the link fails; then
    it sends REFUSE with its reason. A backend's completion may block until the deadline (a rendezvous with a
    peer that will never come); watching for that REFUSE ends the connect at once with the receiver's own
    reason instead. Raises the receiver's error, or whatever ``complete`` raised; bounded by ``deadline``."""
    outcome: dict[str, Any] = {}
    finished = threading.Event()
    abandoned = threading.Event()

    def run() -> None:
        try:
            made = dialer.complete(reply, max(0.001, deadline - time.monotonic()))
            if abandoned.is_set():  # the caller gave up (the receiver refused): nobody will use this link
                made.close()
            else:
                outcome["link"] = made
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=run, name=f"kvt-dial-{label}", daemon=True).start()
    while not finished.is_set() and time.monotonic() < deadline + 1.0:  # a backend that overruns is given up
        if not conn.readable(0.005):
            continue
        if finished.is_set():
            break
        try:
            kind, payload = conn.recv(deadline)
        except KVTransportError:
            finished.wait(max(0.0, deadline - time.monotonic()))  # the socket failed: the backend says why
            break
        abandoned.set()
        if kind == FrameType.REFUSE:
            raise wire.error_from_wire(wire.parse_json_payload(payload, "REFUSE"))
        raise ProtocolError(f"unexpected {kind.name} frame from {label} while the link was being set up")
    if "error" in outcome:
        raise outcome["error"]
    if "link" not in outcome:
        abandoned.set()
        raise TransferTimeout(f"link set-up with {label} did not finish in time")
    link: OutboundLink = outcome["link"]
    return link


class Outbound:
    """Sender-side state of one peer link.

    One-sided backends: a frame that must arrive after earlier puts (SIGNAL, CANCEL, CHECKSUM) is queued
    with the link's mark of what it had issued then (``link.mark()``, for links that declare
    :class:`~kvtransport.backend.CompletionMarks`). Queued frames leave in order and in batches (one socket
    write): from the caller's thread at once when everything they follow has already landed and nothing
    older is waiting, otherwise from the signaller thread, which flushes the link once per batch. A caller's
    later put or signal also sends the frames whose puts have landed meanwhile, so a busy caller thread —
    which holds the GIL and would keep the signaller waiting up to the interpreter's switch interval — still
    moves them along; and a caller lets the signaller run first when it needs the interpreter
    (:class:`~kvtransport.parking.Parking`).

    A link that declares :class:`~kvtransport.backend.FlushAndSend` offers ``link.flush_and_send(timeout,
    fd, data, parking, on_wait) -> int``: flush, then write the batch's bytes to the side channel's socket
    from the same GIL-free wait that saw the puts land (returns the bytes it wrote; the manager writes the
    rest). Then a signal leaves when its copy ends, not when the signaller next gets the interpreter. Before
    such a wait it calls ``on_wait(mailbox)``: while the wait is on, one frame queued with the same mark
    (nothing issued since; typically the request's ``signal`` right after its last ``signal_layer``) is
    handed to ``mailbox.append(bytes)`` and written right after the batch; ``mailbox.close()`` (after the
    wait) says how much of it was.
    """

    def __init__(self, ctx: SideContext, conn: FramedSocket, link: OutboundLink, info: PeerInfo) -> None:
        self.ctx = ctx
        self.conn = conn
        self.link = link
        self.info = info
        self.one_sided = ctx.capabilities.one_sided
        self._layer_block_bytes = [layer.block_bytes for layer in ctx.layout.layers]
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self._send_order = threading.Lock()  # held by whoever takes queued frames and sends them: order kept
        self._failed: dict[SeqId, KVTransportError] = {}
        self._error: KVTransportError | None = None
        self._delivery_error: KVTransportError | None = None  # a queued signal could not be delivered
        self._closed = False
        self._stopping = False
        self._items: list[tuple[FrameType, bytes, Any]] = []  # queued frames with the link's mark
        self._pending = 0  # frames queued or being delivered
        self._idle = threading.Condition(self._lock)
        self._wake = threading.Condition(self._lock)
        # what the link offers beyond puts (kvtransport.backend): declared by its class, found once here
        marks = link if isinstance(link, CompletionMarks) else None
        self._mark: Callable[[], Any] | None = marks.mark if marks is not None else None
        self._landed: Callable[[Any], bool] | None = marks.landed if marks is not None else None
        self._flush_and_send_fn: FlushAndSendFn | None = (
            link.flush_and_send if isinstance(link, FlushAndSend) else None)
        self._door: DoorbellWriter | None = link.doorbell
        self._parking = Parking()
        self._signaller_idle = False
        self._inflight: tuple[Mailbox, Any] | None = None  # (mailbox, mark) of the batch the backend is flushing
        self._inflight_extra: list[tuple[FrameType, bytes, Any]] = []  # frames added to that mailbox
        self._bell: BellWriter | None = None  # this link's doorbell (see open_doorbell)
        self._bell_word = 0  # device address of its completion word
        self._bell_host = 0  # host address of its mapping
        self._unsignalled = [0, 0]  # one-sided: puts and bytes issued since the last SIGNAL (under _put_lock)
        self._reader = ctx.spawn(self._read_loop, f"kvt-out-{info.instance[:6]}")
        if self.one_sided:
            self._signaller = ctx.spawn(self._signal_loop, f"kvt-sig-{info.instance[:6]}")

    def open_doorbell(self) -> None:
        """Right after connect, before any signal: offer the receiver a doorbell if the link can write one
        (``link.doorbell``; kvtransport.doorbell). Without one, or if anything fails, signals go by frame."""
        door = self._door
        if door is None or not self.one_sided or self.ctx.settings.checksum or not self.ctx.settings.doorbell:
            return
        try:
            bell = BellWriter()
        except OSError as exc:
            log.info("no doorbell towards %s (%s): completions go by the side channel", self.conn.peer_label, exc)
            return
        try:
            dev = door.doorbell_map(bell.address, doorbell.SIZE)
        except Exception as exc:  # a backend's unexpected failure costs the doorbell, not the link
            log.info("no doorbell towards %s (%s)", self.conn.peer_label, exc)
            dev = None
        if dev is None:
            bell.close()
            return
        self._bell, self._bell_host, self._bell_word = bell, bell.address, dev + bell.word_offset
        try:
            self.conn.send(FrameType.DOORBELL, wire.json_payload({"path": bell.path}))
        except KVTransportError:
            pass  # the link is gone: the next call on it says so

    def _ring(self, seq: SeqId, layer: int | None) -> int:
        """Announce a signal on the doorbell and enqueue the device's store of its ticket (after the puts);
        returns the ticket, 0 if it goes by frame only. Caller holds ``_put_lock``."""
        bell, door = self._bell, self._door
        if bell is None or door is None:  # (a bell is only ever opened with the link's doorbell)
            return 0
        ticket = bell.announce(seq, layer)
        if ticket:
            try:
                door.doorbell_write(self._bell_word, ticket)
            except Exception as exc:  # the frame carries this signal (and its ticket: the receiver then
                # knows the entry is done with); later signals go by frame only
                log.warning("doorbell store failed (%s); completions go by the side channel from now on", exc)
                self._bell = None
        return ticket

    def _check(self, seq: SeqId | None) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise CommClosed("link to peer closed")
            if seq is not None and seq in self._failed:
                raise self._failed[seq]

    def put(self, seq: SeqId, layers: Sequence[int], runs: Sequence[BlockRun]) -> None:
        """Issue ``runs`` of each of ``layers`` (one link call for many layers when one-sided)."""
        with self._put_lock:  # an abort fence cannot slip between the check and the issue
            self._check(seq)
            try:
                # a backend that leaks its library's error: still a typed error, and it fails the link
                with map_errors(TransferError, f"{self.ctx.backend} put failed", peer=self.info.instance):
                    if self.one_sided:  # the receiver learns these counts from the next SIGNAL
                        nblocks = sum(r.count for r in runs)
                        self._unsignalled[0] += len(layers)
                        self._unsignalled[1] += sum(nblocks * self._layer_block_bytes[layer] for layer in layers)
                    if len(layers) == 1:
                        if not self.one_sided:
                            self.conn.send(FrameType.PUT, wire.encode_put(seq, layers[0], runs))
                        self.link.put(layers[0], runs)
                    elif self.one_sided:
                        self.link.put_layers(layers, runs)
                    else:  # the receiver takes one PUT frame, then the data, per layer
                        for layer in layers:
                            self.conn.send(FrameType.PUT, wire.encode_put(seq, layer, runs))
                            self.link.put(layer, runs)
            except KVTransportError as exc:
                self._fail_link(exc)
                raise
        if self._items and self._landed is not None:  # earlier signals whose puts landed meanwhile
            self._deliver_landed()
        self._parking.after_call(end_of_burst=False)

    def mark_failed(self, seq: SeqId, exc: KVTransportError) -> None:
        """Record that ``seq`` failed on this link (its next put/signal raises ``exc``). Bounded: past
        MAX_FAILED_RECORDS the oldest records go (a receiver cannot grow our memory with made-up NACKs)."""
        with self._lock:
            self._failed.pop(seq, None)
            self._failed[seq] = exc
            while len(self._failed) > MAX_FAILED_RECORDS:
                del self._failed[next(iter(self._failed))]

    def _on_abort(self, seq: SeqId, token: int) -> None:
        """The receiver aborts ``seq``: refuse further puts, let issued ones land, then confirm."""
        with self._put_lock:
            self.mark_failed(seq, SequenceAborted(f"sequence {seq!r} was aborted by the receiver"))
        if self.one_sided:
            self.link.flush(self.ctx.settings.timeout)
        self.conn.send(FrameType.ABORT_ACK, wire.encode_abort(seq, token))

    def signal(self, seq: SeqId, layer: int | None) -> None:
        self._check(seq)
        ticket = puts = nbytes = 0
        with self._put_lock:  # after the puts it follows, like them
            if self._bell is not None:
                ticket = self._ring(seq, layer)
            if self.one_sided:
                (puts, nbytes), self._unsignalled = self._unsignalled, [0, 0]
        self._control(FrameType.SIGNAL, wire.encode_signal(seq, layer, ticket, puts, nbytes))
        if self.one_sided:
            self._parking.after_call(end_of_burst=layer is None)

    def cancel(self, seq: SeqId) -> None:
        with self._put_lock:
            self.mark_failed(seq, SequenceAborted(f"sequence {seq!r} was cancelled by the sender"))
        self._control(FrameType.CANCEL, wire.encode_cancel(seq))
        if self.one_sided:
            self._parking.after_call(end_of_burst=True)

    def control(self, kind: FrameType, payload: bytes) -> None:
        """Queue a frame in order with signals (see ``_control``)."""
        self._control(kind, payload)

    def _control(self, kind: FrameType, payload: bytes) -> None:
        """Send a frame that must arrive after every earlier put has landed (one-sided: queued with the
        link's mark, see the class docstring; two-sided: the side channel's order is enough)."""
        if not self.one_sided:
            self.conn.send(kind, payload)
            return
        token = self._mark() if self._mark is not None else None
        with self._lock:
            self._pending += 1
            fl = self._inflight
            if (fl is not None and not self._items and not self._inflight_extra and fl[1] == token
                    and fl[0].append(wire.frame(kind, payload))):
                # nothing issued since the batch being flushed: this frame leaves right after it
                self._inflight_extra.append((kind, payload, token))
                return
            self._items.append((kind, payload, token))
        if not self._deliver_landed():
            with self._lock:
                if self._signaller_idle:
                    self._signaller_idle = False
                    self._parking.unpark()  # it needs the interpreter to start (the caller may yield)
                self._wake.notify()

    def _landed_count(self, items: list[tuple[FrameType, bytes, Any]]) -> int:
        """How many of ``items``, from the oldest, follow only puts known to have landed. Non-blocking."""
        landed = self._landed
        n = 0
        if landed is not None:
            for item in items:
                if not landed(item[2]):
                    break
                n += 1
        return n

    def _deliver_landed(self) -> bool:
        """On the caller's thread: send the queued frames whose puts have landed, unless another thread is
        delivering. Never waits for a put. Returns True when nothing is left queued."""
        if self._landed is None or not self._send_order.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if self._error is not None or self._closed:
                    return False  # the signaller accounts for them
                n = self._landed_count(self._items)
                batch = self._items[:n]
                del self._items[:n]
                empty = not self._items
            if batch:
                self._send(batch)
            return empty
        finally:
            self._send_order.release()

    def _send(self, batch: list[tuple[FrameType, bytes, Any]]) -> None:
        """Write ``batch`` in one go (under ``_send_order``) and account for it, delivered or not."""
        try:
            if self._error is None:
                self.conn.send_many([(k, p) for k, p, _ in batch])
            else:
                self._delivery_error = self._error
        except KVTransportError as exc:
            self._delivery_error = exc
            self._fail_link(exc)
        finally:
            with self._lock:
                self._pending -= len(batch)
                self._idle.notify_all()

    def flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            # wait for the signaller to account for everything queued, even when the link failed meanwhile:
            # a batch it already sent must not be reported as lost (it skips the rest quickly)
            while self._pending and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"{self._pending} signals to {self.conn.peer_label} not delivered in {timeout:.3g}s")
                self._idle.wait(left)
            # everything queued was delivered unless a delivery failed: a peer that left *after*
            # receiving it all does not make this flush fail
            if self._delivery_error is not None:
                raise self._delivery_error
            if self._closed:
                raise CommClosed("link to peer closed")
            if self._pending:
                raise self._error or PeerDisconnected("link to peer lost")
        if self.one_sided:
            # puts issued after the last signal (or without one) must have landed too
            if not self._send_order.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TransferTimeout(f"puts to {self.conn.peer_label} not flushed in {timeout:.3g}s")
            try:
                self._flush_link(max(0.001, deadline - time.monotonic()))
            finally:
                self._send_order.release()
        else:
            with self._put_lock:  # the link's own bookkeeping is not shared between threads
                self._flush_link(max(0.001, deadline - time.monotonic()))

    def _flush_link(self, timeout: float) -> None:
        with map_errors(TransferError, f"{self.ctx.backend} flush failed"):  # a library's error, typed
            self.link.flush(timeout)

    def forget(self, seq: SeqId) -> None:
        with self._lock:
            self._failed.pop(seq, None)

    def _signal_loop(self) -> None:
        """Deliver queued frames: flush once for every batch, then send it in one write (order kept)."""
        try:
            while True:
                with self._lock:
                    while not self._items and not self._stopping:
                        self._signaller_idle = True
                        self._parking.park()
                        self._wake.wait()
                    self._signaller_idle = False
                    if not self._items:
                        return  # stopping, and nothing left
                self._parking.unpark()
                if not self._send_order.acquire(blocking=False):
                    self._parking.park()  # blocked on a caller that is delivering or flushing: nothing to yield to
                    self._send_order.acquire()
                    self._parking.unpark()
                try:
                    with self._lock:
                        batch, self._items = self._items, []
                    if batch:
                        self._flush_and_send(batch)
                finally:
                    self._send_order.release()
        finally:
            self._parking.park()  # nobody waits for a signaller that is gone

    def _flush_and_send(self, batch: list[tuple[FrameType, bytes, Any]]) -> None:
        sent = False
        extra: list[tuple[FrameType, bytes, Any]] = []
        try:
            if self._error is None and self._landed_count(batch) < len(batch):
                timeout = self.ctx.settings.timeout
                fs = self._flush_and_send_fn
                if fs is not None:  # the backend writes the batch the moment the puts land (class docstring)
                    token = batch[-1][2]

                    def on_wait(mailbox: Mailbox) -> None:
                        with self._lock:
                            self._inflight = (mailbox, token)

                    def write(fd: int, data: bytes) -> tuple[bytes, int]:
                        try:
                            n = int(fs(timeout, fd, data, self._parking, on_wait))
                        finally:
                            self._parking.unpark()
                            with self._lock:  # no frame joins this batch any more
                                fl, self._inflight = self._inflight, None
                                extra[:], self._inflight_extra = self._inflight_extra, []
                            more, more_sent = fl[0].close() if fl is not None else (None, 0)
                        if more is None:
                            return data, n
                        return data + more, n + more_sent if n == len(data) else n

                    self.conn.send_prepared(b"".join(wire.frame(k, p) for k, p, _ in batch), write)
                    sent = True
                else:
                    self._parking.park()  # a backend's own wait: callers need not yield to us meanwhile
                    try:
                        self._flush_link(timeout)
                    finally:
                        self._parking.unpark()
                if self._landed is not None:  # frames queued during the flush that it covered: sent now too
                    with self._lock:
                        n = self._landed_count(self._items)
                        more_items = self._items[:n]
                        del self._items[:n]
                    if sent:
                        if more_items:
                            self._send(more_items)
                    else:
                        batch += more_items
        except KVTransportError as exc:
            self._delivery_error = exc
            self._fail_link(exc)
        except Exception as exc:  # never let the signaller die silently
            self._delivery_error = TransferError(f"{self.ctx.backend} flush failed: {type(exc).__name__}: {exc}")
            self._fail_link(self._delivery_error)
        batch += extra
        if sent:
            with self._lock:
                self._pending -= len(batch)
                self._idle.notify_all()
        else:
            self._send(batch)

    def _read_loop(self) -> None:
        try:
            while True:
                kind, payload = self.conn.recv()
                if kind == FrameType.NACK:
                    seq, exc = wire.decode_nack(payload)
                    self.mark_failed(seq, exc)
                    self.ctx.count_failure()
                elif kind == FrameType.ABORT:
                    self._on_abort(*wire.decode_abort(payload))
                elif kind == FrameType.PONG:
                    pass
                elif kind == FrameType.REFUSE:  # the receiver's side of the link set-up failed after WELCOME
                    why = wire.error_from_wire(wire.parse_json_payload(payload, "REFUSE"))
                    raise PeerDisconnected(f"the receiver refused the link after the handshake: {type(why).__name__}: {why}")
                else:
                    raise ProtocolError(f"unexpected {kind.name} frame from receiver")
        except KVTransportError as exc:
            if not self._closed:
                self._fail_link(exc if isinstance(exc, PeerDisconnected) else PeerDisconnected(str(exc)))
        except Exception as exc:  # a backend error while fencing an abort
            if not self._closed:
                self._fail_link(TransferError(f"link to peer failed: {type(exc).__name__}: {exc}"))

    def _fail_link(self, exc: KVTransportError) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
            self._idle.notify_all()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            self._idle.notify_all()
            self._wake.notify_all()
        self.conn.close()
        try:
            self.link.close()  # first: it also ends a put blocked on the peer (which holds the put lock)
        except Exception as exc:
            log.warning("outbound link close failed: %s", exc)
        if self._bell is not None:
            with self._put_lock:  # a signal inside _ring finishes its store first; later ones see no bell
                bell, self._bell = self._bell, None
                if bell is not None:
                    bell.close()
                    try:
                        if self._door is not None:  # (it is: the bell was opened with it)
                            self._door.doorbell_unmap(self._bell_host)
                    except Exception as exc:
                        log.warning("doorbell unmap failed: %s", exc)
