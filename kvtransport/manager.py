"""The CommManager: layer puts, per-sequence semaphores and block coalescing over any backend.

Roles: the *sender* (e.g. a prefill worker) calls ``connect(peer_metadata)`` and then ``put_layer`` /
``signal_layer`` / ``signal`` towards that peer; the *receiver* (e.g. a decode worker) hands out
``metadata()`` and calls ``wait`` / ``wait_layer`` / ``poll`` / ``release``. One manager can play both roles
with many peers. Control messages travel over a TCP side channel bound to NET_IFNAME's address (loopback
by default), in order; bytes travel over the backend.

This module is the API (:class:`CommManager`, :class:`Peer`, :class:`Stats`) and composes the two sides: the
sending side of a link is :mod:`kvtransport.sending` (``Outbound``), the receiving side
:mod:`kvtransport.receiving` (the ``Receiver``: admission, the senders served, doorbells, departures; an
``Inbound`` per sender), the GIL hand-off of a signaller :mod:`kvtransport.parking`. Both sides get what they use
in a :class:`~kvtransport.sidecontext.SideContext` (settings, layout, identity, backend, sequence table,
counters, thread starter) and never see the manager.

Threads: one accept thread, one thread per inbound peer (receives control frames and, for two-sided
backends, the data), one reader thread per outbound peer (error reports from the receiver) and, for
one-sided backends, one signaller thread per outbound peer (flush, then signal, off the caller's path).
A one-sided signal whose puts have already landed skips that hand-off: the caller's thread sends it (see
``Outbound``). The receiving thread applies every signal that arrived in one read under one lock round.

Lock order. A thread holding one of these takes only locks further down the list:

1. ``Receiver.handshakes`` (receiving.py; a semaphore: taken at admission, held through one handshake)
2. ``Receiver.lock`` (receiving.py: inbound links, doorbells, departed senders) and ``CommManager._lock``
   (outbound links, threads, the runs cache, closed); the two never nest
3. ``Outbound._put_lock`` (sending.py: puts in issue order, abort fences, the doorbell's stores)
4. ``Outbound._send_order`` (held by whoever takes queued frames and sends them; never nests with 3)
5. the side channel's send lock (``FramedSocket``; held through a backend's ``flush_and_send``)
6. ``Outbound._lock`` with its conditions ``_idle`` and ``_wake`` (the frame queue, failure records)
7. ``Parking._lock``

Leaves (nothing is taken while one is held): ``Counters.lock`` (sidecontext.py; ``CommManager._stats_lock`` is
it), the sequence table's condition (released while its poller reads the doorbells), ``Inbound._acks_lock``,
``Inbound.bell_lock``, the rate-limited log's lock. Backend calls: the blocking ones (``put``, ``flush``, ``flush_and_send``,
``close``, the doorbell's stores; a handshake's ``answer``/``complete`` under 1) are made under 3, 4 or 5
or with no lock, never under 6; under 6 only the non-blocking ``landed`` and ``Mailbox.append``; under 2
only ``describe`` (``stats()``) and the close of a link whose ``connect`` raced ``close()``. A backend
holds none of its own locks when it calls back (``on_wait``, ``Parking.park``).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import checks, wire
from .admission import Admission, RateLimitedLog
from .backend import PeerInfo, Transport
from .coalesce import BlockRun, coalesce, single_runs
from .config import Settings
from .errors import (
    CommClosed,
    ConfigurationError,
    InvalidArgument,
    InvalidBlockIds,
    KVTransportError,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    TransferTimeout,
    map_errors,
)
from .layout import KVLayout, pieces_crc32
from .receiving import Receiver, challenge, hello_length
from .semaphores import SeqId, SequenceTable
from .sending import Outbound, checked_runs, complete_watching_refusal
from .sidechannel import FramedSocket
from .sidecontext import Counters, SideContext
from .sidecontext import Stats as Stats  # (its home before the split: kvtransport.manager.Stats)
from .wire import FrameType

log = logging.getLogger("kvtransport")
RUNS_CACHE = 64
"""How many distinct block-id lists keep their coalesced runs (a request's layers share one)."""
PREAUTH_TIMEOUT_S = 10.0
"""A side-channel connection must complete its HELLO this soon (or within the manager's timeout if shorter)."""


class _IdsKey:
    """A request's block ids as a cache key whose hash is computed once (a tuple re-hashes its 2 x N ints
    at every dict operation: several µs a ``put_layer`` for a 2k-token request)."""

    __slots__ = ("hash", "ids")

    def __init__(self, ids: tuple[Any, ...]) -> None:
        self.ids = ids
        self.hash = hash(ids)  # TypeError for unhashable ids

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _IdsKey) and self.hash == other.hash and self.ids == other.ids


