"""The ``ucx`` backend: one-sided zero-copy puts straight into the peer's KV blocks.

Each manager owns one UCP context and worker. Its KV memory is registered once (``ucp_mem_map`` per merged
extent of the layout) and the packed remote keys travel in ``cm.metadata()``. A sender creates an endpoint
from the receiver's worker address (no error-handling mode, so UCX may pick shared memory/CMA or
cuda_ipc inside a host instead of TCP; peer failure is detected by the core's side channel) and issues
all segments of a put with one C call (``put_batch_rel``: a request's segment table is built once and each
layer only adds its base addresses). ``flush`` waits for remote completion; the core then sends the
signal. A progress thread sleeping on the worker's event fd serves the paths that need the target to
progress (TCP between hosts); it costs no CPU while idle.

Completion path (see kvtransport.sending.Outbound): the link tells the core what has landed without
waiting (it declares ``CompletionMarks``: ``mark``/``landed``), so a signal whose puts landed leaves from
the caller's thread; small host puts land before ``put`` returns (INLINE_PUT_BYTES); ``flush_and_send``
(it declares ``FlushAndSend``) waits in C without the GIL — UCX progress for host memory (returning at
once when a put waits for the worker), the copy's CUDA event for the IPC path — and writes the signal
batch to the side channel from that same call.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import select
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

from kvtransport.backend import (
    Answer,
    Capabilities,
    CompletionMarks,
    Dialer,
    FlushAndSend,
    InboundLink,
    JSONDict,
    Mailbox,
    OutboundLink,
    PeerInfo,
    Transport,
)
from kvtransport.coalesce import BlockRun
from kvtransport.config import Settings, host_id, unknown_option
from kvtransport.errors import (
    BackendUnavailable,
    CommClosed,
    IncompatiblePeer,
    PeerDisconnected,
    TransferError,
    TransferTimeout,
)
from kvtransport.gpu import MappedPutter, allocation_extents, segments, uniform
from kvtransport.layout import KVLayout
from kvtransport.parking import Parking

from . import _ucp, cudaipc

log = logging.getLogger("kvtransport.ucx")
SLOW_LANES = ("tcp",)
PLANS = 16
"""Per link: how many distinct runs objects (requests in flight) keep their precomputed segment plan."""
FLUSH_SPIN_S = 2e-3
"""How long a flush keeps progressing without any event before it sleeps on the worker's event fd."""
INLINE_PUT_BYTES = 256 << 10
"""A host put this small, with nothing else in flight, lands before ``put`` returns: shared-memory and CMA
lanes copy inside worker progress, and handing that to the signaller thread (two thread wake-ups and a
lock hand-off, ~0.1-0.3 ms on a busy 2-core machine) costs more than the copy (~15 us for 64 KiB). Its
signal then leaves from the caller's thread at once. Larger puts stay asynchronous (overlap)."""
INLINE_BUDGET_S = 0.5e-3
"""... unless that copy takes longer than this (then the signaller's flush finishes it)."""


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, layout: KVLayout, settings: Settings, *, options: tuple[str, ...]) -> None:
        """``options``: the backend's own option names (its spec's ``options``), named when one is unknown."""
        opts = dict(settings.backend_options)
        tls = opts.pop("tls", None)
        if opts:
            raise unknown_option(sorted(opts)[0], options, "ucx backend")
        _ucp.check_environment()
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
        # A flush progresses the worker in C while holding the lock; a put that finds the lock taken raises
        # put_waiting (the C loop returns at once), and the flush lets it in before it continues.
        self.put_waiting = ctypes.c_int32(0)
        self._waiters = 0
        self._waiters_lock = threading.Lock()
        self.lock_wanted = threading.Event()
        self.lock_taken = threading.Event()
        try:
            self.ctx = _ucp.UcpContext(net_devices=settings.ifname, tls=tls, enable_cuda=self.cuda)
            self.worker = self.ctx.create_worker()
            mem_type: Literal["host", "cuda"] = "cuda" if self.cuda else "host"
            self.extents = layout.extents()
            if self.cuda:  # one registration per CUDA allocation (a merged extent may span several)
                self.extents = allocation_extents(self.extents)
            self.regions = [self.ctx.mem_map(addr, length, memory_type=mem_type) for addr, length in self.extents]
        except _ucp.UcpError as exc:
            raise BackendUnavailable(f"ucx backend could not initialise: {exc} (check UCX_TLS / NET_IFNAME)") from None
        self.ipc_exports: list[list[Any]] = []
        self.ipc_note = ""
        if self.cuda:
            try:
                self.ipc_exports = cudaipc.export_extents(self.extents)
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

    def acquire_for_put(self) -> None:
        """Take the worker lock, asking a flush that holds it to let us in."""
        if self.lock.acquire(blocking=False):
            return
        with self._waiters_lock:
            self._waiters += 1
            self.put_waiting.value = 1
        self.lock_wanted.set()
        self.lock.acquire()
        with self._waiters_lock:
            self._waiters -= 1
            self.put_waiting.value = int(self._waiters > 0)
        self.lock_taken.set()

    def yield_to_put(self) -> None:
        """Called by a flush between two progress calls, without the lock: let a waiting put in first."""
        if self.lock_wanted.is_set():
            self.lock_wanted.clear()
            self.lock_taken.wait(0.001)
            self.lock_taken.clear()

    def copier(self) -> Any:
        """The shared CUDA IPC segment copier (compiled on first use); raises if CuPy is missing."""
        with self.lock:
            if self._copier is None:
                from kvtransport.gpu import SegmentCopier

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


