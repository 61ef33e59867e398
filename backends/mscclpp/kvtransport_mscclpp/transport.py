"""The ``mscclpp`` backend: MSCCL++ connections, one device-side launch per put on CUDA IPC.

Per link, the receiver (rank 0) and the sender (rank 1) form a private two-rank MSCCL++ bootstrap whose
root listens on the receiver's NET_IFNAME address (loopback by default) — never a hard-coded interface.
The unique id is built here from that address and handed over in the handshake (no pickle: 128 raw
bytes, hex). Over that bootstrap both sides ``connect`` with the transport :mod:`.routing` picked and the
receiver sends its registered KV extents.

* **CudaIpc** (a peer on this host): the receiver's registrations arrive already mapped into the sender;
  each put is one kernel on the caller's current stream (after the kernels that produced the KV) that
  copies every segment of the put with 16-byte NVLink stores (:mod:`kvtransport.gpu`). No host call
  per block, no 4 GiB offset limit (64-bit addresses), one memory id per KV extent, no proxy thread.
* **IB0..IB7** (a peer on another host): both sides register their extents for RDMA and each segment is
  an RDMA write through ``Connection.write``; ``flush`` waits for completions, bounded. Not validated on
  InfiniBand hardware yet (the GPU host here has none): see docs/notes.md.

Completion is the core's: flush (event or RDMA completion), then the SIGNAL frame on the side channel.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtransport.backend import (
    Answer,
    Capabilities,
    CompletionMarks,
    Dialer,
    InboundLink,
    JSONDict,
    OutboundLink,
    PeerInfo,
    Transport,
)
from kvtransport.coalesce import BlockRun
from kvtransport.config import Settings, host_id, unknown_option
from kvtransport.errors import (
    BackendUnavailable,
    ConfigurationError,
    IncompatiblePeer,
    KVTransportError,
    TransferError,
)
from kvtransport.gpu import MappedPutter, PeerWindows, SegmentCopier, allocation_extents, segments
from kvtransport.layout import KVLayout

from . import native, routing

log = logging.getLogger("kvtransport.mscclpp")
UNIQUE_ID_BYTES = 128
CONNECT_TAG = 0


def make_unique_id(address: str, port: int, magic: int | None = None) -> bytes:
    """An MSCCL++ ``UniqueId`` whose root listens on ``address:port`` (IPv4): magic (u64), then a
    ``sockaddr_in``, zero-padded to 128 bytes — the layout TcpBootstrap uses."""
    try:
        packed = socket.inet_aton(address)
    except OSError:
        raise ConfigurationError(
            f"mscclpp bootstrap needs an IPv4 address, NET_IFNAME gave {address!r}: pick an interface with IPv4"
        ) from None
    magic = secrets.randbits(64) if magic is None else magic
    body = struct.pack("<Q", magic) + struct.pack("<H", socket.AF_INET) + struct.pack(">H", port) + packed
    return body.ljust(UNIQUE_ID_BYTES, b"\0")


def free_port(address: str) -> int:
    """A TCP port free on ``address`` right now (the bootstrap root binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


class MscclppTransport(Transport):
    name = "mscclpp"

    def __init__(self, layout: KVLayout, settings: Settings, *, options: tuple[str, ...]) -> None:
        """``options``: the backend's own option names (its spec's ``options``), named when one is unknown."""
        opts = dict(settings.backend_options)
        self.requested = routing.parse_request(opts.pop("transport", None))
        try:
            self.ib_index = int(opts.pop("ib_index", 0))
        except ValueError:
            raise ConfigurationError("mscclpp option ib_index must be an integer") from None
        if opts:
            raise unknown_option(sorted(opts)[0], options, "mscclpp backend")
        self.build = native.build_info()
        self.ib_devices = native.ib_devices()
        if self.requested is not None and self.requested != routing.CUDA_IPC:  # say at open() if RDMA cannot work
            routing.choose(same_host=False, requested=self.requested, ib_devices=self.ib_devices,
                           ib_compiled=self.build.ib_compiled)
        if not layout.is_cuda:
            raise BackendUnavailable(
                "mscclpp backend moves CUDA memory only; for host-memory KV caches use ucx or nccl (KV_TRANSPORT=auto)"
            )
        self.m = native.load()
        import torch

        self._torch = torch
        self.device = torch.device(layout.device)
        self.device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.on_device()
        self.layout = layout
        self.settings = settings
        self.extents = allocation_extents(layout.extents())  # one registration per CUDA allocation
        self.capabilities = Capabilities(
            one_sided=True,
            memory_kinds=frozenset({"cuda"}),
            cross_host=self.build.ib_compiled and bool(self.ib_devices),
            notes="MSCCL++: CudaIpc (one copy kernel per put) inside a host; IB RDMA writes between hosts",
        )
        try:
            self.ctx = self.m.CppContext.create()
        except Exception as exc:
            raise native.translate(exc, "context creation") from None
        self._lock = threading.Lock()
        self._registrations: dict[str, list[Any]] = {}
        self._copier: Any = None
        log.info("mscclpp: %s; RDMA devices: %s", self.build.summary(), ", ".join(self.ib_devices) or "none")

    # ---------------------------------------------------------------- shared pieces
    def on_device(self) -> None:
        """Make our device's context current on the calling thread. MSCCL++ registers and maps memory in the
        current context; links are set up on the manager's threads, where none is current until this runs
        (``cuMemGetAddressRange ... invalid device context`` otherwise)."""
        self._torch.cuda.set_device(self.device_index)

    def describe(self) -> JSONDict:
        return {
            "host": host_id(),
            "pid": os.getpid(),
            "device": self.device_index,
            "ib_devices": self.ib_devices,
            "ib_compiled": self.build.ib_compiled,
            "version": self.build.version,
        }

    def transport_flag(self, transport: str) -> Any:
        return self.m.CppTransportFlags(getattr(self.m.CppTransport, transport))

    def registrations(self, transport: str) -> list[Any]:
        """Our KV extents registered for ``transport`` (once per transport, in ``self.extents`` order)."""
        with self._lock:
            regs = self._registrations.get(transport)
            if regs is None:
                flags = self.transport_flag(transport)
                try:
                    self.on_device()
                    regs = [self.ctx.register_memory(addr, length, flags) for addr, length in self.extents]
                except Exception as exc:
                    raise native.translate(exc, f"memory registration for {transport}") from None
                self._registrations[transport] = regs
            return regs

    def copier(self) -> Any:
        with self._lock:
            if self._copier is None:
                try:
                    self._copier = SegmentCopier(self.device_index)
                except ImportError as exc:
                    raise BackendUnavailable(f"mscclpp CudaIpc puts need CuPy to launch the copy kernel: {exc}") from None
            return self._copier

    def bootstrap(self, rank: int, unique_id: bytes, timeout: float) -> Any:
        """Join the link's two-rank bootstrap (rank 0 listens). Blocking up to ``timeout`` (GIL released)."""
        try:
            self.on_device()
            boot = self.m.CppTcpBootstrap.create(rank, 2)
            uid = self.m.CppUniqueId.__new__(self.m.CppUniqueId)  # as pickle does: nanobind's __setstate__
            uid.__setstate__(unique_id)  # initialises a fresh instance (no pickle involved: raw bytes)
            boot.initialize(uid, max(1, math.ceil(timeout)))
        except Exception as exc:
            raise native.translate(exc, "bootstrap") from None
        return boot

    def choose(self, peer: PeerInfo) -> routing.Choice:
        same_host = peer.transport.get("host") == host_id()
        return routing.choose(
            same_host=same_host,
            requested=self.requested,
            ib_devices=self.ib_devices,
            ib_compiled=self.build.ib_compiled,
            ib_index=self.ib_index,
        )

    def dial(self, peer: PeerInfo) -> Dialer:
        return _Dialer(self, peer, self.choose(peer))

    def answer(self, peer: PeerInfo, request: JSONDict) -> Answer:
        transport = request.get("transport")
        valid = {routing.CUDA_IPC} | {f"IB{i}" for i in range(routing.MAX_IB)}
        if transport not in valid:
            raise IncompatiblePeer(f"mscclpp peer asked for transport {transport!r}")
        if transport == routing.CUDA_IPC and peer.transport.get("host") != host_id():
            raise IncompatiblePeer("mscclpp peer asked for CudaIpc from another host")
        if transport != routing.CUDA_IPC:  # our side must be able to serve RDMA too
            routing.choose(same_host=False, requested=transport, ib_devices=self.ib_devices,
                           ib_compiled=self.build.ib_compiled)
        return _Answer(self, str(transport))

    def stats(self) -> JSONDict:
        return {"build": self.build.summary(), "rdma_devices": self.ib_devices}

    def close(self) -> None:
        with self._lock:
            self._registrations.clear()
            self._copier = None


class _Answer(Answer):
    """Receiver side: root of the link's bootstrap; sends our registrations.

    Registration happens here, before the receiver's WELCOME: if it fails, the sender gets a REFUSE with the
    reason right away instead of waiting in a bootstrap that its peer will never join."""

    def __init__(self, tr: MscclppTransport, transport: str) -> None:
        self.tr = tr
        self.transport = transport
        self.regs = tr.registrations(transport)
        address = tr.settings.address
        self.unique_id = make_unique_id(address, free_port(address))
        self.reply = {"unique_id": self.unique_id.hex(), "transport": transport,
                      "extents": [[addr, length] for addr, length in tr.extents]}

    def complete(self, timeout: float) -> InboundLink:
        tr = self.tr
        regs = self.regs
        boot = tr.bootstrap(0, self.unique_id, timeout)
        try:
            comm = tr.m.CppCommunicator(boot, tr.ctx)
            conn_future = comm.connect(tr.m.CppEndpointConfig(getattr(tr.m.CppTransport, self.transport)), 1, CONNECT_TAG)
            for i, reg in enumerate(regs):
                comm.send_memory(reg, 1, CONNECT_TAG + 1 + i)
            # Unbounded, and with the GIL held: MSCCL++ binds future.get() without releasing the GIL and its
            # bootstrap's accept has no timeout, so a peer that dies between the bootstrap and its endpoint
            # message stalls this process (README, "Known limits"). Both sides send before they wait, so
            # the window is the few ms after a successful bootstrap.
            conn = conn_future.get()
        except KVTransportError:
            raise
        except Exception as exc:
            raise native.translate(exc, f"{self.transport} connection (receiver)") from None
        return _InLink([boot, comm, conn])


class _InLink(InboundLink):
    """One-sided: the receiver only keeps the link's MSCCL++ objects alive until close."""

    def __init__(self, keep: list[Any]) -> None:
        self._keep = keep

    def close(self) -> None:
        self._keep = []


class _Dialer(Dialer):
    def __init__(self, tr: MscclppTransport, peer: PeerInfo, choice: routing.Choice) -> None:
        self.tr = tr
        self.peer = peer
        self.choice = choice
        self.request = {"transport": choice.transport}

    def complete(self, reply: JSONDict, timeout: float) -> OutboundLink:
        tr = self.tr
        try:
            unique_id = bytes.fromhex(str(reply["unique_id"]))
            extents = [(int(a), int(n)) for a, n in reply["extents"]]
        except (KeyError, ValueError, TypeError):
            raise IncompatiblePeer("mscclpp peer sent a malformed reply") from None
        nregs = len(extents)
        covered = _covers(self.peer.layout.extents(), extents)
        if len(unique_id) != UNIQUE_ID_BYTES or not covered or reply.get("transport") != self.choice.transport:
            raise IncompatiblePeer("mscclpp peer's reply does not match its layout or our transport")
        local_regs = tr.registrations(self.choice.transport) if self.choice.is_ib else []
        boot = tr.bootstrap(1, unique_id, timeout)
        try:
            comm = tr.m.CppCommunicator(boot, tr.ctx)
            endpoint = tr.m.CppEndpointConfig(getattr(tr.m.CppTransport, self.choice.transport))
            conn_future = comm.connect(endpoint, 0, CONNECT_TAG)
            mem_futures = [comm.recv_memory(0, CONNECT_TAG + 1 + i) for i in range(nregs)]
            conn = conn_future.get()  # unbounded, GIL held: see the receiver's complete()
            remotes = [f.get() for f in mem_futures]
        except Exception as exc:
            raise native.translate(exc, f"{self.choice.transport} connection (sender)") from None
        for (addr, length), remote in zip(extents, remotes, strict=True):
            if remote.size() < length:
                raise IncompatiblePeer(f"mscclpp peer registered {remote.size()} bytes for an extent of {length} at {addr:#x}")
        keep = [boot, comm, conn, remotes, local_regs]
        if self.choice.is_ib:
            return _IbOutLink(tr, self.peer, self.choice, conn, extents, remotes, local_regs, keep)
        windows = PeerWindows([(addr, length, remote.data()) for (addr, length), remote in zip(extents, remotes, strict=True)])
        return _IpcOutLink(MappedPutter(tr.layout, self.peer.layout, windows, tr.copier()), self.choice, keep)


class _IpcOutLink(OutboundLink, CompletionMarks):
    """CudaIpc: one copy kernel per put into the peer's mapped memory."""

    def __init__(self, putter: Any, choice: routing.Choice, keep: list[Any]) -> None:
        self.putter = putter
        self.doorbell = putter  # device-written completion words (kvtransport.doorbell)
        self.choice = choice
        self._keep = keep

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        self._put(self.putter.put, layer, runs)

    def put_layers(self, layers: Sequence[int], runs: Sequence[BlockRun]) -> None:
        self._put(self.putter.put_layers, layers, runs)  # one kernel for every layer

    @staticmethod
    def _put(launch: Any, layers: Any, runs: Sequence[BlockRun]) -> None:
        """Run one of the putter's launches; a library error becomes a typed kvtransport error."""
        try:
            launch(layers, runs)
        except KVTransportError:
            raise
        except Exception as exc:
            raise native.translate(exc, "CudaIpc put") from None

    def mark(self) -> Any:
        return self.putter.last_event

    def landed(self, token: Any) -> bool:
        return bool(self.putter.landed(token))

    def flush(self, timeout: float) -> None:
        self.putter.flush(timeout)

    def describe(self) -> str:
        return "mscclpp CudaIpc (one copy kernel per put, NVLink/PCIe)"

    def close(self) -> None:
        try:
            self.putter.flush(1.0)
        except Exception:
            pass
        self.putter.close()
        self._keep = []


class _IbOutLink(OutboundLink):
    """IB: one RDMA write per segment through ``Connection.write``; flush waits for completions.

    Not validated on InfiniBand hardware here (see module docstring)."""

    def __init__(self, tr: MscclppTransport, peer: PeerInfo, choice: routing.Choice, conn: Any,
                 remote_extents: list[tuple[int, int]], remotes: list[Any], local_regs: list[Any],
                 keep: list[Any]) -> None:
        self.tr = tr
        self.peer_layout = peer.layout
        self.choice = choice
        self.conn = conn
        self.remote_rows = _Extents(remote_extents, remotes)
        self.local_rows = _Extents(tr.extents, local_regs)
        self._keep = keep

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        src, dst, lens = segments(self.tr.layout.layers[layer], self.peer_layout.layers[layer], runs)
        try:
            for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist(), strict=True):
                src_reg, src_off = self.local_rows.locate(s, n)
                dst_reg, dst_off = self.remote_rows.locate(d, n)
                self.conn.write(dst_reg, dst_off, src_reg, src_off, n)
        except KVTransportError:
            raise
        except Exception as exc:
            raise native.translate(exc, f"{self.choice.transport} write") from None

    def flush(self, timeout: float) -> None:
        try:
            self.conn.flush(int(timeout * 1e6))
        except Exception as exc:
            raise native.translate(exc, f"{self.choice.transport} flush") from None

    def describe(self) -> str:
        return f"mscclpp {self.choice.transport} ({self.choice.why})"

    def close(self) -> None:
        self._keep = []
        self.conn = None