def _as_lists(key: _IdsKey) -> tuple[list[Any], list[Any], int]:
    """(source ids, destination ids, destination block count) of a runs-cache key, the ids as lists."""
    src, dst, n = key.ids
    return list(src), list(dst), n


@dataclass(eq=False)
class Peer:
    """A link to one receiving peer, returned by :meth:`CommManager.connect`.

    ``put_layer``, ``signal*``, ``cancel`` and ``flush`` on one peer may be called from several threads;
    puts are issued in the order the calls take the link's lock."""

    instance: str
    host: str
    port: int
    backend: str
    path: str
    """The data path in use, in words (what a user needs to know: e.g. NVLink vs TCP)."""
    layout: KVLayout = field(repr=False)
    _state: Outbound = field(repr=False)


class CommManager:
    """See the module docstring. Create with :func:`kvtransport.open`; use as a context manager."""

    def __init__(self, layout: KVLayout, settings: Settings, transport: Transport) -> None:
        self.layout = layout
        self.settings = settings
        self.transport = transport
        self.backend = transport.name
        self.capabilities = transport.capabilities
        self.instance = secrets.token_hex(8)
        self._table = SequenceTable(settings.capacity, layout.num_layers)
        self._counters = Counters()
        self._stats, self._stats_lock = self._counters.stats, self._counters.lock
        self._closed = False
        self._lock = threading.Lock()
        self._outbound: list[Outbound] = []
        self._threads: list[threading.Thread] = []
        self._abort_token = 0
        self._runs_cache: OrderedDict[_IdsKey, tuple[BlockRun, ...]] = OrderedDict()
        # the latest entry used: key, runs, and the ids as lists (for the fast path of _runs)
        self._last_runs: tuple[_IdsKey, tuple[BlockRun, ...], tuple[list[Any], list[Any], int]] | None = None
        self._layer_planes = [len(layer.planes) for layer in layout.layers]  # for the stats of a put
        self._layer_block_bytes = [layer.block_bytes for layer in layout.layers]
        try:
            self._server = socket.create_server((settings.address, settings.port), reuse_port=False, backlog=1024)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot listen on {settings.address}:{settings.port} for the side channel ({exc.strerror or exc}); "
                "pick another port (KV_TRANSPORT_PORT, 0 = any free one) or check NET_IFNAME's address"
            ) from None
        self.host, self.port = self._server.getsockname()[:2]
        self._logs = RateLimitedLog(log)
        self._ctx = SideContext(settings=settings, layout=layout, instance=self.instance, transport=transport,
                                backend=self.backend, capabilities=self.capabilities, table=self._table,
                                counters=self._counters, spawn=self._spawn)
        self._receiver = Receiver(self._ctx, self._logs)
        self._admission = Admission(self._server, greet=challenge, header_size=wire.FRAME_HEADER.size,
                                    message_length=hello_length, on_hello=self._receiver.on_hello,
                                    preauth_timeout=min(settings.timeout, PREAUTH_TIMEOUT_S))
        self._admission.start()
        log.info("kvtransport %s ready: backend=%s side channel %s:%d", self.instance, self.backend, self.host, self.port)

    # ================================================================ public API
    def metadata(self) -> bytes:
        """What a peer needs to ``connect`` to us (versioned bytes, no pickle; sealed with the secret when one is
        set). Non-blocking."""
        return wire.encode_metadata(self._metadata_fields(), self.settings.secret)

    def _metadata_fields(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "backend": self.backend,
            "host": self.host,
            "port": self.port,
            "pid": os.getpid(),
            "capacity": self.settings.capacity,
            "layout_hash": self.layout.compat_hash(),
            "layout_signature": self.layout.signature(),
            "layout": self.layout.to_wire(),
            "transport": self.transport.describe(),
            "auth_required": self.settings.secret is not None,
        }

    def connect(self, peer_metadata: bytes, *, timeout: float | None = None) -> Peer:
        """Open a link for putting into the peer. Blocking, bounded by ``timeout`` (default: settings).

        Raises ProtocolError/VersionMismatch for bad metadata, IncompatiblePeer when layouts or backends
        differ (before any byte moves), PeerDisconnected/TransferTimeout when the peer cannot be reached.
        """
        self._check_open()
        timeout = self.settings.timeout if timeout is None else checks.timeout_seconds(timeout, "connect timeout")
        deadline = time.monotonic() + timeout
        if not isinstance(peer_metadata, bytes | bytearray | memoryview):
            raise InvalidArgument(f"peer metadata must be the bytes of cm.metadata(), got {type(peer_metadata).__name__}")
        meta = wire.decode_metadata(bytes(peer_metadata), self.settings.secret)  # sealed, when we have a secret
        self._ctx.check_compatible(meta)
        peer_layout = KVLayout.from_wire(meta["layout"])
        info = PeerInfo(meta["instance"], meta["host"], peer_layout, meta["transport"])
        label = f"{meta['host']}:{meta['port']}"
        try:
            raw = socket.create_connection((meta["host"], meta["port"]), timeout=max(0.001, deadline - time.monotonic()))
        except OSError as exc:
            raise PeerDisconnected(f"cannot reach peer side channel {label}: {exc}") from None
        conn = FramedSocket(raw, label, self.settings.timeout)
        dialer = None
        try:
            # a backend that leaks its library's error (bad peer address, refused rendezvous): still typed
            with map_errors(PeerDisconnected, f"{self.backend} could not link to {label}", peer=label):
                kind, payload = conn.recv(deadline)
                if kind != FrameType.CHALLENGE:
                    raise ProtocolError(f"expected CHALLENGE from {label}, got {kind.name}")
                try:
                    nonce = bytes.fromhex(str(wire.parse_json_payload(payload, "CHALLENGE").get("nonce", "")))
                except ValueError:
                    raise ProtocolError(f"malformed CHALLENGE from {label}: the nonce is not hex") from None
                dialer = self.transport.dial(info)
                our_nonce = secrets.token_bytes(16)  # the receiver proves the secret over it in its WELCOME
                body = wire.json_payload({"metadata": self._metadata_fields(), "request": dialer.request,
                                          "nonce": our_nonce.hex()})
                auth = wire.auth_tag(self.settings.secret, nonce, body) if self.settings.secret else None
                conn.send(FrameType.HELLO, wire.json_payload({"body": body.decode(), "auth": auth}))
                kind, payload = conn.recv(deadline)
                reply = wire.parse_json_payload(payload, kind.name)
                if kind == FrameType.REFUSE:
                    raise wire.error_from_wire(reply)
                if kind != FrameType.WELCOME or not isinstance(reply.get("reply"), dict):
                    raise ProtocolError(f"expected WELCOME from {label}, got {kind.name}")
                if self.settings.secret is not None and not wire.auth_ok(
                        self.settings.secret, our_nonce, b"welcome " + str(reply.get("instance")).encode(), reply.get("auth")):
                    raise ProtocolError(f"the receiver at {label} did not prove KV_TRANSPORT_SECRET in its WELCOME: "
                                        "set the same secret on both sides")
                link = complete_watching_refusal(conn, dialer, reply["reply"], deadline, label)
        except BaseException:
            if dialer is not None:
                dialer.abort()
            conn.close()
            raise
        state = Outbound(self._ctx, conn, link, info)
        state.open_doorbell()
        peer = Peer(meta["instance"], meta["host"], meta["port"], self.backend, link.describe(), peer_layout, state)
        with self._lock:
            if self._closed:
                state.close()
                raise CommClosed("CommManager closed during connect")
            self._outbound.append(state)
        log.info("kvtransport %s -> %s connected via %s", self.instance, label, peer.path or self.backend)
        return peer

    def put_layer(
        self,
        peer: Peer,
        seq_id: SeqId,
        layer: int,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """Start copying blocks of ``layer`` into the peer's blocks. Asynchronous; coalesces internally.

        Validation happens first (InvalidBlockIds, nothing moved). Raises the error the receiver reported
        for this sequence (e.g. SlotsExhausted, SequenceAborted), PeerDisconnected, CommClosed.
        """
        st = self._outbound_state(peer)
        layer = checks.layer_index(layer, self.layout.num_layers)
        wire.check_seq_id(seq_id)
        runs = self._runs(src_block_ids, dst_block_ids, peer.layout.num_blocks)
        if not runs:
            return
        st.put(seq_id, (layer,), runs)
        self._after_put(st, seq_id, (layer,), runs, len(src_block_ids))

    def put_layers(
        self,
        peer: Peer,
        seq_id: SeqId,
        layers: Sequence[int] | None,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """:meth:`put_layer` for each of ``layers`` (every layer when None) with the same block ids, in one
        call: for sending a whole request at once. Backends that can move many layers in one operation
        (one device kernel for CUDA IPC) do so; the others issue layer by layer. Asynchronous; same errors
        as :meth:`put_layer` (validation first, nothing moved on InvalidBlockIds)."""
        st = self._outbound_state(peer)
        chosen = checks.layer_list(layers, self.layout.num_layers)
        wire.check_seq_id(seq_id)
        runs = self._runs(src_block_ids, dst_block_ids, peer.layout.num_blocks)
        if not runs or not chosen:
            return
        st.put(seq_id, chosen, runs)
        self._after_put(st, seq_id, chosen, runs, len(src_block_ids))

    def put_runs(
        self,
        peer: Peer,
        seq_id: SeqId,
        layers: Sequence[int] | None,
        runs: Sequence[BlockRun | tuple[int, int, int]],
    ) -> None:
        """:meth:`put_layers` with the runs given instead of block id pairs: ``(src, dst, count)`` copies blocks
        ``src..src+count-1`` into the peer's ``dst..dst+count-1``. For callers that computed their runs
        themselves (:mod:`kvtransport.reshard`: units of unlike peers). Validated first (InvalidBlockIds,
        nothing moved): counts >= 1, every block inside both layouts, no destination block written twice.
        Asynchronous; same errors as :meth:`put_layer`."""
        st = self._outbound_state(peer)
        chosen = checks.layer_list(layers, self.layout.num_layers)
        wire.check_seq_id(seq_id)
        checked = checked_runs(runs, self.layout.num_blocks, peer.layout.num_blocks)
        if not checked or not chosen:
            return
        st.put(seq_id, chosen, checked)
        self._after_put(st, seq_id, chosen, checked, sum(r.count for r in checked))

    def _after_put(self, st: Outbound, seq_id: SeqId, layers: tuple[int, ...], runs: tuple[BlockRun, ...],
                   nblocks: int) -> None:
        """Checksums (debug) and counters of an issued put of ``layers``."""
        if self.settings.checksum:  # debug: the receiver recomputes it when the layer's signal arrives
            for layer in layers:
                crc = pieces_crc32(self.layout.layers[layer], runs, source=True)
                st.control(FrameType.CHECKSUM, wire.encode_checksum(seq_id, layer, crc, runs))
        stats = self._stats
        with self._stats_lock:
            stats.puts += len(layers)
            stats.runs += len(runs) * len(layers)
            for layer in layers:
                stats.pieces += nblocks * self._layer_planes[layer]
                stats.bytes_sent += nblocks * self._layer_block_bytes[layer]

    def _runs(self, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], dst_blocks: int) -> tuple[BlockRun, ...]:
        """Validated, coalesced runs; the same ids (every layer of a request) give the same tuple object,
        computed once, so backends can cache what they derive from it by identity."""
        last = self._last_runs  # the layers of one request come one after another: no lock, no LRU update
        if (last is not None and type(src_block_ids) is list and type(dst_block_ids) is list
                and last[2] == (src_block_ids, dst_block_ids, dst_blocks)):
            return last[1]  # same ids as the last call, compared as lists (C speed; no tuple, no hash)
        src_ids = checks.block_id_list(src_block_ids, "source block ids")
        dst_ids = checks.block_id_list(dst_block_ids, "destination block ids")
        try:
            key = _IdsKey((src_ids, dst_ids, dst_blocks))
        except TypeError:
            raise InvalidBlockIds("block ids must be sequences of integers") from None
        if last is not None and last[0] == key:
            return last[1]
        with self._lock:
            runs = self._runs_cache.get(key)
            if runs is not None:
                self._runs_cache.move_to_end(key)
                self._last_runs = (key, runs, _as_lists(key))
                return runs
        limits = {"src_num_blocks": self.layout.num_blocks, "dst_num_blocks": dst_blocks}
        make = coalesce if self.settings.coalesce else single_runs
        runs = tuple(make(src_ids, dst_ids, **limits))
        with self._lock:
            self._runs_cache[key] = runs
            while len(self._runs_cache) > RUNS_CACHE:
                self._runs_cache.popitem(last=False)
            self._last_runs = (key, runs, _as_lists(key))
        return runs

    def signal_layer(self, peer: Peer, seq_id: SeqId, layer: int) -> None:
        """After this, the peer's ``wait_layer(seq_id, layer)`` returns once every earlier put landed.

        Non-blocking (one-sided backends flush on a background thread)."""
        st = self._outbound_state(peer)
        layer = checks.layer_index(layer, self.layout.num_layers)
        wire.check_seq_id(seq_id)
        st.signal(seq_id, layer)
        with self._stats_lock:
            self._stats.signals += 1

    def signal(self, peer: Peer, seq_id: SeqId) -> None:
        """After this, the peer's ``wait(seq_id)`` returns once every earlier put of it landed. Non-blocking."""
        st = self._outbound_state(peer)
        wire.check_seq_id(seq_id)
        st.signal(seq_id, None)
        with self._stats_lock:
            self._stats.signals += 1

    def flush(self, peer: Peer, *, timeout: float | None = None) -> None:
        """Block until every earlier put and signal towards ``peer`` has been delivered.

        Raises TransferTimeout, PeerDisconnected, or the first error a signal hit."""
        st = self._outbound_state(peer)
        st.flush(self.settings.timeout if timeout is None else checks.timeout_seconds(timeout, "flush timeout"))

    def expect(self, seq_id: SeqId, *, sender: str | bytes) -> None:
        """Receiver side: declare which sender will fill ``seq_id`` (its instance id or its metadata).

        If that sender disconnects — or already has — the sequence fails at once with PeerDisconnected
        instead of running out the waiter's timeout. Takes a slot (SlotsExhausted when full). Non-blocking.
        """
        wire.check_seq_id(seq_id)
        if isinstance(sender, str):
            instance = sender
        elif isinstance(sender, bytes | bytearray | memoryview):
            instance = wire.decode_metadata(bytes(sender), self.settings.secret)["instance"]
        else:
            raise InvalidArgument(f"sender must be an instance id (str) or metadata (bytes), got {type(sender).__name__}")
        st = self._table.acquire(seq_id, peer=instance)
        if st is not None and st.peer == instance:
            if self._receiver.departed_already(instance):
                self._table.fail(seq_id, PeerDisconnected(f"sender {instance} disconnected before {seq_id!r} landed"))

    def inbound_peers(self) -> list[str]:
        """Instance ids of the senders connected to us now."""
        return [str(ib.peer) for ib in self._receiver.peers()]

    def wait(self, seq_id: SeqId, *, timeout: float) -> None:
        """Block until the sequence's signal arrived and all its puts landed (receiver side).

        Raises TransferTimeout, PeerDisconnected, SequenceAborted, SlotsExhausted, CommClosed; InvalidArgument
        (or InvalidSequenceId) for a bad argument."""
        wire.check_seq_id(seq_id)
        self._table.wait(seq_id, checks.timeout_seconds(timeout, "wait timeout"))

    def wait_layer(self, seq_id: SeqId, layer: int, *, timeout: float) -> None:
        """Block until ``layer`` of the sequence landed (a layer signal or the whole-sequence signal).

        Same errors as :meth:`wait`; InvalidBlockIds for a layer that is not an int in range."""
        layer = checks.layer_index(layer, self.layout.num_layers)
        wire.check_seq_id(seq_id)
        self._table.wait_layer(seq_id, layer, checks.timeout_seconds(timeout, "wait timeout"))

    def poll(self) -> list[SeqId]:
        """Sequences that finished (landed or failed) since the last poll; ``wait(s, timeout=0)`` tells which."""
        self._check_open()
        if self._receiver.bells:
            self._receiver.poll_bells()
        return self._table.poll()

    def release(self, seq_id: SeqId) -> None:
        """Forget a sequence on this side: frees its slot (receiver) and its error record (sender).

        Late data for it from a two-sided peer is discarded; waiters get SequenceAborted."""
        wire.check_seq_id(seq_id)
        self._table.release(seq_id)
        with self._lock:
            outs = list(self._outbound)
        for st in outs:
            st.forget(seq_id)

    def abort(self, seq_id: SeqId, *, timeout: float) -> None:
        """Receiver side: cancel a sequence so that its blocks can be reused safely (a fence).

        Every connected sender is told to stop writing ``seq_id``; each stops accepting puts for it,
        waits until its earlier puts have landed, and confirms. When this returns, no byte of ``seq_id``
        can land any more, and its slot is free. Blocking up to ``timeout``; raises TransferTimeout if a
        live sender did not confirm (then the blocks must not be reused yet). Senders that went away
        cannot write and are not waited for. Waiters of the sequence get SequenceAborted.
        """
        self._check_open()
        wire.check_seq_id(seq_id)
        timeout = checks.timeout_seconds(timeout, "abort timeout")
        self._table.fail(seq_id, SequenceAborted(f"sequence {seq_id!r} was aborted by the receiver"))
        inbound = self._receiver.peers()
        with self._lock:
            self._abort_token += 1
            token = self._abort_token
        waits = []
        for ib in inbound:
            ack = ib.expect_ack(seq_id, token)
            try:
                ib.conn.send(FrameType.ABORT, wire.encode_abort(seq_id, token))
                waits.append((ib, ack))
            except KVTransportError:
                ib.forget_ack(seq_id, token)  # the sender is gone: it cannot write any more
        deadline = time.monotonic() + timeout
        for ib, ack in waits:
            if not ack.wait(max(0.0, deadline - time.monotonic())) and not ib.closed:
                raise TransferTimeout(
                    f"sender {ib.peer} did not confirm the abort of {seq_id!r} within {timeout:.3g}s; "
                    "do not reuse its blocks yet", seq_id=seq_id, peer=str(ib.peer)
                )
        self._table.release(seq_id)
        with self._stats_lock:
            self._stats.aborted += 1

    def cancel(self, peer: Peer, seq_id: SeqId) -> None:
        """Sender side: give a sequence up. Further puts/signals for it raise SequenceAborted; once the
        puts already issued have landed, the receiver is told, and its waits fail with SequenceAborted
        (so it may reuse the blocks at once). Non-blocking."""
        st = self._outbound_state(peer)
        wire.check_seq_id(seq_id)
        st.cancel(seq_id)

    def disconnect(self, peer: Peer) -> None:
        """Close the link to ``peer`` (idempotent)."""
        if not isinstance(peer, Peer):
            raise InvalidArgument(f"expected a Peer from cm.connect(), got {type(peer).__name__}")
        with self._lock:
            if peer._state in self._outbound:
                self._outbound.remove(peer._state)
        peer._state.close()

    def stats(self) -> dict[str, Any]:
        """Counters, backend, paths in use and slot usage (for metrics)."""
        out: dict[str, Any] = self._counters.snapshot()
        with self._lock:
            out["paths"] = sorted({st.link.describe() for st in self._outbound})
            out["outbound_peers"] = len(self._outbound)
        with self._receiver.lock:
            out["inbound_peers"] = len(self._receiver.inbound)
        out.update(backend=self.backend, slots_in_use=self._table.in_use, capacity=self._table.capacity)
        out["transport"] = self.transport.stats()
        return out

    def close(self) -> None:
        """Stop everything; waiters get CommClosed. Always returns promptly; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outs = list(self._outbound)
            self._outbound.clear()
        ins = self._receiver.close()
        self._table.close(CommClosed("CommManager closed"))
        self._admission.close()
        try:
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._server.close()
        for st in outs:
            st.close()
        for ib in ins:
            ib.close()
        deadline = time.monotonic() + 5.0
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))
        try:
            self.transport.close()
        except Exception as exc:  # close must always return
            log.warning("backend %s close failed: %s", self.backend, exc)

    def __enter__(self) -> CommManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================ internals
    def _check_open(self) -> None:
        if self._closed:
            raise CommClosed("CommManager is closed")

    def _outbound_state(self, peer: Peer) -> Outbound:
        self._check_open()
        if not isinstance(peer, Peer):
            raise InvalidArgument(f"expected a Peer from cm.connect(), got {type(peer).__name__}")
        return peer._state

    def _spawn(self, fn: Any, name: str, *args: Any) -> threading.Thread:
        """Start a daemon thread (joined at close). Raises RuntimeError when no thread can be started."""
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        with self._lock:  # listed before it runs (a thread that serves at once is never missing from the list);
            # finished threads are forgotten, so the list does not grow with every connection
            self._threads = [x for x in self._threads if x.ident is None or x.is_alive()]
            self._threads.append(t)
        try:
            t.start()
        except RuntimeError:
            with self._lock:
                self._threads = [x for x in self._threads if x is not t]
            raise
        return t