def torch_device_index(device: str) -> int:
    import torch

    dev = torch.device(device)
    return dev.index if dev.index is not None else torch.cuda.current_device()


MAX_WORKER_ADDRESS = 64 << 10
MAX_REGIONS = 4096
MAX_RKEY = 64 << 10
UCP_ADDRESS_VERSIONS = (0, 1)
"""ucp_object_version_t values a packed worker address may carry in its first byte's low nibble (V1, V2);
libucp aborts the process on any other (``ucs_assertv_always``), so they are refused before it sees one."""


def check_worker_address(blob: bytes) -> bytes:
    """A peer's packed UCX worker address, checked as far as it can be without libucp: a plausible size and a
    header version libucp handles. Raises IncompatiblePeer (nothing of it reached native code)."""
    if not 8 <= len(blob) <= MAX_WORKER_ADDRESS:
        raise IncompatiblePeer(f"peer's ucx worker address is {len(blob)} bytes (8..{MAX_WORKER_ADDRESS} expected)")
    if blob[0] & 0x0F not in UCP_ADDRESS_VERSIONS:
        raise IncompatiblePeer(f"peer's ucx worker address has format version {blob[0] & 0x0F}, which this UCX does "
                               "not read: another UCX release, or altered metadata (set KV_TRANSPORT_SECRET: "
                               "metadata is then sealed)")
    return blob


def _region_rows(regions: Any) -> list[tuple[int, int, bytes]]:
    """The peer's (address, length, packed rkey) rows, checked for types, counts and sizes."""
    if not isinstance(regions, list) or len(regions) > MAX_REGIONS:
        raise IncompatiblePeer(f"peer's ucx metadata has no list of at most {MAX_REGIONS} regions")
    rows = []
    for row in regions:
        if not (isinstance(row, list) and len(row) == 3 and all(type(v) is int for v in row[:2])
                and isinstance(row[2], str) and len(row[2]) <= 2 * MAX_RKEY):
            raise IncompatiblePeer("peer's ucx metadata has malformed regions")
        addr, length = row[0], row[1]
        if not (0 <= addr < 1 << 64 and 0 < length < 1 << 64 and addr + length <= 1 << 64):
            raise IncompatiblePeer("peer's ucx metadata has a region outside the address space")
        try:
            rkey = bytes.fromhex(row[2])
        except ValueError:
            raise IncompatiblePeer("peer's ucx metadata has malformed regions") from None
        if not rkey:
            raise IncompatiblePeer("peer's ucx metadata has an empty remote key")
        rows.append((addr, length, rkey))
    return sorted(rows)


class _RemoteRegions:
    """The peer's registered extents, and which remote key covers an address."""

    def __init__(self, ep: _ucp.UcpEndpoint, regions: Any) -> None:
        rows = _region_rows(regions)
        self.starts = [a for a, _, _ in rows]
        self.ends = [a + n for a, n, _ in rows]
        self.rkeys = [ep.unpack_rkey(k) for _, _, k in rows]

    def index(self, addr: int, nbytes: int) -> int:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i < 0 or addr + nbytes > self.ends[i]:
            raise TransferError(f"remote range {addr:#x}+{nbytes} is outside the peer's registered memory")
        return i


