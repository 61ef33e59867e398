"""Thin ctypes binding for UCX/UCP one-sided RMA (put, flush, atomic add).

The binding calls the C API of the ``libucp`` that PyPI's UCX wheels ship
(``pip install ucxx-cu12``, or just ``libucx-cu12``).  ucxx's Python API has no
memory registration / rkeys / put / flush, hence this module.

Object model (all handles are owned; closing a parent closes its children)::

    UcpContext ──> UcpWorker ──> UcpEndpoint ──> UcpRkey
        └──> UcpMemory (registered local memory; pack_rkey() for the peer)

Threading: nothing here is thread-safe.  Workers are created in
``UCS_THREAD_MODE_SINGLE`` unless ``multi_thread=True``; one thread should own
a worker and everything created from it.

Processes: never ``fork()`` after a :class:`UcpContext` exists (use the
multiprocessing ``spawn`` context).  Handles used from another process id raise
:class:`UcpError`.

Struct layouts are written by hand for the UCX versions in
:data:`VERIFIED_VERSIONS`; loading any other major.minor raises
:class:`UcpUnavailableError` (override with ``KV_TRANSPORT_UCX_ALLOW_UNVERIFIED=1``
at your own risk).

Environment (kvtransport's scheme, ``KV_TRANSPORT_UCX_*``; the older ``KVTRANSPORT_UCX_*`` names still work
with a DeprecationWarning): ``KV_TRANSPORT_UCX_LIBDIR`` (a system UCX, e.g. one built with verbs),
``KV_TRANSPORT_UCX_ALLOW_UNVERIFIED`` (boolean), ``KV_TRANSPORT_UCX_CACHE`` (where the C helper is
compiled when the install-time build is missing), ``KV_TRANSPORT_UCX_NO_C_HELPER`` (boolean: issue puts from
Python).

Modules: this one holds the object model's context, memory and worker, and is the namespace the rest of the
backend uses (``from kvtransport_ucx import _ucp``, then ``_ucp.X``); it re-exports the public names of
``_ucp_abi`` (constants, struct layouts, errors, the function prototypes), ``_ucp_lib`` (loading libucp, the
version gate, ``ucx_version()``, the handle base class), ``_ucp_helper`` (the C helper: its install-time build,
else a compile-once fallback; ``batch_impl()``, the GIL-free waits) and ``_ucp_endpoint`` (endpoints, rkeys,
their requests). Module state (the loaded library, the helper) lives in the module that reads it: patch it there.
"""

from __future__ import annotations

import ctypes
import os
import select
import time
from collections.abc import Mapping
from typing import Literal

