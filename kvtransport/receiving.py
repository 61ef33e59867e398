"""The receiving side of the CommManager: the :class:`Receiver` (admission of a HELLO, the senders served,
their doorbells, a reconnecting sender's old link, departures), one :class:`Inbound` per connected sender, and
the admission's helpers (the CHALLENGE, the HELLO's length check, refusing a connection early).

The manager makes one ``Receiver`` and hands it a :class:`~kvtransport.sidecontext.SideContext` (settings, layout,
identity, the backend, the sequence table, the counters, the thread starter): the receiving side never sees the
manager. An ``Inbound`` is created by :meth:`Receiver.on_hello` (admission thread) and served on its own thread:
the handshake past the HELLO, then every control frame of that sender in order (and, for two-sided
backends, the data). Signals that arrived in one read are applied under one lock round.

Locks held here: ``Receiver.lock`` (the inbound links, doorbells, departed senders; taken after the handshake
semaphore ``Receiver.handshakes``), and the leaves ``Inbound._acks_lock`` (abort confirmations) and
``Inbound.bell_lock`` (the mapped doorbell). Their place in the whole order: :mod:`kvtransport.manager`.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

from . import wire
from .admission import PendingHello, RateLimitedLog
from .backend import InboundLink, PeerInfo
from .doorbell import BellReader
from .errors import (
    CommClosed,
    ForeignSequence,
    IncompatiblePeer,
    KVTransportError,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    SlotsExhausted,
    TransferError,
)
from .layout import KVLayout, pieces_crc32
from .semaphores import SeqId
from .sidechannel import FramedSocket
from .sidecontext import SideContext
from .wire import FrameType

log = logging.getLogger("kvtransport")
MAX_INBOUND = 4096
"""Connected senders at once; one more is refused."""
MAX_HANDSHAKES = 16
"""Handshakes past their HELLO (link set-up with the backend) at once; more wait in the admission queue."""
RECONNECT_PROBE_S = 2.0
"""How long a reconnecting sender's handshake waits for its old, probed link to end (see _old_link_gone)."""
MAX_PENDING_CHECKSUMS = 4096
"""Debug checksums one sender may have waiting for their signals; more drops its link (a bounded buffer)."""
MAX_PENDING_CHECKSUM_BYTES = 64 << 20
"""What those checksums may hold, in bytes (their runs, 24 bytes each as they came, plus
CHECKSUM_RECORD_OVERHEAD each); past it the sender's link drops. A 2k-token request with fully random block
ids has 128 runs a layer (3 KiB): the count binds first for such records. A 32k-token request of a 128-layer
model, fully random, waits with 6 MiB of runs: ten such requests put ahead of their signals fit."""
CHECKSUM_RECORD_OVERHEAD = 256
"""What one checksum record costs beyond its runs' bytes (its tuple, the runs' object and bytes header, the
CRC's int, its list and dict slots; ~200 bytes measured), so that records of no runs count too."""


def challenge() -> tuple[bytes, bytes]:
    """A fresh nonce and the CHALLENGE frame carrying it (sent to each connection on accept)."""
    nonce = secrets.token_bytes(16)
    return nonce, wire.frame(FrameType.CHALLENGE, wire.json_payload({"nonce": nonce.hex()}))


def hello_length(header: bytes) -> int:
    """The payload length of a connection's first frame, which must be a HELLO of at most
    ``wire.MAX_HELLO_BYTES`` (ProtocolError otherwise: the admission drops it before reading a byte more)."""
    kind, length = wire.parse_header(header)
    if kind != FrameType.HELLO:
        raise ProtocolError(f"expected HELLO, got {kind.name}")
    if length > wire.MAX_HELLO_BYTES:
        raise ProtocolError(f"a HELLO of {length} bytes announced; the limit is {wire.MAX_HELLO_BYTES}")
    return length


def _refuse_now(sock: socket.socket, exc: KVTransportError) -> None:
    """Best effort: tell a connection still in its handshake why it is refused (one small non-blocking
    write), then close it."""
    try:
        sock.setblocking(False)
        sock.send(wire.frame(FrameType.REFUSE, wire.json_payload({"error": type(exc).__name__, "message": str(exc)})))
    except OSError:
        pass
    finally:
        sock.close()