class _UcxOutLink(OutboundLink, CompletionMarks, FlushAndSend):
    def __init__(self, tr: UcxTransport, peer: PeerInfo) -> None:
        self.tr = tr
        self.remote_layout = peer.layout
        info = peer.transport
        if info.get("memory") not in ("host", "cuda") or not isinstance(info.get("worker"), str):
            raise IncompatiblePeer("peer's ucx metadata is incomplete")
        try:
            address = check_worker_address(bytes.fromhex(info["worker"]))
        except ValueError:
            raise IncompatiblePeer("peer's ucx worker address is not hex") from None
        _region_rows(info.get("regions", []))  # checked before the endpoint exists
        with tr.lock:
            try:
                self.ep = tr.worker.create_endpoint(address)
                self.remote = _RemoteRegions(self.ep, info.get("regions", []))
                lanes = self.ep.transport_list()
            except _ucp.UcpError as exc:
                raise PeerDisconnected(f"ucx could not reach the peer: {exc}") from None
        names = sorted({tl for tl, _ in lanes})
        self.lanes = ",".join(names) or "unknown"
        net_devices = sorted({dev for tl, dev in lanes if tl in SLOW_LANES})
        if names and all(tl in SLOW_LANES for tl in names):  # name the interface(s) TCP goes over
            self.lanes += " via " + ",".join(net_devices)
        self.ipc: Any = None  # CUDA IPC: the peer's mapped KV memory (a cudaipc.PeerMapping)
        self.ipc_putter: Any = None  # ... and the kvtransport.gpu.MappedPutter that launches this link's puts
        self._ipc_closed = False  # set by close(); the three above stay (a racing signal finds them)
        if tr.cuda and info.get("memory") == "cuda" and info.get("host") == host_id() and info.get("ipc"):
            try:
                copier = tr.copier()
                self.ipc = cudaipc.PeerMapping(info["ipc"], same_process=info.get("pid") == os.getpid(), copier=copier)
                self.ipc_putter = MappedPutter(tr.layout, peer.layout, self.ipc, copier)
                names = ["cuda-ipc kernel"]
            except Exception as exc:  # CuPy missing, IPC refused: fall back to UCX puts, and say so
                if self.ipc is not None:
                    self.ipc.close()
                self.ipc = self.ipc_putter = None
                log.warning("ucx: CUDA IPC kernel path unavailable (%s); using UCX puts (%s)", exc, self.lanes)
        if self.ipc is not None:
            self.lanes = "cuda-ipc kernel"
        self.doorbell = self.ipc_putter  # device-written completion words (kvtransport.doorbell)
        # Layers with one geometry (vLLM caches) share a segment plan per request: the manager hands every
        # layer of a request the same runs object, so the plan is derived once and each put only adds the
        # layer's base addresses.
        self.uniform = uniform(tr.layout) and uniform(peer.layout)
        self._plans: OrderedDict[int, tuple[Sequence[BlockRun], Any]] = OrderedDict()
        self._lbases = [layer.planes[0].base for layer in tr.layout.layers]
        self._rbases = [layer.planes[0].base for layer in peer.layout.layers]
        # completion bookkeeping for mark()/landed(): puts issued, and how many of them a flush saw land
        self._issued = 0
        self._landed = 0
        self.slow = all(tl in SLOW_LANES for tl in names) and bool(names)
        self.inline_puts = not self.slow and self.ipc is None  # see INLINE_PUT_BYTES
        if self.slow:
            log.warning("ucx: the peer is reached over %s only (the slow path): check UCX_TLS, NET_IFNAME and, "
                        "between hosts, whether a verbs-enabled UCX is installed (KV_TRANSPORT_UCX_LIBDIR)", self.lanes)
        else:
            log.info("ucx: lanes to peer: %s", self.lanes)

    def _plan(self, runs: Sequence[BlockRun], make: Any) -> Any:
        """The cached plan of ``runs`` (by identity; the runs object is held so its id stays valid)."""
        key = id(runs)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is runs:
            self._plans.move_to_end(key)
            return hit[1]
        plan = make(runs)
        self._plans[key] = (runs, plan)
        while len(self._plans) > PLANS:
            self._plans.popitem(last=False)
        return plan

    def _host_plan(self, runs: Sequence[BlockRun]) -> tuple[_ucp.PreparedSegments, int, int, int]:
        """Layer-relative segments of a put (ready for put_batch_rel), the relative span of its destination,
        and its size in bytes."""
        l0, r0 = self.tr.layout.layers[0], self.remote_layout.layers[0]
        src, dst, lens = segments(l0, r0, runs)
        src_rel = src - np.uint64(l0.planes[0].base)  # modulo 2**64: adding the base back is exact
        dst_rel = dst - np.uint64(r0.planes[0].base)
        signed = dst.astype(np.int64) - r0.planes[0].base
        lo = int(signed.min())
        hi = int((signed + lens.astype(np.int64)).max())
        return _ucp.PreparedSegments(src_rel, dst_rel, lens), lo, hi, int(lens.sum())

    def put_layers(self, layers: Sequence[int], runs: Sequence[BlockRun]) -> None:
        if self.ipc_putter is not None:
            if self._ipc_closed:
                raise CommClosed("ucx link closed: the peer's memory is no longer mapped")
            self.ipc_putter.put_layers(layers, runs)  # one kernel launch for every layer; non-blocking
            return
        super().put_layers(layers, runs)

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        if self.ipc_putter is not None:
            if self._ipc_closed:
                raise CommClosed("ucx link closed: the peer's memory is no longer mapped")
            self.ipc_putter.put(layer, runs)  # one kernel launch; non-blocking
            return
        if self.uniform:
            segs, lo, hi, nbytes = self._plan(runs, self._host_plan)
            rbase = self._rbases[layer]
            first = self.remote.index(rbase + lo, 0)
            if rbase + hi <= self.remote.ends[first]:  # the usual case: one backing buffer, one remote key
                self.tr.acquire_for_put()
                try:
                    idle = self._landed == self._issued
                    self._issued += 1  # before issuing: a put that fails half-way is still flushed
                    self.ep.put_batch_rel(segs, self._lbases[layer], rbase, self.remote.rkeys[first])
                    if idle and nbytes <= INLINE_PUT_BYTES and self.inline_puts:
                        self._land_inline()
                except _ucp.UcpError as exc:
                    raise PeerDisconnected(f"ucx put failed: {exc}") from None
                finally:
                    self.tr.lock.release()
                return
        src, dst, lens = segments(self.tr.layout.layers[layer], self.remote_layout.layers[layer], runs)
        first = self.remote.index(int(dst.min()), 0)
        last = self.remote.index(int(dst.max()), 0)
        self.tr.acquire_for_put()
        try:
            self._issued += 1
            if first == last:
                self.remote.index(int((dst + lens).max()) - 1, 1)
                self.ep.put_batch(src, dst, lens, self.remote.rkeys[first])
            else:
                which = np.array([self.remote.index(int(d), int(n)) for d, n in zip(dst, lens, strict=True)])
                for i in np.unique(which):
                    m = which == i
                    self.ep.put_batch(src[m], dst[m], lens[m], self.remote.rkeys[int(i)])
        except _ucp.UcpError as exc:
            raise PeerDisconnected(f"ucx put failed: {exc}") from None
        finally:
            self.tr.lock.release()

    def _land_inline(self) -> None:
        """Progress (in C, without the GIL; the worker lock held) until the put just issued landed, for at
        most INLINE_BUDGET_S. See INLINE_PUT_BYTES."""
        target = self._issued
        req = self.ep.flush_nb()
        if req is None:
            self._landed = target
            return
        try:
            done, _ = self.tr.worker.progress_until(req, INLINE_BUDGET_S)
            if done:
                self._landed = max(self._landed, target)
        finally:
            self.tr.worker.request_free(req)

    def mark(self) -> Any:
        """A token for everything issued so far (see :meth:`landed`). Non-blocking."""
        return self.ipc_putter.last_event if self.ipc_putter is not None else self._issued

    def landed(self, token: Any) -> bool:
        """Whether everything issued before ``token`` was taken has landed, as far as is known without
        progressing or waiting (False when unsure). Non-blocking."""
        if self.ipc_putter is not None:
            return bool(self.ipc_putter.landed(token))
        return bool(token <= self._landed)

    def flush(self, timeout: float) -> None:
        self.flush_and_send(timeout)

    def flush_and_send(
        self,
        timeout: float,
        fd: int = -1,
        data: bytes = b"",
        parking: Parking | None = None,
        on_wait: Callable[[Mailbox], None] | None = None,
    ) -> int:
        """Flush; then, in the same GIL-free call that saw the puts land, write ``data`` to the socket ``fd``.

        Returns how many bytes of ``data`` were written (the caller writes the rest: 0 when the flush had
        nothing to wait for, or without the C helper). ``parking`` (the core's, optional): its ``park()``
        is called before each wait without the GIL, and the wait sets its ``since`` (ns) and clears its
        ``flag`` when the thread needs the interpreter again (see kvtransport.parking.Parking).
        ``on_wait(mailbox)`` is called before such a wait starts: another thread may
        ``mailbox.append(bytes)`` to have them written right after ``data`` (the caller closes it after this
        returns; see ``_ucp.Mailbox``). Contract: kvtransport.backend.FlushAndSend."""
        flag = parking.flag if parking is not None else None
        since = parking.since if parking is not None else None
        after = _ucp.After.make(parked=flag, since=since, fd=fd, data=data)
        gil_free = _ucp.wait_helpers() is not None
        if self.ipc_putter is not None:
            event = self.ipc_putter.last_event
            if event is None:
                return 0
            if gil_free and on_wait is not None:
                box = _ucp.Mailbox(after)
                box.open()
                on_wait(box)
            if parking is not None:
                parking.park()
            return max(0, int(after.sent)) if cudaipc.wait_in_c(self.ipc_putter.copier, event, timeout, after) else 0
        tr = self.tr
        deadline = time.monotonic() + timeout
        with tr.lock:
            target = self._issued
            if target == self._landed:
                return 0
            try:
                req = self.ep.flush_nb()
            except _ucp.UcpError as exc:
                raise PeerDisconnected(f"ucx flush failed: {exc}") from None
        after.yield_flag = ctypes.pointer(tr.put_waiting)
        try:
            if req is not None:
                if gil_free and on_wait is not None:
                    box = _ucp.Mailbox(after)
                    box.open()
                    on_wait(box)
                self._wait(req, deadline, timeout, after, parking)
        finally:
            if req is not None:
                with tr.lock:
                    self.tr.worker.request_free(req)
        with tr.lock:
            self._landed = max(self._landed, target)
        return max(0, int(after.sent))

    def _wait(self, req: int, deadline: float, timeout: float, after: Any, parking: Parking | None) -> None:
        """Drive a flush request to completion: progress in C for as long as it moves data (returning at
        once when a put waits for the worker, which then goes first), then sleep on the worker's event fd
        while it waits for the peer (TCP lanes need the target to progress)."""
        tr = self.tr
        worker = tr.worker
        try:
            while True:
                now = time.monotonic()
                if parking is not None:
                    parking.park()
                with tr.lock:
                    done, made = worker.progress_until(req, max(0.0, deadline - now), idle_s=FLUSH_SPIN_S, after=after)
                if done:
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise TransferTimeout(f"ucx flush did not complete within {timeout:.3g}s (peer stalled?)")
                if not made:  # nothing moved for FLUSH_SPIN_S: waiting on the peer, sleep until the worker has events
                    with tr.lock:
                        armed = worker.arm()
                    if armed:
                        _sleep_on(worker.fileno(), min(0.005, deadline - now))
                tr.yield_to_put()
        except _ucp.UcpError as exc:
            raise PeerDisconnected(f"ucx flush failed: {exc}") from None

    def describe(self) -> str:
        return f"ucx {self.lanes}" + (" (slow path)" if self.slow else "")

    def close(self) -> None:
        if self.ipc_putter is not None and not self._ipc_closed:
            self._ipc_closed = True
            try:
                self.ipc_putter.flush(1.0)
            except Exception as exc:  # a copy may still write into the mapping: unmapping would fault it
                log.warning("ucx: CUDA IPC copies did not finish at close (%s); leaving the peer's memory mapped", exc)
            else:
                self.ipc.close()
            self.ipc_putter.close()
        self._plans.clear()
        with self.tr.lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a peer that already left resets the endpoint: expected here
            try:
                self.ep.close(timeout_s=1.0)
            except _ucp.UcpError:
                pass


def _sleep_on(fd: int, timeout: float) -> None:
    """Sleep until ``fd`` is readable or ``timeout`` passed (an armed worker's event fd)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(max(0, int(timeout * 1000)))


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
