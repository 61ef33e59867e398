"""The ``ucx`` backend: one-sided zero-copy puts straight into the peer's KV blocks.

Each manager owns one UCP context and worker. Its KV memory is registered once (``ucp_mem_map`` per merged
extent of the layout) and the packed remote keys travel in ``cm.metadata()``. A sender creates an endpoint
from the receiver's worker address (no error-handling mode, so UCX may pick shared memory/CMA or
cuda_ipc inside a host instead of TCP; peer failure is detected by the core's side channel) and issues
all segments of a put with one ``put_batch`` call (a C loop). ``flush`` waits for remote completion; the
core then sends the signal. A progress thread sleeping on the worker's event fd serves the paths that
need the target to progress (TCP between hosts); it costs no CPU while idle.
"""

from __future__ import annotations

import bisect
import logging
import os
import select
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtransport.backend import (
    Answer,
    Capabilities,
    Dialer,
    InboundLink,
    JSONDict,
    OutboundLink,
    PeerInfo,
    Transport,
)
from kvtransport.coalesce import BlockRun
from kvtransport.config import Settings, host_id
from kvtransport.errors import (
    BackendUnavailable,
    ConfigurationError,
    IncompatiblePeer,
    PeerDisconnected,
    TransferError,
    TransferTimeout,
)
from kvtransport.layout import KVLayout, LayerRegion

from . import _ucp

log = logging.getLogger("kvtransport.ucx")
OPTIONS = ("tls",)
SLOW_LANES = ("tcp",)


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, layout: KVLayout, settings: Settings) -> None:
        opts = dict(settings.backend_options)
        tls = opts.pop("tls", None)
        if opts:
            raise ConfigurationError(f"ucx backend: unknown options {sorted(opts)}; known: {', '.join(OPTIONS)}")
        if not _ucp.is_available():
            raise BackendUnavailable(f"ucx backend: {_ucp.load_error()}")
        self.layout = layout
        self.settings = settings
        self.cuda = layout.is_cuda
        if self.cuda:
            import torch

            torch.cuda.set_device(torch.device(layout.device))  # UCX's cuda_ipc uses the current device
        self.capabilities = Capabilities(
            one_sided=True, memory_kinds=frozenset({layout.memory_kind}), cross_host=True,
            notes="UCX RMA put (shm/cma/cuda_ipc in a host; rc/dc with a verbs UCX; tcp otherwise)",
        )
        self.lock = threading.RLock()  # the worker is single-threaded: every call goes through this lock
        try:
            self.ctx = _ucp.UcpContext(net_devices=settings.ifname, tls=tls, enable_cuda=self.cuda)
            self.worker = self.ctx.create_worker()
            mem_type = "cuda" if self.cuda else "host"
            self.regions = [self.ctx.mem_map(addr, length, memory_type=mem_type) for addr, length in layout.extents()]
        except _ucp.UcpError as exc:
            raise BackendUnavailable(f"ucx backend could not initialise: {exc} (check UCX_TLS / NET_IFNAME)") from None
        self.ipc_exports: list[list[Any]] = []
        self.ipc_note = ""
        if self.cuda:
            try:
                from . import cudaipc

                self.ipc_exports = cudaipc.export_extents(layout.extents())
            except Exception as exc:  # no driver access or an unusual allocator: UCX puts still work
                self.ipc_note = f"CUDA IPC export failed ({exc}); using UCX puts"
                log.warning("ucx: %s", self.ipc_note)
        self._copier: Any = None
        self._closing = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="kvt-ucx-progress", daemon=True)
        self._progress.start()

    def describe(self) -> JSONDict:
        return {
            "worker": self.worker.address().hex(),
            "regions": [[m.address, m.length, m.pack_rkey().hex()] for m in self.regions],
            "memory": "cuda" if self.cuda else "host",
            "ucx": ".".join(map(str, _ucp.ucx_version())),
            "host": host_id(),
            "pid": os.getpid(),
            "ipc": self.ipc_exports,
        }

    def copier(self) -> Any:
        """The shared CUDA IPC segment copier (compiled on first use); raises if CuPy is missing."""
        with self.lock:
            if self._copier is None:
                from .cudaipc import SegmentCopier

                self._copier = SegmentCopier(torch_device_index(self.layout.device))
            return self._copier

    def dial(self, peer: PeerInfo) -> Dialer:
        return _UcxDialer(self, peer)

    def answer(self, peer: PeerInfo, request: JSONDict) -> Answer:
        return _UcxAnswer()

    def stats(self) -> JSONDict:
        return {"ucx": ".".join(map(str, _ucp.ucx_version())), "batch": _ucp.batch_impl()}

    def _progress_loop(self) -> None:
        """Serve target-side progress (needed by TCP lanes) while sleeping on the worker's event fd."""
        fd = self.worker.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not self._closing.is_set():
            try:
                with self.lock:
                    while self.worker.progress():
                        pass
                    armed = self.worker.arm()
                if armed:
                    poller.poll(200)
            except _ucp.UcpError as exc:
                if not self._closing.is_set():
                    log.warning("ucx progress thread stopped: %s", exc)
                return

    def close(self) -> None:
        self._closing.set()
        try:
            self.worker.signal()
        except _ucp.UcpError:
            pass
        self._progress.join(2.0)
        with self.lock:
            try:
                self.ctx.close(timeout_s=2.0)  # closes endpoints, rkeys, registrations, worker
            except _ucp.UcpError as exc:
                log.warning("ucx close: %s", exc)