class Inbound:
    """One connected sender, served on its own thread; made by its :class:`Receiver`."""

    def __init__(self, rx: Receiver, conn: FramedSocket) -> None:
        self.rx = rx
        self.ctx = rx.ctx
        self.conn = conn
        self.link: InboundLink | None = None
        self.peer: str | None = None
        self.closed = False
        self._checksums: dict[SeqId, list[tuple[int, int, wire.PackedRuns]]] = {}
        """Debug checksums waiting for their signals: (layer, crc, runs as they came) per sequence."""
        self._pending_checksums = 0
        self._pending_checksum_bytes = 0
        """What they hold, as MAX_PENDING_CHECKSUM_BYTES counts it."""
        self._acks: dict[tuple[SeqId, int], threading.Event] = {}
        self._acks_lock = threading.Lock()
        self.bell: BellReader | None = None  # the sender's doorbell, when it offered one we could map
        self.bell_lock = threading.Lock()

    def expect_ack(self, seq: SeqId, token: int) -> threading.Event:
        ev = threading.Event()
        with self._acks_lock:
            self._acks[(seq, token)] = ev
            if self.closed:
                ev.set()
        return ev

    def forget_ack(self, seq: SeqId, token: int) -> None:
        with self._acks_lock:
            ev = self._acks.pop((seq, token), None)
        if ev is not None:
            ev.set()

    def serve(self, hello_body: bytes) -> None:
        """Handshake thread, then the connection's reader: ``hello_body`` is the HELLO's body, unparsed (its HMAC
        over our CHALLENGE's nonce was checked on admission when a secret is set)."""
        ctx, rx = self.ctx, self.rx
        try:
            try:
                self._handshake(hello_body)
            finally:
                rx.handshakes.release()
            assert self.link is not None and self.peer is not None
            two_sided = not ctx.capabilities.one_sided
            while True:
                marks: list[tuple[SeqId, int | None]] = []  # landed events of consecutive SIGNALs: applied at once
                try:
                    for kind, payload in self.conn.recv_many():
                        if kind == FrameType.SIGNAL:
                            seq, layer, ticket, puts, nbytes = wire.decode_signal_full(payload)
                            if layer is not None and layer >= ctx.layout.num_layers:
                                raise ProtocolError(f"SIGNAL for layer {layer} beyond our {ctx.layout.num_layers} layers")
                            if (puts or nbytes) and not two_sided:  # one-sided: what landed since the last one
                                with ctx.counters.lock:
                                    ctx.counters.stats.puts_received += puts
                                    ctx.counters.stats.bytes_received += nbytes
                            bell = self.bell
                            if ticket and bell is not None:
                                with self.bell_lock:
                                    if not bell.frame_applies(ticket):
                                        continue  # the doorbell applied it already
                            if self._checksums:
                                self._apply(marks)
                                if not self._verify(seq, layer):
                                    continue
                            marks.append((seq, layer))
                            continue
                        self._apply(marks)  # other frames see every earlier signal applied
                        self._on_frame(kind, payload, two_sided)
                finally:  # signals that arrived before a bad frame still count
                    self._apply(marks)
        except KVTransportError as exc:
            if not rx.closed:
                if self.peer is not None:
                    failed = ctx.table.fail_peer(self.peer, PeerDisconnected(f"peer {self.peer} lost: {exc}"))
                    if failed:
                        ctx.count_failure()
                        log.warning("peer %s lost with %d sequences in flight: %s", self.peer, len(failed), exc)
                else:
                    log.info("side-channel connection from %s refused: %s", self.conn.peer_label, exc)
        except Exception as exc:  # never let a receiver thread die silently
            log.exception("receiver thread for %s crashed", self.conn.peer_label)
            if self.peer is not None:
                ctx.table.fail_peer(self.peer, PeerDisconnected(f"receiver error: {exc}"))
        finally:
            self.close()
            rx.drop_inbound(self)

    def _apply(self, marks: list[tuple[SeqId, int | None]]) -> None:
        """Mark a run of signalled events landed (one table operation) and empty ``marks``; NACK the events
        refused for want of a slot."""
        if not marks:
            return
        ctx = self.ctx
        marks, pending = list(marks), marks
        pending.clear()
        refused = ctx.table.mark_many(marks, peer=self.peer)
        completed = sum(1 for _, layer in marks if layer is None) - sum(1 for _, layer, _ in refused if layer is None)
        if completed:
            with ctx.counters.lock:
                ctx.counters.stats.sequences_completed += completed
        for seq, _, exc in refused:
            self._refuse(seq, exc)

    def _refuse(self, seq: SeqId, exc: KVTransportError) -> None:
        """Tell the sender that its event for ``seq`` was refused (NACK); foreign ones are counted."""
        if isinstance(exc, ForeignSequence):
            with self.ctx.counters.lock:
                self.ctx.counters.stats.foreign_refused += 1
        self.conn.send(FrameType.NACK, wire.encode_error(seq, exc))

    def _on_frame(self, kind: FrameType, payload: bytes, two_sided: bool) -> None:
        """Every frame but SIGNAL, in order."""
        ctx = self.ctx
        if kind == FrameType.PUT and two_sided:
            self._on_put(payload)
        elif kind == FrameType.CHECKSUM:
            seq, ck_layer, crc, runs = wire.decode_checksum_packed(payload)
            if ck_layer >= ctx.layout.num_layers or runs.dst_end > ctx.layout.num_blocks:
                raise ProtocolError("CHECKSUM frame outside our layout")
            self._pending_checksums += 1
            if self._pending_checksums > MAX_PENDING_CHECKSUMS:
                raise ProtocolError(f"more than {MAX_PENDING_CHECKSUMS} checksums wait for their signals")
            if self._pending_checksum_bytes + _record_bytes(runs) > MAX_PENDING_CHECKSUM_BYTES:
                raise ProtocolError(f"checksums of more than {MAX_PENDING_CHECKSUM_BYTES} bytes would wait for their "
                                    "signals")
            self._pending_checksum_bytes += _record_bytes(runs)
            self._checksums.setdefault(seq, []).append((ck_layer, crc, runs))
        elif kind == FrameType.ABORT_ACK:
            seq, token = wire.decode_abort(payload)
            self.forget_ack(seq, token)
        elif kind == FrameType.CANCEL:
            seq = wire.decode_cancel(payload)
            try:  # record it even if nobody waits yet, so a later wait fails at once
                ctx.table.acquire(seq, peer=self.peer, remote=True)
            except SlotsExhausted:
                pass
            except ForeignSequence as exc:  # another sender's sequence: not ours to cancel
                self._refuse(seq, exc)
                return
            ctx.table.fail(seq, SequenceAborted(f"sequence {seq!r} was cancelled by the sender"))
        elif kind == FrameType.PING:
            self.conn.send(FrameType.PONG)
        elif kind == FrameType.DOORBELL:
            self._open_bell(wire.parse_json_payload(payload, "DOORBELL"))
        else:
            raise ProtocolError(f"unexpected {kind.name} frame from a connected peer")

    def _open_bell(self, offer: dict[str, Any]) -> None:
        """The sender offers a doorbell (kvtransport.doorbell); map it if we can, else signals come by frame."""
        path = offer.get("path")
        settings = self.ctx.settings
        if settings.checksum or not settings.doorbell or self.bell is not None or not isinstance(path, str):
            return  # checksums are verified when the SIGNAL frame arrives: keep that path only
        try:
            bell = BellReader(path)
        except (OSError, ProtocolError) as exc:  # another host, or no /dev/shm: the frames carry every signal
            log.info("doorbell of %s not mapped (%s); completions come by the side channel", self.peer, exc)
            return
        with self.bell_lock:
            self.bell = bell
        self.rx.add_bell(self)

    def poll_bell(self) -> int:
        """Apply the signals the doorbell shows landed: 2 if it applied any, 1 if a signal is announced
        and its copies still run, else 0 (see SequenceTable.poller). Non-blocking; any thread."""
        bell = self.bell
        if bell is None:
            return 0
        with self.bell_lock:
            if self.bell is None:
                return 0
            events = bell.landed()
            running = not events and bell.in_flight()
        n = self.ctx.layout.num_layers
        events = [(seq, layer) for seq, layer in events if layer is None or 0 <= layer < n]
        if not events:
            return 1 if running else 0
        with self.ctx.counters.lock:
            self.ctx.counters.stats.doorbell_signals += len(events)
        try:
            self._apply(events)
        except KVTransportError as exc:  # a NACK that could not be sent: the reader thread sees the link fail
            log.info("doorbell signals from %s: %s", self.peer, exc)
        return 2

    def _handshake(self, body: bytes) -> None:
        """The handshake past the (admitted, authenticated) HELLO: metadata, compatibility, the backend's link."""
        ctx, rx = self.ctx, self.rx
        deadline = time.monotonic() + ctx.settings.timeout
        answer = None
        try:
            hello = wire.parse_json_payload(body, "HELLO body")
            meta = hello.get("metadata")
            request = hello.get("request")
            if not isinstance(meta, dict) or not isinstance(request, dict):
                raise ProtocolError("HELLO body lacks metadata/request")
            meta = wire.decode_metadata(wire.encode_metadata(meta))  # same validation as connect()
            ctx.check_compatible(meta)
            if not rx.old_link_gone(meta["instance"]):  # one link per sender: no one takes over another's id
                raise IncompatiblePeer(f"a sender with instance id {meta['instance']} is already connected")
            info = PeerInfo(meta["instance"], meta["host"], KVLayout.from_wire(meta["layout"]), meta["transport"])
            answer = ctx.transport.answer(info, request)
            welcome: dict[str, Any] = {"reply": answer.reply, "instance": ctx.instance}
            if ctx.settings.secret is not None:  # we prove the secret too, over the sender's fresh nonce
                try:
                    their_nonce = bytes.fromhex(str(hello.get("nonce", "")))
                except ValueError:
                    raise ProtocolError("malformed HELLO: its nonce is not hex") from None
                if len(their_nonce) < 16:
                    raise ProtocolError("HELLO without a nonce of 16 bytes or more")
                welcome["auth"] = wire.auth_tag(ctx.settings.secret, their_nonce, b"welcome " + ctx.instance.encode())
            self.conn.send(FrameType.WELCOME, wire.json_payload(welcome))
            self.link = answer.complete(max(0.001, deadline - time.monotonic()))
            with rx.lock:
                if meta["instance"] in (ib.peer for ib in rx.inbound.values()):  # (one that raced us)
                    raise IncompatiblePeer(f"a sender with instance id {meta['instance']} is already connected")
                self.peer = meta["instance"]
                ctx.table.peers = max(1, sum(1 for ib in rx.inbound.values() if ib.peer is not None))
            self.peer_layout = info.layout
        except KVTransportError as exc:
            if answer is not None:
                answer.abort()
            try:
                self.conn.send(FrameType.REFUSE, wire.json_payload({"error": type(exc).__name__, "message": str(exc)}))
            except KVTransportError:
                pass
            raise

    def _verify(self, seq: SeqId, layer: int | None) -> bool:
        """Debug option ``checksum``: recompute the CRCs of what landed for ``seq`` (one layer, or all
        that are pending) before the signal counts. On a mismatch the sequence fails; returns False."""
        ctx = self.ctx
        pending = self._checksums.get(seq, [])
        due = [c for c in pending if layer is None or c[0] == layer]
        self._pending_checksums -= len(due)
        self._pending_checksum_bytes -= sum(_record_bytes(c[2]) for c in due)
        self._checksums[seq] = [c for c in pending if not (layer is None or c[0] == layer)]
        if not self._checksums[seq]:
            del self._checksums[seq]
        for lyr, crc, runs in due:
            if pieces_crc32(ctx.layout.layers[lyr], runs, source=False) != crc:
                try:
                    ctx.table.acquire(seq, peer=self.peer, remote=True)
                except ForeignSequence as exc:
                    self._refuse(seq, exc)
                    return False
                ctx.table.fail(seq, TransferError(
                    f"integrity check failed for sequence {seq!r} layer {lyr}: the bytes that landed differ "
                    "from what was sent (silent corruption on the path)"))
                ctx.count_failure()
                return False
        return True

    def _on_put(self, payload: bytes) -> None:
        ctx = self.ctx
        assert self.link is not None
        seq, layer, runs = wire.decode_put(payload)
        if layer >= ctx.layout.num_layers:
            raise ProtocolError(f"PUT for layer {layer} beyond our {ctx.layout.num_layers} layers")
        for r in runs:
            if r.dst + r.count > ctx.layout.num_blocks or r.src + r.count > self.peer_layout.num_blocks:
                raise ProtocolError(f"PUT run {r} is beyond the block range")
        try:
            st = ctx.table.acquire(seq, peer=self.peer, remote=True)
            dropped: KVTransportError | None = None
            if st is None:
                dropped = TransferError(f"sequence {seq!r} was released by the receiver; data discarded")
        except (SlotsExhausted, ForeignSequence) as exc:
            st, dropped = None, exc
        if st is None or st.finished:
            self.link.discard(layer, runs, ctx.settings.timeout)
            if dropped is not None:
                self._refuse(seq, dropped)
            return
        self.link.receive(layer, runs, ctx.settings.timeout)
        nblocks = sum(r.count for r in runs)
        with ctx.counters.lock:
            ctx.counters.stats.puts_received += 1
            ctx.counters.stats.bytes_received += nblocks * ctx.layout.layers[layer].block_bytes

    def close(self) -> None:
        with self._acks_lock:
            self.closed = True  # a sender that is gone cannot write: release everyone waiting for its ack
            acks, self._acks = list(self._acks.values()), {}
        for ev in acks:
            ev.set()
        if self.bell is not None:
            self.rx.drop_bell(self)
            with self.bell_lock:
                bell, self.bell = self.bell, None
            if bell is not None:
                bell.close()
        self.conn.close()
        link, self.link = self.link, None
        if link is not None:
            try:
                link.close()
            except Exception as exc:
                log.warning("inbound link close failed: %s", exc)


