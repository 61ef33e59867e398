"""The CommManager: layer puts, per-sequence semaphores and block coalescing over any backend.

Roles: the *sender* (e.g. a prefill worker) calls ``connect(peer_metadata)`` and then ``put_layer`` /
``signal_layer`` / ``signal`` towards that peer; the *receiver* (e.g. a decode worker) hands out
``metadata()`` and calls ``wait`` / ``wait_layer`` / ``poll`` / ``release``. One manager can play both roles
with many peers. Control messages travel over a TCP side channel bound to NET_IFNAME's address (loopback
by default), in order; bytes travel over the backend.

Threads: one accept thread, one thread per inbound peer (receives control frames and, for two-sided
backends, the data), one reader thread per outbound peer (error reports from the receiver) and, for
one-sided backends, one signaller thread per outbound peer (flush, then signal, off the caller's path).
A one-sided signal whose puts have already landed skips that hand-off: the caller's thread sends it (see
``_Outbound``). The receiving thread applies every signal that arrived in one read under one lock round.
"""

from __future__ import annotations

import ctypes
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

from . import checks, doorbell, wire
from .admission import Admission, PendingHello, RateLimitedLog
from .backend import InboundLink, OutboundLink, PeerInfo, Transport
from .coalesce import BlockRun, coalesce, single_runs
from .config import Settings
from .doorbell import BellReader, BellWriter
from .errors import (
    CommClosed,
    ConfigurationError,
    ForeignSequence,
    IncompatiblePeer,
    InvalidArgument,
    InvalidBlockIds,
    KVTransportError,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    SlotsExhausted,
    TransferError,
    TransferTimeout,
)
from .layout import KVLayout, pieces_crc32
from .semaphores import SeqId, SequenceTable
from .sidechannel import FramedSocket
from .wire import FrameType