# Re-exported: every public name this module had before it was split (and `env_flag`, which tests use);
# the private helpers and the module state (the loaded library, the C helper) are read where they live.
from ._ucp_abi import STRUCTS as STRUCTS
from ._ucp_abi import UCP_ATOMIC_OP_ADD as UCP_ATOMIC_OP_ADD
from ._ucp_abi import UCP_DATATYPE_CONTIG as UCP_DATATYPE_CONTIG
from ._ucp_abi import UCP_DATATYPE_SHIFT as UCP_DATATYPE_SHIFT
from ._ucp_abi import UCP_EP_ATTR_FIELD_TRANSPORTS as UCP_EP_ATTR_FIELD_TRANSPORTS
from ._ucp_abi import UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE as UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
from ._ucp_abi import UCP_EP_PARAM_FIELD_REMOTE_ADDRESS as UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
from ._ucp_abi import UCP_ERR_HANDLING_MODE_NONE as UCP_ERR_HANDLING_MODE_NONE
from ._ucp_abi import UCP_ERR_HANDLING_MODE_PEER as UCP_ERR_HANDLING_MODE_PEER
from ._ucp_abi import UCP_FEATURE_AMO64 as UCP_FEATURE_AMO64
from ._ucp_abi import UCP_FEATURE_RMA as UCP_FEATURE_RMA
from ._ucp_abi import UCP_FEATURE_WAKEUP as UCP_FEATURE_WAKEUP
from ._ucp_abi import UCP_MEM_MAP_PARAM_FIELD_ADDRESS as UCP_MEM_MAP_PARAM_FIELD_ADDRESS
from ._ucp_abi import UCP_MEM_MAP_PARAM_FIELD_LENGTH as UCP_MEM_MAP_PARAM_FIELD_LENGTH
from ._ucp_abi import UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE as UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
from ._ucp_abi import UCP_OP_ATTR_FIELD_DATATYPE as UCP_OP_ATTR_FIELD_DATATYPE
from ._ucp_abi import UCP_OP_ATTR_FIELD_FLAGS as UCP_OP_ATTR_FIELD_FLAGS
from ._ucp_abi import UCP_PARAM_FIELD_FEATURES as UCP_PARAM_FIELD_FEATURES
from ._ucp_abi import UCP_PARAM_FIELD_NAME as UCP_PARAM_FIELD_NAME
from ._ucp_abi import UCP_WORKER_PARAM_FIELD_THREAD_MODE as UCP_WORKER_PARAM_FIELD_THREAD_MODE
from ._ucp_abi import UCS_ERR_BUSY as UCS_ERR_BUSY
from ._ucp_abi import UCS_ERR_LAST as UCS_ERR_LAST
from ._ucp_abi import UCS_INPROGRESS as UCS_INPROGRESS
from ._ucp_abi import UCS_MEMORY_TYPE_CUDA as UCS_MEMORY_TYPE_CUDA
from ._ucp_abi import UCS_MEMORY_TYPE_HOST as UCS_MEMORY_TYPE_HOST
from ._ucp_abi import UCS_OK as UCS_OK
from ._ucp_abi import UCS_THREAD_MODE_MULTI as UCS_THREAD_MODE_MULTI
from ._ucp_abi import UCS_THREAD_MODE_SINGLE as UCS_THREAD_MODE_SINGLE
from ._ucp_abi import UcpError as UcpError
from ._ucp_abi import UcpMemMapParams, UcpParams, UcpWorkerParams
from ._ucp_abi import UcpUnavailableError as UcpUnavailableError
from ._ucp_abi import c_status as c_status
from ._ucp_abi import c_u64 as c_u64
from ._ucp_abi import c_vp as c_vp
from ._ucp_endpoint import PreparedSegments as PreparedSegments
from ._ucp_endpoint import U64Array as U64Array
from ._ucp_endpoint import UcpEndpoint as UcpEndpoint
from ._ucp_endpoint import UcpRkey as UcpRkey
from ._ucp_helper import MBOX_CLOSED as MBOX_CLOSED
from ._ucp_helper import MBOX_FULL as MBOX_FULL
from ._ucp_helper import MBOX_OPEN as MBOX_OPEN
from ._ucp_helper import After as After
from ._ucp_helper import Mailbox as Mailbox
from ._ucp_helper import batch_impl as batch_impl
from ._ucp_helper import wait_helpers as wait_helpers
from ._ucp_helper import wait_query as wait_query
from ._ucp_lib import VERIFIED_VERSIONS as VERIFIED_VERSIONS
from ._ucp_lib import Handle, load_library
from ._ucp_lib import check_environment as check_environment
from ._ucp_lib import env_flag as env_flag
from ._ucp_lib import is_available as is_available
from ._ucp_lib import library_path as library_path
from ._ucp_lib import load_error as load_error
from ._ucp_lib import ucx_version as ucx_version

__all__ = [
    "VERIFIED_VERSIONS",
    "UcpError",
    "UcpUnavailableError",
    "UcpContext",
    "UcpWorker",
    "UcpMemory",
    "UcpEndpoint",
    "UcpRkey",
    "ucx_version",
    "is_available",
    "load_error",
    "library_path",
    "batch_impl",
]