def _record_bytes(runs: wire.PackedRuns) -> int:
    """What one checksum record counts against MAX_PENDING_CHECKSUM_BYTES."""
    return len(runs.raw) + CHECKSUM_RECORD_OVERHEAD


class Receiver:
    """The receiving side of a manager: a HELLO taken from the admission queue (:meth:`on_hello`), the senders
    served (``inbound``), their doorbells, a reconnecting sender's old link, a sender's departure. Its state is
    under its own ``lock`` (lock order: :mod:`kvtransport.manager`). Made by the manager, with the context it
    shares with the sending side and the manager's rate-limited log."""

    def __init__(self, ctx: SideContext, logs: RateLimitedLog) -> None:
        self.ctx = ctx
        self.logs = logs
        self.lock = threading.Lock()
        self.closed = False
        self.inbound: dict[int, Inbound] = {}
        self.bells: list[Inbound] = []  # inbound links with a mapped doorbell (copy-on-write list)
        self.departed: OrderedDict[str, None] = OrderedDict()
        self.handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)

    def on_hello(self, hello: PendingHello) -> bool | None:
        """Admission thread: a connection sent a complete HELLO. Checks the secret first (a stranger never gets
        a thread), then hands the connection to a handshake thread of its own. Returns True when taken, False
        while every handshake slot is busy (the admission queue offers it again), None when refused."""
        ctx = self.ctx
        try:
            body = wire.hello_body(hello.raw, ctx.settings.secret, hello.nonce)  # the HMAC first, nothing parsed
            if body is None:
                ctx.counters.add("refused_peers")
                raise ProtocolError("handshake authentication failed: the peer does not know KV_TRANSPORT_SECRET "
                                    "(set the same secret on both sides)")
            with self.lock:
                if self.closed:
                    raise CommClosed("CommManager closed")
                if len(self.inbound) >= MAX_INBOUND:
                    raise ProtocolError(f"this receiver already serves {MAX_INBOUND} senders; try another")
        except KVTransportError as exc:
            self.logs.log(logging.INFO, "refused", "side-channel connection from %s refused: %s", hello.label, exc)
            _refuse_now(hello.sock, exc)
            return None
        if not self.handshakes.acquire(blocking=False):
            return False
        hello.sock.setblocking(True)
        conn = FramedSocket(hello.sock, hello.label, ctx.settings.timeout)
        conn.preload(hello.leftover)
        inbound = Inbound(self, conn)
        with self.lock:
            self.inbound[id(inbound)] = inbound
        try:
            ctx.spawn(inbound.serve, f"kvt-in-{hello.label.rsplit(':', 1)[-1]}", body)
        except RuntimeError as exc:  # no thread could be started (a transient shortage): refuse, keep serving
            self.handshakes.release()
            with self.lock:
                self.inbound.pop(id(inbound), None)
            self.logs.log(logging.WARNING, "spawn", "kvtransport: cannot start a thread for %s (%s); refused",
                          hello.label, exc)
            inbound.close()
            return None
        return True

    def peers(self) -> list[Inbound]:
        """The inbound links past their handshake (a sender's instance id in ``peer``)."""
        with self.lock:
            return [ib for ib in self.inbound.values() if ib.peer is not None]

    def departed_already(self, instance: str) -> bool:
        """Whether sender ``instance`` was connected and is gone (the last 1,024 remembered)."""
        with self.lock:
            return instance in self.departed

    def add_bell(self, inbound: Inbound) -> None:
        with self.lock:
            self.bells = [*self.bells, inbound]
            self.ctx.table.poller = self.poll_bells

    def drop_bell(self, inbound: Inbound) -> None:
        with self.lock:
            self.bells = [ib for ib in self.bells if ib is not inbound]
            if not self.bells:
                self.ctx.table.poller = None

    def poll_bells(self) -> int:
        """Apply what the doorbells of every inbound link show landed: 2 if anything was, 1 if a signal's
        copies are still running, else 0. Any thread."""
        state = 0
        for inbound in self.bells:
            state = max(state, inbound.poll_bell())
        return state

    def old_link_gone(self, instance: str) -> bool:
        """Whether no live link of sender ``instance`` remains. A sender that reconnects after a partition
        may find its old link still here (its close never arrived): the old connection is probed (a PONG,
        which a live sender ignores; a sender that closed it answers with a reset) and given
        RECONNECT_PROBE_S to go. Handshake thread; bounded."""
        with self.lock:
            old = [ib for ib in self.inbound.values() if ib.peer == instance]
        if not old:
            return True
        for ib in old:
            try:
                ib.conn.send(FrameType.PONG)
            except KVTransportError:
                ib.conn.close()  # already broken: its reader ends now
        deadline = time.monotonic() + min(RECONNECT_PROBE_S, self.ctx.settings.timeout)
        while time.monotonic() < deadline:
            with self.lock:
                if not any(ib.peer == instance for ib in self.inbound.values()):
                    return True
            time.sleep(0.02)
        return False

    def drop_inbound(self, inbound: Inbound) -> None:
        table = self.ctx.table
        with self.lock:
            self.inbound.pop(id(inbound), None)
            table.peers = max(1, sum(1 for ib in self.inbound.values() if ib.peer is not None))
            if inbound.peer is not None:
                self.departed[inbound.peer] = None
                while len(self.departed) > 1024:
                    self.departed.popitem(last=False)
        if inbound.peer is not None:  # sequences expected from it (and not landed) fail now
            table.fail_peer(inbound.peer, PeerDisconnected(f"sender {inbound.peer} disconnected"))

    def close(self) -> list[Inbound]:
        """Refuse every later HELLO; returns the links to close (the manager closes them after its own)."""
        with self.lock:
            self.closed = True
            return list(self.inbound.values())