log = logging.getLogger("kvtransport")
RUNS_CACHE = 64
"""How many distinct block-id lists keep their coalesced runs (a request's layers share one)."""
YIELD_S = 0.002
"""Longest a sender API call lets a signaller thread that needs the interpreter run first (see _Parking)."""
STARVED_NS = 200_000
"""A signaller kept from the interpreter this long by a busy caller thread gets it at the next API call."""
BUSY_GAP_NS = 200_000
"""A caller that spent this long outside the sender API since its last call is taken to be busy in Python."""
PREAUTH_TIMEOUT_S = 10.0
"""A side-channel connection must complete its HELLO this soon (or within the manager's timeout if shorter)."""
MAX_HANDSHAKES = 16
"""Handshakes past their HELLO (link set-up with the backend) at once; more wait in the admission queue."""
MAX_INBOUND = 4096
"""Connected senders at once; one more is refused."""
RECONNECT_PROBE_S = 2.0
"""How long a reconnecting sender's handshake waits for its old, probed link to end (see _old_link_gone)."""
MAX_FAILED_RECORDS = 65536
"""Failed sequences a sender remembers per link (until release()); the oldest go first past it."""
MAX_PENDING_CHECKSUMS = 4096
"""Debug checksums one sender may have waiting for their signals; more drops its link (a bounded buffer)."""


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
    _state: _Outbound = field(repr=False)


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
        self._stats = Stats()
        self._stats_lock = threading.Lock()
        self._closed = False
        self._lock = threading.Lock()
        self._outbound: list[_Outbound] = []
        self._inbound: dict[int, _Inbound] = {}
        self._bells: list[_Inbound] = []  # inbound links with a mapped doorbell (copy-on-write list)
        self._threads: list[threading.Thread] = []
        self._abort_token = 0
        self._departed: OrderedDict[str, None] = OrderedDict()
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
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._logs = RateLimitedLog(log)
        self._admission = Admission(self._server, greet=_challenge, header_size=wire.FRAME_HEADER.size,
                                    message_length=_hello_length, on_hello=self._on_hello,
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
        self._check_compatible(meta)
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
            link = _complete_watching_refusal(conn, dialer, reply["reply"], deadline, label)
        except BaseException as exc:
            if dialer is not None:
                dialer.abort()
            conn.close()
            if isinstance(exc, KVTransportError) or not isinstance(exc, Exception):
                raise
            # a backend that leaked its library's error (bad peer address, refused rendezvous): still typed
            raise PeerDisconnected(f"{self.backend} could not link to {label}: {type(exc).__name__}: {exc}") from exc
        state = _Outbound(self, conn, link, info)
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
        checked = self._checked_runs(runs, peer.layout.num_blocks)
        if not checked or not chosen:
            return
        st.put(seq_id, chosen, checked)
        self._after_put(st, seq_id, chosen, checked, sum(r.count for r in checked))

    def _checked_runs(self, runs: Any, dst_blocks: int) -> tuple[BlockRun, ...]:
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
            if s + c > self.layout.num_blocks:
                raise InvalidBlockIds(f"run {r!r} reads beyond the sender's {self.layout.num_blocks} blocks")
            if d + c > dst_blocks:
                raise InvalidBlockIds(f"run {r!r} writes beyond the receiver's {dst_blocks} blocks")
            out.append(BlockRun(s, d, c))
        end = -1
        for r in sorted(out, key=lambda r: r.dst):
            if r.dst < end:
                raise InvalidBlockIds(f"destination block {r.dst} is written twice; each is written once")
            end = r.dst + r.count
        return tuple(out)

    def _after_put(self, st: _Outbound, seq_id: SeqId, layers: tuple[int, ...], runs: tuple[BlockRun, ...],
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
            with self._lock:
                gone = instance in self._departed
            if gone:
                self._table.fail(seq_id, PeerDisconnected(f"sender {instance} disconnected before {seq_id!r} landed"))

    def inbound_peers(self) -> list[str]:
        """Instance ids of the senders connected to us now."""
        with self._lock:
            return [ib.peer for ib in self._inbound.values() if ib.peer is not None]

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
        if self._bells:
            self._poll_bells()
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
        with self._lock:
            inbound = [ib for ib in self._inbound.values() if ib.peer is not None]
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
                    "do not reuse its blocks yet"
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
        with self._stats_lock:
            out: dict[str, Any] = dict(vars(self._stats))
        with self._lock:
            out["paths"] = sorted({st.link.describe() for st in self._outbound})
            out["inbound_peers"] = len(self._inbound)
            out["outbound_peers"] = len(self._outbound)
        out.update(backend=self.backend, slots_in_use=self._table.in_use, capacity=self._table.capacity)
        out["transport"] = self.transport.stats()
        return out

    def close(self) -> None:
        """Stop everything; waiters get CommClosed. Always returns promptly; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outs, ins = list(self._outbound), list(self._inbound.values())
            self._outbound.clear()
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

    def _outbound_state(self, peer: Peer) -> _Outbound:
        self._check_open()
        if not isinstance(peer, Peer):
            raise InvalidArgument(f"expected a Peer from cm.connect(), got {type(peer).__name__}")
        return peer._state

    def _spawn(self, fn: Any, name: str, *args: Any) -> threading.Thread:
        """Start a daemon thread (joined at close). Raises RuntimeError when no thread can be started."""
        t = threading.Thread(target=fn, args=args, name=name, daemon=True)
        t.start()
        with self._lock:  # finished threads are forgotten: the list does not grow with every connection
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
        return t

    def _count_failure(self) -> None:
        with self._stats_lock:
            self._stats.failures += 1

    def _check_compatible(self, meta: dict[str, Any]) -> None:
        """Raise IncompatiblePeer unless the peer's backend and layout match ours."""
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

    # ---------------------------------------------------------------- receiver side
    def _on_hello(self, hello: PendingHello) -> bool | None:
        """Admission thread: a connection sent a complete HELLO. Checks the secret first (a stranger never gets
        a thread), then hands the connection to a handshake thread of its own. Returns True when taken, False
        while every handshake slot is busy (the admission queue offers it again), None when refused."""
        try:
            outer = wire.parse_json_payload(hello.payload, "HELLO")
            body = outer.get("body")
            if not isinstance(body, str):
                raise ProtocolError("HELLO without body")
            if self.settings.secret is not None and not wire.auth_ok(
                    self.settings.secret, hello.nonce, body.encode(), outer.get("auth")):
                with self._stats_lock:
                    self._stats.refused_peers += 1
                raise ProtocolError("handshake authentication failed: the peer does not know KV_TRANSPORT_SECRET "
                                    "(set the same secret on both sides)")
            with self._lock:
                if self._closed:
                    raise CommClosed("CommManager closed")
                if len(self._inbound) >= MAX_INBOUND:
                    raise ProtocolError(f"this receiver already serves {MAX_INBOUND} senders; try another")
        except KVTransportError as exc:
            self._logs.log(logging.INFO, "refused", "side-channel connection from %s refused: %s", hello.label, exc)
            _refuse_now(hello.sock, exc)
            return None
        if not self._handshakes.acquire(blocking=False):
            return False
        hello.sock.setblocking(True)
        conn = FramedSocket(hello.sock, hello.label, self.settings.timeout)
        conn.preload(hello.leftover)
        inbound = _Inbound(self, conn)
        with self._lock:
            self._inbound[id(inbound)] = inbound
        try:
            self._spawn(inbound.serve, f"kvt-in-{hello.label.rsplit(':', 1)[-1]}", body)
        except RuntimeError as exc:  # no thread could be started (a transient shortage): refuse, keep serving
            self._handshakes.release()
            with self._lock:
                self._inbound.pop(id(inbound), None)
            self._logs.log(logging.WARNING, "spawn", "kvtransport: cannot start a thread for %s (%s); refused",
                           hello.label, exc)
            inbound.close()
            return None
        return True

    def _add_bell(self, inbound: _Inbound) -> None:
        with self._lock:
            self._bells = [*self._bells, inbound]
            self._table.poller = self._poll_bells

    def _drop_bell(self, inbound: _Inbound) -> None:
        with self._lock:
            self._bells = [ib for ib in self._bells if ib is not inbound]
            if not self._bells:
                self._table.poller = None

    def _poll_bells(self) -> int:
        """Apply what the doorbells of every inbound link show landed: 2 if anything was, 1 if a signal's
        copies are still running, else 0. Any thread."""
        state = 0
        for inbound in self._bells:
            state = max(state, inbound.poll_bell())
        return state

    def _old_link_gone(self, instance: str) -> bool:
        """Whether no live link of sender ``instance`` remains. A sender that reconnects after a partition
        may find its old link still here (its close never arrived): the old connection is probed (a PONG,
        which a live sender ignores; a sender that closed it answers with a reset) and given
        RECONNECT_PROBE_S to go. Handshake thread; bounded."""
        with self._lock:
            old = [ib for ib in self._inbound.values() if ib.peer == instance]
        if not old:
            return True
        for ib in old:
            try:
                ib.conn.send(FrameType.PONG)
            except KVTransportError:
                ib.conn.close()  # already broken: its reader ends now
        deadline = time.monotonic() + min(RECONNECT_PROBE_S, self.settings.timeout)
        while time.monotonic() < deadline:
            with self._lock:
                if not any(ib.peer == instance for ib in self._inbound.values()):
                    return True
            time.sleep(0.02)
        return False

    def _drop_inbound(self, inbound: _Inbound) -> None:
        with self._lock:
            self._inbound.pop(id(inbound), None)
            self._table.peers = max(1, sum(1 for ib in self._inbound.values() if ib.peer is not None))
            if inbound.peer is not None:
                self._departed[inbound.peer] = None
                while len(self._departed) > 1024:
                    self._departed.popitem(last=False)
        if inbound.peer is not None:  # sequences expected from it (and not landed) fail now
            self._table.fail_peer(inbound.peer, PeerDisconnected(f"sender {inbound.peer} disconnected"))


def _challenge() -> tuple[bytes, bytes]:
    """A fresh nonce and the CHALLENGE frame carrying it (sent to each connection on accept)."""
    nonce = secrets.token_bytes(16)
    return nonce, wire.frame(FrameType.CHALLENGE, wire.json_payload({"nonce": nonce.hex()}))


def _hello_length(header: bytes) -> int:
    """The payload length of a connection's first frame, which must be a HELLO (ProtocolError otherwise)."""
    kind, length = wire.parse_header(header)
    if kind != FrameType.HELLO:
        raise ProtocolError(f"expected HELLO, got {kind.name}")
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


def _complete_watching_refusal(conn: FramedSocket, dialer: Any, reply: dict[str, Any], deadline: float,
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


class _Inbound:
    """One connected sender, served on its own thread."""

    def __init__(self, cm: CommManager, conn: FramedSocket) -> None:
        self.cm = cm
        self.conn = conn
        self.link: InboundLink | None = None
        self.peer: str | None = None
        self.closed = False
        self._checksums: dict[SeqId, list[tuple[int, int, list[BlockRun]]]] = {}
        self._pending_checksums = 0
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

    def serve(self, hello_body: str) -> None:
        """Handshake thread, then the connection's reader: ``hello_body`` is the HELLO's body (its HMAC over
        our CHALLENGE's nonce was checked on admission when a secret is set)."""
        cm = self.cm
        try:
            try:
                self._handshake(hello_body)
            finally:
                cm._handshakes.release()
            assert self.link is not None and self.peer is not None
            two_sided = not cm.capabilities.one_sided
            while True:
                marks: list[tuple[SeqId, int | None]] = []  # landed events of consecutive SIGNALs: applied at once
                try:
                    for kind, payload in self.conn.recv_many():
                        if kind == FrameType.SIGNAL:
                            seq, layer, ticket, puts, nbytes = wire.decode_signal_full(payload)
                            if layer is not None and layer >= cm.layout.num_layers:
                                raise ProtocolError(f"SIGNAL for layer {layer} beyond our {cm.layout.num_layers} layers")
                            if (puts or nbytes) and not two_sided:  # one-sided: what landed since the last one
                                with cm._stats_lock:
                                    cm._stats.puts_received += puts
                                    cm._stats.bytes_received += nbytes
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
            if not cm._closed:
                if self.peer is not None:
                    failed = cm._table.fail_peer(self.peer, PeerDisconnected(f"peer {self.peer} lost: {exc}"))
                    if failed:
                        cm._count_failure()
                        log.warning("peer %s lost with %d sequences in flight: %s", self.peer, len(failed), exc)
                else:
                    log.info("side-channel connection from %s refused: %s", self.conn.peer_label, exc)
        except Exception as exc:  # never let a receiver thread die silently
            log.exception("receiver thread for %s crashed", self.conn.peer_label)
            if self.peer is not None:
                cm._table.fail_peer(self.peer, PeerDisconnected(f"receiver error: {exc}"))
        finally:
            self.close()
            cm._drop_inbound(self)

    def _apply(self, marks: list[tuple[SeqId, int | None]]) -> None:
        """Mark a run of signalled events landed (one table operation) and empty ``marks``; NACK the events
        refused for want of a slot."""
        if not marks:
            return
        cm = self.cm
        marks, pending = list(marks), marks
        pending.clear()
        refused = cm._table.mark_many(marks, peer=self.peer)
        completed = sum(1 for _, layer in marks if layer is None) - sum(1 for _, layer, _ in refused if layer is None)
        if completed:
            with cm._stats_lock:
                cm._stats.sequences_completed += completed
        for seq, _, exc in refused:
            self._refuse(seq, exc)

    def _refuse(self, seq: SeqId, exc: KVTransportError) -> None:
        """Tell the sender that its event for ``seq`` was refused (NACK); foreign ones are counted."""
        if isinstance(exc, ForeignSequence):
            with self.cm._stats_lock:
                self.cm._stats.foreign_refused += 1
        self.conn.send(FrameType.NACK, wire.encode_error(seq, exc))

    def _on_frame(self, kind: FrameType, payload: bytes, two_sided: bool) -> None:
        """Every frame but SIGNAL, in order."""
        cm = self.cm
        if kind == FrameType.PUT and two_sided:
            self._on_put(payload)
        elif kind == FrameType.CHECKSUM:
            seq, ck_layer, crc, runs = wire.decode_checksum(payload)
            if ck_layer >= cm.layout.num_layers or any(r.dst + r.count > cm.layout.num_blocks for r in runs):
                raise ProtocolError("CHECKSUM frame outside our layout")
            self._pending_checksums += 1
            if self._pending_checksums > MAX_PENDING_CHECKSUMS:
                raise ProtocolError(f"more than {MAX_PENDING_CHECKSUMS} checksums wait for their signals")
            self._checksums.setdefault(seq, []).append((ck_layer, crc, runs))
        elif kind == FrameType.ABORT_ACK:
            seq, token = wire.decode_abort(payload)
            self.forget_ack(seq, token)
        elif kind == FrameType.CANCEL:
            seq = wire.decode_cancel(payload)
            try:  # record it even if nobody waits yet, so a later wait fails at once
                cm._table.acquire(seq, peer=self.peer, remote=True)
            except SlotsExhausted:
                pass
            except ForeignSequence as exc:  # another sender's sequence: not ours to cancel
                self._refuse(seq, exc)
                return
            cm._table.fail(seq, SequenceAborted(f"sequence {seq!r} was cancelled by the sender"))
        elif kind == FrameType.PING:
            self.conn.send(FrameType.PONG)
        elif kind == FrameType.DOORBELL:
            self._open_bell(wire.parse_json_payload(payload, "DOORBELL"))
        else:
            raise ProtocolError(f"unexpected {kind.name} frame from a connected peer")

    def _open_bell(self, offer: dict[str, Any]) -> None:
        """The sender offers a doorbell (kvtransport.doorbell); map it if we can, else signals come by frame."""
        path = offer.get("path")
        settings = self.cm.settings
        if settings.checksum or not settings.doorbell or self.bell is not None or not isinstance(path, str):
            return  # checksums are verified when the SIGNAL frame arrives: keep that path only
        try:
            bell = BellReader(path)
        except (OSError, ProtocolError) as exc:  # another host, or no /dev/shm: the frames carry every signal
            log.info("doorbell of %s not mapped (%s); completions come by the side channel", self.peer, exc)
            return
        with self.bell_lock:
            self.bell = bell
        self.cm._add_bell(self)

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
        n = self.cm.layout.num_layers
        events = [(seq, layer) for seq, layer in events if layer is None or 0 <= layer < n]
        if not events:
            return 1 if running else 0
        with self.cm._stats_lock:
            self.cm._stats.doorbell_signals += len(events)
        try:
            self._apply(events)
        except KVTransportError as exc:  # a NACK that could not be sent: the reader thread sees the link fail
            log.info("doorbell signals from %s: %s", self.peer, exc)
        return 2

    def _handshake(self, body: str) -> None:
        """The handshake past the (admitted, authenticated) HELLO: metadata, compatibility, the backend's link."""
        cm = self.cm
        deadline = time.monotonic() + cm.settings.timeout
        answer = None
        try:
            hello = wire.parse_json_payload(body.encode(), "HELLO body")
            meta = hello.get("metadata")
            request = hello.get("request")
            if not isinstance(meta, dict) or not isinstance(request, dict):
                raise ProtocolError("HELLO body lacks metadata/request")
            meta = wire.decode_metadata(wire.encode_metadata(meta))  # same validation as connect()
            cm._check_compatible(meta)
            if not cm._old_link_gone(meta["instance"]):  # one link per sender: no one takes over another's id
                raise IncompatiblePeer(f"a sender with instance id {meta['instance']} is already connected")
            info = PeerInfo(meta["instance"], meta["host"], KVLayout.from_wire(meta["layout"]), meta["transport"])
            answer = cm.transport.answer(info, request)
            welcome: dict[str, Any] = {"reply": answer.reply, "instance": cm.instance}
            if cm.settings.secret is not None:  # we prove the secret too, over the sender's fresh nonce
                try:
                    their_nonce = bytes.fromhex(str(hello.get("nonce", "")))
                except ValueError:
                    raise ProtocolError("malformed HELLO: its nonce is not hex") from None
                if len(their_nonce) < 16:
                    raise ProtocolError("HELLO without a nonce of 16 bytes or more")
                welcome["auth"] = wire.auth_tag(cm.settings.secret, their_nonce, b"welcome " + cm.instance.encode())
            self.conn.send(FrameType.WELCOME, wire.json_payload(welcome))
            self.link = answer.complete(max(0.001, deadline - time.monotonic()))
            with cm._lock:
                if meta["instance"] in (ib.peer for ib in cm._inbound.values()):  # (one that raced us)
                    raise IncompatiblePeer(f"a sender with instance id {meta['instance']} is already connected")
                self.peer = meta["instance"]
                cm._table.peers = max(1, sum(1 for ib in cm._inbound.values() if ib.peer is not None))
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
        cm = self.cm
        pending = self._checksums.get(seq, [])
        due = [c for c in pending if layer is None or c[0] == layer]
        self._pending_checksums -= len(due)
        self._checksums[seq] = [c for c in pending if c not in due]
        if not self._checksums[seq]:
            del self._checksums[seq]
        for lyr, crc, runs in due:
            if pieces_crc32(cm.layout.layers[lyr], runs, source=False) != crc:
                try:
                    cm._table.acquire(seq, peer=self.peer, remote=True)
                except ForeignSequence as exc:
                    self._refuse(seq, exc)
                    return False
                cm._table.fail(seq, TransferError(
                    f"integrity check failed for sequence {seq!r} layer {lyr}: the bytes that landed differ "
                    "from what was sent (silent corruption on the path)"))
                cm._count_failure()
                return False
        return True

    def _on_put(self, payload: bytes) -> None:
        cm = self.cm
        assert self.link is not None
        seq, layer, runs = wire.decode_put(payload)
        if layer >= cm.layout.num_layers:
            raise ProtocolError(f"PUT for layer {layer} beyond our {cm.layout.num_layers} layers")
        for r in runs:
            if r.dst + r.count > cm.layout.num_blocks or r.src + r.count > self.peer_layout.num_blocks:
                raise ProtocolError(f"PUT run {r} is beyond the block range")
        try:
            st = cm._table.acquire(seq, peer=self.peer, remote=True)
            dropped: KVTransportError | None = None
            if st is None:
                dropped = TransferError(f"sequence {seq!r} was released by the receiver; data discarded")
        except (SlotsExhausted, ForeignSequence) as exc:
            st, dropped = None, exc
        if st is None or st.finished:
            self.link.discard(layer, runs, cm.settings.timeout)
            if dropped is not None:
                self._refuse(seq, dropped)
            return
        self.link.receive(layer, runs, cm.settings.timeout)
        nblocks = sum(r.count for r in runs)
        with cm._stats_lock:
            cm._stats.puts_received += 1
            cm._stats.bytes_received += nblocks * cm.layout.layers[layer].block_bytes

    def close(self) -> None:
        with self._acks_lock:
            self.closed = True  # a sender that is gone cannot write: release everyone waiting for its ack
            acks, self._acks = list(self._acks.values()), {}
        for ev in acks:
            ev.set()
        if self.bell is not None:
            self.cm._drop_bell(self)
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


class _Parking:
    """Cooperative GIL hand-off between a signaller thread and the threads that call the sender API.

    A thread that waits for the GIL while another runs Python waits up to the interpreter's switch interval
    (5 ms by default; it is process-global, so we leave it alone). The signaller mostly waits *without* the
    GIL — idle, or in a backend's wait written in C — and needs the interpreter only for short stretches
    between. ``flag`` is 1 while it is parked like that and 0 when it needs the interpreter, since ``since``
    (ns, ``time.monotonic_ns``): the signaller clears it when it is woken with work, and a backend's C wait
    just before it returns. A sender API call may then block (releasing the GIL) until the signaller parks
    again, at most YIELD_S (see ``after_call`` for when). Each such hand-off costs two thread wake-ups
    (~0.1 ms on a loaded 2-core VM), so a tight loop of puts and signals — which is not where the
    interpreter is held for long — does not yield at every call.
    """

    def __init__(self) -> None:
        self.flag = ctypes.c_int32(1)
        self.since = ctypes.c_int64(0)
        self._last_call = 0
        self._last_gap = 0
        self._parked = threading.Event()
        self._parked.set()
        self._lock = threading.Lock()

    def park(self) -> None:
        """Signaller: about to wait without the GIL (idle, or a wait in C that clears ``flag`` when it ends)."""
        with self._lock:
            self.flag.value = 1
            self._parked.set()

    def unpark(self) -> None:
        """The signaller needs the interpreter (it was woken with work, or returned from a wait)."""
        if self.flag.value:
            self.since.value = time.monotonic_ns()
            self.flag.value = 0

    def yield_to_signaller(self, starved_ns: int = 0) -> None:
        """Caller: if the signaller has needed the interpreter for ``starved_ns`` or more, let it run until
        it parks (bounded by YIELD_S)."""
        if self.flag.value or time.monotonic_ns() - self.since.value < starved_ns:
            return
        with self._lock:
            if self.flag.value:
                return
            self._parked.clear()
        self._parked.wait(YIELD_S)

    def after_call(self, *, end_of_burst: bool) -> None:
        """Caller, at the end of a sender API call: yield when it pays. A call that ends a burst (a
        request's ``signal``) is followed by other work, so a signaller that needs the interpreter gets it
        now; so it does when the caller spent BUSY_GAP_NS or more elsewhere before this call or the one
        before (it is busy in Python between a put/signal pair and the next); in a tight loop of calls only a
        signaller starved for STARVED_NS does."""
        now = time.monotonic_ns()
        gap, self._last_call = now - self._last_call, now
        busy = gap >= BUSY_GAP_NS or self._last_gap >= BUSY_GAP_NS  # a put and its signal come as a pair
        self._last_gap = gap
        if self.flag.value:
            return
        self.yield_to_signaller(0 if end_of_burst or busy else STARVED_NS)


class _Outbound:
    """Sender-side state of one peer link.

    One-sided backends: a frame that must arrive after earlier puts (SIGNAL, CANCEL, CHECKSUM) is queued
    with the link's mark of what it had issued then (``link.mark()``, for backends that offer
    ``mark``/``landed``). Queued frames leave in order and in batches (one socket write): from the caller's
    thread at once when everything they follow has already landed and nothing older is waiting, otherwise
    from the signaller thread, which flushes the link once per batch. A caller's later put or signal also
    sends the frames whose puts have landed meanwhile, so a busy caller thread — which holds the GIL and
    would keep the signaller waiting up to the interpreter's switch interval — still moves them along; and
    a caller lets the signaller run first when it needs the interpreter (``_Parking``).

    A backend may offer ``link.flush_and_send(timeout, fd, data, parking, on_wait) -> int``: flush, then
    write the batch's bytes to the side channel's socket from the same GIL-free wait that saw the puts land
    (returns the bytes it wrote; the manager writes the rest). Then a signal leaves when its copy ends, not
    when the signaller next gets the interpreter. Before such a wait it calls ``on_wait(mailbox)``: while
    the wait is on, one frame queued with the same mark (nothing issued since; typically the request's
    ``signal`` right after its last ``signal_layer``) is handed to ``mailbox.append(bytes)`` and written
    right after the batch; ``mailbox.close()`` (after the wait) says how much of it was.
    """

    def __init__(self, cm: CommManager, conn: FramedSocket, link: OutboundLink, info: PeerInfo) -> None:
        self.cm = cm
        self.conn = conn
        self.link = link
        self.info = info
        self.one_sided = cm.capabilities.one_sided
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
        mark, landed = getattr(link, "mark", None), getattr(link, "landed", None)
        self._mark: Any = mark if callable(mark) and callable(landed) else None
        self._landed: Any = landed if self._mark is not None else None
        flush_and_send = getattr(link, "flush_and_send", None)
        self._flush_and_send_fn: Any = flush_and_send if callable(flush_and_send) else None
        self._parking = _Parking()
        self._signaller_idle = False
        self._inflight: tuple[Any, Any] | None = None  # (mailbox, mark) of the batch the backend is flushing
        self._inflight_extra: list[tuple[FrameType, bytes, Any]] = []  # frames added to that mailbox
        self._bell: BellWriter | None = None  # this link's doorbell (see open_doorbell)
        self._bell_word = 0  # device address of its completion word
        self._bell_host = 0  # host address of its mapping
        self._unsignalled = [0, 0]  # one-sided: puts and bytes issued since the last SIGNAL (under _put_lock)
        self._reader = cm._spawn(self._read_loop, f"kvt-out-{info.instance[:6]}")
        if self.one_sided:
            self._signaller = cm._spawn(self._signal_loop, f"kvt-sig-{info.instance[:6]}")

    def open_doorbell(self) -> None:
        """Right after connect, before any signal: offer the receiver a doorbell if the link can write one
        (``link.doorbell``; kvtransport.doorbell). Without one, or if anything fails, signals go by frame."""
        door = getattr(self.link, "doorbell", None)
        if door is None or not self.one_sided or self.cm.settings.checksum or not self.cm.settings.doorbell:
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
        bell = self._bell
        if bell is None:
            return 0
        ticket = bell.announce(seq, layer)
        if ticket:
            try:
                self.link.doorbell.doorbell_write(self._bell_word, ticket)
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
                if self.one_sided:  # the receiver learns these counts from the next SIGNAL
                    nblocks = sum(r.count for r in runs)
                    self._unsignalled[0] += len(layers)
                    self._unsignalled[1] += sum(nblocks * self.cm._layer_block_bytes[layer] for layer in layers)
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
            except Exception as exc:  # a backend that leaked its library's error: still a typed error
                err = TransferError(f"{self.cm.backend} put failed: {type(exc).__name__}: {exc}")
                self._fail_link(err)
                raise err from exc
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
            self.link.flush(self.cm.settings.timeout)
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
        try:
            self.link.flush(timeout)
        except KVTransportError:
            raise
        except Exception as exc:  # a backend that leaked its library's error: still a typed error
            raise TransferError(f"{self.cm.backend} flush failed: {type(exc).__name__}: {exc}") from exc

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
                timeout = self.cm.settings.timeout
                fs = self._flush_and_send_fn
                if fs is not None:  # the backend writes the batch the moment the puts land (class docstring)
                    token = batch[-1][2]

                    def on_wait(mailbox: Any) -> None:
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
            self._delivery_error = TransferError(f"{self.cm.backend} flush failed: {type(exc).__name__}: {exc}")
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
                    self.cm._count_failure()
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
                        self.link.doorbell.doorbell_unmap(self._bell_host)
                    except Exception as exc:
                        log.warning("doorbell unmap failed: %s", exc)


def _int_like(x: object) -> bool:
    """numpy integer scalars pass; bool, float and str do not."""
    return hasattr(x, "__index__") and not isinstance(x, bool) and type(x).__name__.startswith(("int", "uint"))


def _not_int(x: object) -> int:
    raise TypeError(f"not an integer: {x!r}")