# --------------------------------------------------------------------------- context
class UcpContext(Handle):
    """A UCP context with features RMA | AMO64 | WAKEUP.

    Blocking (``ucp_init``).  ``net_devices`` / ``tls`` set ``NET_DEVICES`` /
    ``TLS`` on this context's config (``ucp_config_modify``; ``os.environ`` is
    not touched, but ``UCX_*`` variables already in the environment are still
    read).  ``enable_cuda=False`` with ``tls=None`` excludes the CUDA
    transports (``TLS=^cuda``); ``config`` sets further options by name without
    the ``UCX_`` prefix.  Raises UcpUnavailableError / UcpError.
    """

    _what = "UcpContext"

    def __init__(
        self,
        *,
        net_devices: str | None = None,
        tls: str | None = None,
        enable_cuda: bool = False,
        config: Mapping[str, str] | None = None,
        name: str = "kvtransport",
    ) -> None:
        lib = load_library()
        super().__init__(lib, None)
        self._workers: list[UcpWorker] = []
        self._memories: list[UcpMemory] = []
        self.enable_cuda = enable_cuda
        opts: dict[str, str] = {}
        if net_devices is not None:
            opts["NET_DEVICES"] = net_devices
        if tls is not None:
            opts["TLS"] = tls
        elif not enable_cuda:
            opts["TLS"] = "^cuda"
        for k, v in (config or {}).items():
            opts[k[4:] if k.startswith("UCX_") else k] = v
        cfg = c_vp()
        lib.check(lib.config_read(None, None, ctypes.byref(cfg)), "ucp_config_read")
        try:
            for k, v in opts.items():
                lib.check(lib.config_modify(cfg, k.encode(), v.encode()), f"ucp_config_modify({k}={v!r})")
            params = UcpParams()
            params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME
            params.features = UCP_FEATURE_RMA | UCP_FEATURE_AMO64 | UCP_FEATURE_WAKEUP
            self._name = name.encode()
            params.name = self._name
            h = c_vp()
            major, minor, _ = lib.version
            lib.check(lib.init_version(major, minor, ctypes.byref(params), cfg, ctypes.byref(h)), "ucp_init")
        finally:
            lib.config_release(cfg)
        self._h = h.value
        self.options: dict[str, str] = opts

    def create_worker(self, *, multi_thread: bool = False) -> UcpWorker:
        """Create a worker (blocking).  Raises UcpError."""
        w = UcpWorker(self, multi_thread=multi_thread)
        self._workers.append(w)
        return w

    def mem_map(self, addr: int, length: int, *, memory_type: Literal["host", "cuda"] | None = None) -> UcpMemory:
        """Register ``[addr, addr+length)`` for remote access (blocking).

        The memory must stay allocated until :meth:`UcpMemory.unmap`.
        ``memory_type=None`` lets UCX detect it.  Raises UcpError/ValueError.
        """
        m = UcpMemory(self, addr, length, memory_type)
        self._memories.append(m)
        return m

    def close(self, timeout_s: float = 5.0) -> None:
        """Close workers (endpoints within ``timeout_s`` in total), unmap memory, ``ucp_cleanup``.

        Blocking; idempotent.
        """
        if self._h is None or os.getpid() != self._pid:
            self._h = None
            return
        deadline = time.monotonic() + timeout_s
        for w in list(self._workers):
            w.close(timeout_s=max(0.0, deadline - time.monotonic()))
        for m in list(self._memories):
            m.unmap()
        h, self._h = self._h, None
        self._lib.cleanup(h)