def _uniform(layout: KVLayout) -> bool:
    """All layers have the same planes relative to their first plane (true for vLLM caches)."""
    def shape(layer: LayerRegion) -> list[tuple[int, int, int]]:
        b0 = layer.planes[0].base
        return [(p.base - b0, p.block_stride, p.piece_bytes) for p in layer.planes]

    first = shape(layout.layers[0])
    return all(shape(layer) == first for layer in layout.layers[1:])


def torch_device_index(device: str) -> int:
    import torch

    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


class _RemoteRegions:
    """The peer's registered extents, and which remote key covers an address."""

    def __init__(self, ep: _ucp.UcpEndpoint, regions: Any) -> None:
        try:
            rows = sorted((int(a), int(n), bytes.fromhex(str(k))) for a, n, k in regions)
        except (TypeError, ValueError):
            raise IncompatiblePeer("peer's ucx metadata has malformed regions") from None
        self.starts = [a for a, _, _ in rows]
        self.ends = [a + n for a, n, _ in rows]
        self.rkeys = [ep.unpack_rkey(k) for _, _, k in rows]

    def index(self, addr: int, nbytes: int) -> int:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr + nbytes > self.ends[i]:
            raise TransferError(f"remote range {addr:#x}+{nbytes} is outside the peer's registered memory")
        return i