def _covers(layout_extents: list[tuple[int, int]], pieces: list[tuple[int, int]]) -> bool:
    """``pieces`` tile ``layout_extents`` exactly (the peer cut its extents at allocation boundaries)."""
    flat = sorted((a, n) for a, n in pieces)
    i = 0
    for start, length in sorted(layout_extents):
        pos, end = start, start + length
        while pos < end:
            if i >= len(flat) or flat[i][0] != pos or flat[i][1] <= 0:
                return False
            pos += flat[i][1]
            i += 1
        if pos != end:
            return False
    return i == len(flat)


class _Extents:
    """Absolute address -> (registration, offset) for a list of extents and their registrations."""

    def __init__(self, extents: list[tuple[int, int]], regs: list[Any]) -> None:
        rows = sorted(zip((a for a, _ in extents), (a + n for a, n in extents), regs, strict=True), key=lambda r: r[0])
        self.starts = np.array([r[0] for r in rows], dtype=np.uint64)
        self.rows = rows

    def locate(self, addr: int, nbytes: int) -> tuple[Any, int]:
        i = int(np.searchsorted(self.starts, np.uint64(addr), side="right")) - 1
        if i < 0 or addr + nbytes > self.rows[i][1]:
            raise TransferError(f"segment {addr:#x}+{nbytes} is outside the registered KV extents")
        return self.rows[i][2], addr - self.rows[i][0]