# --------------------------------------------------------------------------- memory
class UcpMemory(Handle):
    """Registered memory region (``ucp_mem_map``).  Not thread-safe."""

    _what = "UcpMemory"

    def __init__(self, ctx: UcpContext, addr: int, length: int, memory_type: str | None) -> None:
        lib = ctx._lib
        super().__init__(lib, None)
        if length <= 0:
            raise ValueError("length must be > 0")
        if addr <= 0:
            raise ValueError("addr must be a non-null address")
        self._ctx = ctx
        self.address = int(addr)
        self.length = int(length)
        p = UcpMemMapParams()
        p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH
        p.address = self.address
        p.length = self.length
        if memory_type is not None:
            p.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
            p.memory_type = {"host": UCS_MEMORY_TYPE_HOST, "cuda": UCS_MEMORY_TYPE_CUDA}[memory_type]
        h = c_vp()
        lib.check(lib.mem_map(ctx._handle(), ctypes.byref(p), ctypes.byref(h)), "ucp_mem_map")
        self._h = h.value

    def pack_rkey(self) -> bytes:
        """Serialize the remote key for this region (blocking, local).  Raises UcpError."""
        lib = self._lib
        buf, size = c_vp(), ctypes.c_size_t()
        lib.check(
            lib.rkey_pack(self._ctx._handle(), self._handle(), ctypes.byref(buf), ctypes.byref(size)), "ucp_rkey_pack"
        )
        try:
            return ctypes.string_at(buf.value, size.value)  # type: ignore[arg-type]
        finally:
            lib.rkey_buffer_release(buf)

    def unmap(self) -> None:
        """Deregister (blocking).  Idempotent.  Peers must not access it afterwards."""
        if self._h is None or os.getpid() != self._pid:
            self._h = None
            return
        h, self._h = self._h, None
        try:
            self._ctx._memories.remove(self)
        except ValueError:
            pass
        if self._ctx._h is not None:
            self._lib.check(self._lib.mem_unmap(self._ctx._h, h), "ucp_mem_unmap")

    close = unmap