def _segments(local: LayerRegion, remote: LayerRegion, runs: Sequence[BlockRun]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised (src, dst, len) arrays of every contiguous copy of a put (see layout.iter_segments)."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    srcs, dsts, lens = [], [], []
    for lp, rp in zip(local.planes, remote.planes, strict=True):
        size = lp.piece_bytes
        if lp.block_stride == size and rp.block_stride == size:
            srcs.append(lp.base + r[:, 0] * size)
            dsts.append(rp.base + r[:, 1] * size)
            lens.append(r[:, 2] * size)
        else:
            counts = r[:, 2]
            offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            srcs.append(lp.base + (np.repeat(r[:, 0], counts) + offs) * lp.block_stride)
            dsts.append(rp.base + (np.repeat(r[:, 1], counts) + offs) * rp.block_stride)
            lens.append(np.full(len(offs), size, dtype=np.int64))
    return (np.concatenate(srcs).astype(np.uint64), np.concatenate(dsts).astype(np.uint64),
            np.concatenate(lens).astype(np.uint64))


class _UcxOutLink(OutboundLink):
    def __init__(self, tr: UcxTransport, peer: PeerInfo) -> None:
        self.tr = tr
        self.remote_layout = peer.layout
        info = peer.transport
        if info.get("memory") not in ("host", "cuda") or not isinstance(info.get("worker"), str):
            raise IncompatiblePeer("peer's ucx metadata is incomplete")
        with tr.lock:
            try:
                self.ep = tr.worker.create_endpoint(bytes.fromhex(info["worker"]))
                self.remote = _RemoteRegions(self.ep, info.get("regions", []))
                lanes = self.ep.transport_list()
            except _ucp.UcpError as exc:
                raise PeerDisconnected(f"ucx could not reach the peer: {exc}") from None
        names = sorted({tl for tl, _ in lanes})
        self.lanes = ",".join(names) or "unknown"
        self.ipc: Any = None
        self.copier: Any = None
        if tr.cuda and info.get("memory") == "cuda" and info.get("host") == host_id() and info.get("ipc"):
            try:
                from .cudaipc import PeerMapping

                self.copier = tr.copier()
                self.ipc = PeerMapping(info["ipc"], same_process=info.get("pid") == os.getpid())
                names = ["cuda-ipc kernel"]
            except Exception as exc:  # CuPy missing, IPC refused: fall back to UCX puts, and say so
                self.copier = None
                log.warning("ucx: CUDA IPC kernel path unavailable (%s); using UCX puts (%s)", exc, self.lanes)
        if self.ipc is not None:
            self.lanes = "cuda-ipc kernel"
            self.uniform = _uniform(tr.layout) and _uniform(peer.layout)
            self._plan_runs: Any = None  # the runs the cached plan belongs to (held: identity stays valid)
            self._plan: Any = None
        self.slow = all(tl in SLOW_LANES for tl in names) and bool(names)
        if self.slow:
            log.warning("ucx: the peer is reached over %s only (the slow path): check UCX_TLS, NET_IFNAME and, "
                        "between hosts, whether a verbs-enabled UCX is installed (KVTRANSPORT_UCX_LIBDIR)", self.lanes)
        else:
            log.info("ucx: lanes to peer: %s", self.lanes)

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        if self.ipc is not None:
            self._put_ipc(layer, runs)
            return
        src, dst, lens = _segments(self.tr.layout.layers[layer], self.remote_layout.layers[layer], runs)
        first = self.remote.index(int(dst.min()), 0)
        last = self.remote.index(int(dst.max()), 0)
        with self.tr.lock:
            try:
                if first == last:  # the usual case: one backing buffer, one remote key
                    self.remote.index(int((dst + lens).max()) - 1, 1)
                    self.ep.put_batch(src, dst, lens, self.remote.rkeys[first])
                else:
                    which = np.array([self.remote.index(int(d), int(n)) for d, n in zip(dst, lens, strict=True)])
                    for i in np.unique(which):
                        m = which == i
                        self.ep.put_batch(src[m], dst[m], lens[m], self.remote.rkeys[int(i)])
            except _ucp.UcpError as exc:
                raise PeerDisconnected(f"ucx put failed: {exc}") from None

    def _put_ipc(self, layer: int, runs: Sequence[BlockRun]) -> None:
        """One kernel launch per put. Layers with one geometry share a device-side table of offsets,
        built once per request (the manager hands every layer the same runs object)."""
        local, remote = self.tr.layout.layers[layer], self.remote_layout.layers[layer]
        if not self.uniform:
            src, dst, lens = _segments(local, remote, runs)
            table, n = self.copier.upload(src, self.ipc.translate(dst, lens), lens)
            self.copier.launch(table, n)
            return
        if runs is not self._plan_runs:
            l0, r0 = self.tr.layout.layers[0], self.remote_layout.layers[0]
            src, dst, lens = _segments(l0, r0, runs)
            src_rel = src - np.uint64(l0.planes[0].base)
            dst_rel = dst - np.uint64(r0.planes[0].base)
            span = int((dst_rel + lens).max())
            self._plan = (*self.copier.upload(src_rel, dst_rel, lens), span)
            self._plan_runs = runs
        table, n, span = self._plan
        dst_base = self.ipc.translate_range(remote.planes[0].base, span)
        self.copier.launch(table, n, local.planes[0].base, dst_base)

    def flush(self, timeout: float) -> None:
        if self.ipc is not None:
            self.copier.flush(timeout)
            return
        with self.tr.lock:
            try:
                self.ep.flush(timeout)
            except TimeoutError:
                raise TransferTimeout(f"ucx flush did not complete within {timeout:.3g}s (peer stalled?)") from None
            except _ucp.UcpError as exc:
                raise PeerDisconnected(f"ucx flush failed: {exc}") from None

    def describe(self) -> str:
        return f"ucx {self.lanes}" + (" (slow path)" if self.slow else "")

    def close(self) -> None:
        if self.ipc is not None:
            try:
                self.copier.flush(1.0)
            except Exception:
                pass
            self.ipc.close()
            self.ipc = None
        with self.tr.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a peer that already left resets the endpoint: expected here
            try:
                self.ep.close(timeout_s=1.0)
            except _ucp.UcpError:
                pass


class _UcxDialer(Dialer):
    def __init__(self, tr: UcxTransport, peer: PeerInfo) -> None:
        self.tr, self.peer = tr, peer
        self.request: JSONDict = {}

    def complete(self, reply: JSONDict, timeout: float) -> OutboundLink:
        return _UcxOutLink(self.tr, self.peer)


class _UcxInLink(InboundLink):
    def close(self) -> None:
        pass


class _UcxAnswer(Answer):
    def __init__(self) -> None:
        self.reply: JSONDict = {}

    def complete(self, timeout: float) -> InboundLink:
        return _UcxInLink()