# --------------------------------------------------------------------------- worker
class UcpWorker(Handle):
    """A UCP worker: progress engine, address, endpoints.  Not thread-safe."""

    _what = "UcpWorker"

    def __init__(self, ctx: UcpContext, *, multi_thread: bool = False) -> None:
        lib = ctx._lib
        super().__init__(lib, None)
        self._ctx = ctx
        self._endpoints: list[UcpEndpoint] = []
        self._efd: int | None = None
        self._address: bytes | None = None
        self._progress_fns: tuple[int | None, int | None] | None = None
        p = UcpWorkerParams()
        p.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE
        p.thread_mode = UCS_THREAD_MODE_MULTI if multi_thread else UCS_THREAD_MODE_SINGLE
        h = c_vp()
        lib.check(lib.worker_create(ctx._handle(), ctypes.byref(p), ctypes.byref(h)), "ucp_worker_create")
        self._h = h.value

    @property
    def context(self) -> UcpContext:
        return self._ctx

    def address(self) -> bytes:
        """This worker's address blob, to give to peers (cached).  Raises UcpError."""
        if self._address is None:
            lib = self._lib
            h = self._handle()
            a, n = c_vp(), ctypes.c_size_t()
            lib.check(lib.worker_get_address(h, ctypes.byref(a), ctypes.byref(n)), "ucp_worker_get_address")
            try:
                self._address = ctypes.string_at(a.value, n.value)  # type: ignore[arg-type]
            finally:
                lib.worker_release_address(h, a)
        return self._address

    def progress(self) -> int:
        """Non-blocking: run one round of progress; returns the number of events processed."""
        return int(self._lib.worker_progress(self._handle()))

    def fileno(self) -> int:
        """The worker's event fd (``ucp_worker_get_efd``), for select/poll/asyncio.

        Arm with :meth:`arm` before sleeping on it.
        """
        if self._efd is None:
            fd = ctypes.c_int()
            self._lib.check(self._lib.worker_get_efd(self._handle(), ctypes.byref(fd)), "ucp_worker_get_efd")
            self._efd = fd.value
        return self._efd

    def arm(self) -> bool:
        """``ucp_worker_arm``: True if armed (safe to sleep on fileno()), False if events are pending."""
        st = self._lib.worker_arm(self._handle())
        if st == UCS_ERR_BUSY:
            return False
        self._lib.check(st, "ucp_worker_arm")
        return True

    def wait_for_events(self, timeout_s: float | None) -> bool:
        """Blocking up to ``timeout_s`` (None = forever) with no CPU use while idle.

        Progresses, arms the worker, and sleeps in ``poll()`` on its event fd.
        Returns True if there was activity (progress made or fd signalled),
        False on timeout.  Raises UcpError.
        """
        fd = self.fileno()
        made = 0
        for _ in range(1000):
            n = self.progress()
            if n == 0:
                break
            made += n
        if made:
            return True
        if not self.arm():
            self.progress()
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        ms = None if timeout_s is None else max(0, int(timeout_s * 1000))
        while True:
            try:
                ready = poller.poll(ms)
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries already
                continue
        if ready:
            self.progress()
            return True
        return False

    def progress_until(
        self, request: int, budget_s: float, *, idle_s: float | None = None, after: After | None = None
    ) -> tuple[bool, int]:
        """Progress until ``request`` (from e.g. :meth:`UcpEndpoint.flush_nb`) completes, or ``budget_s`` passed,
        or no round progressed anything for ``idle_s`` (default: the budget), or ``after.yield_flag`` was set.

        Returns (completed, events progressed); on completion performs ``after`` (see :class:`After`). The
        request stays the caller's (:meth:`request_free` it); raises UcpError if it failed. Runs in C without
        the GIL when the helper is available, so one call costs one GIL hand-off however many rounds it takes.
        """
        lib = self._lib
        idle = budget_s if idle_s is None else idle_s
        h = wait_helpers()
        if h is not None:
            if self._progress_fns is None:
                self._progress_fns = (
                    ctypes.cast(lib.worker_progress, c_vp).value,
                    ctypes.cast(lib.request_check_status, c_vp).value,
                )
            prog, check = self._progress_fns
            events = c_u64(0)
            st = int(h.progress_until(prog, check, self._handle(), request, max(0, int(budget_s * 1e9)),
                                      max(0, int(idle * 1e9)), ctypes.byref(events),
                                      ctypes.byref(after) if after is not None else None))
            made = events.value
        else:
            now = time.monotonic()
            end, idle_end = now + budget_s, now + idle
            made = 0
            while True:
                n = lib.worker_progress(self._handle())
                made += n
                st = lib.request_check_status(request)
                now = time.monotonic()
                if n:
                    idle_end = now + idle
                if st != UCS_INPROGRESS or now >= end or now >= idle_end:
                    break
                if after is not None and after.yield_flag and after.yield_flag[0]:
                    break
            if after is not None and after.parked:
                if after.since:
                    after.since[0] = time.monotonic_ns()
                after.parked[0] = 0
        if st == UCS_INPROGRESS:
            return False, made
        lib.check(st, "ucp request")
        return True, made

    def request_free(self, request: int) -> None:
        """``ucp_request_free``: release a request (an incomplete one completes in the background)."""
        self._lib.request_free(request)

    def signal(self) -> None:
        """Wake up a thread sleeping in :meth:`wait_for_events` (thread-safe per UCX)."""
        h = self._h
        if h is not None:
            self._lib.check(self._lib.worker_signal(h), "ucp_worker_signal")

    def mem_map(self, addr: int, length: int, *, memory_type: Literal["host", "cuda"] | None = None) -> UcpMemory:
        """Same as :meth:`UcpContext.mem_map` (registration is per context)."""
        return self._ctx.mem_map(addr, length, memory_type=memory_type)

    def create_endpoint(self, remote_worker_address: bytes, *, peer_error_handling: bool = False) -> UcpEndpoint:
        """Connect to a peer worker by its :meth:`address` blob (non-blocking wire-up).

        Keep ``peer_error_handling=False`` inside a host: the peer error mode
        restricts UCX to TCP (no shared memory / CMA).  Raises UcpError.
        """
        ep = UcpEndpoint(self, bytes(remote_worker_address), peer_error_handling)
        self._endpoints.append(ep)
        return ep

    def close(self, timeout_s: float = 5.0) -> None:
        """Close endpoints (flush mode; all within ``timeout_s`` together), destroy the worker.

        Blocking; idempotent.  Endpoints that do not close in time (e.g. TCP
        with a peer that is not progressing) give a RuntimeWarning and are
        reclaimed by ``ucp_worker_destroy``.
        """
        if self._h is None or os.getpid() != self._pid:
            self._h = None
            return
        deadline = time.monotonic() + timeout_s
        for ep in list(self._endpoints):
            ep.close(timeout_s=max(0.0, deadline - time.monotonic()))
        h, self._h = self._h, None
        try:
            self._ctx._workers.remove(self)
        except ValueError:
            pass
        self._lib.worker_destroy(h)
