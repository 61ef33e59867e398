"""Endpoints of :mod:`kvtransport_ucx._ucp`: :class:`UcpEndpoint` (puts, batched puts, flush, atomic add,
transport queries), the remote keys it unpacks (:class:`UcpRkey`), waiting on its requests, and the uint64
segment tables that batched puts take (:class:`PreparedSegments`). Import these from ``_ucp``.
"""

from __future__ import annotations

import ctypes
import os
import time
import warnings
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Union

from ._ucp_abi import (
    UCP_ATOMIC_OP_ADD,
    UCP_EP_ATTR_FIELD_TRANSPORTS,
    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
    UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
    UCP_ERR_HANDLING_MODE_NONE,
    UCP_ERR_HANDLING_MODE_PEER,
    UCP_OP_ATTR_FIELD_DATATYPE,
    UCS_ERR_LAST,
    UCS_INPROGRESS,
    UcpEpAttr,
    UcpEpParams,
    UcpError,
    UcpLib,
    UcpRequestParam,
    UcpTransportEntry,
    c_vp,
    dt_make_contig,
)
from ._ucp_helper import load_helper, wait_helpers
from ._ucp_lib import Handle


class UcpWorker(Protocol):
    """What an endpoint uses of the worker that made it (:class:`._ucp.UcpWorker`, which imports this module:
    named here by its shape, so the two modules do not import each other)."""

    _lib: UcpLib
    _h: int | None
    _endpoints: list[UcpEndpoint]

    def _handle(self) -> int: ...

    def progress(self) -> int: ...

    def wait_for_events(self, timeout_s: float | None) -> bool: ...

# --------------------------------------------------------------------------- segment tables
#: array('Q'), numpy uint64 array, any 1-D uint64 buffer, or a sequence of ints.
U64Array = Union["array[int]", memoryview, Sequence[int], Any]


def _as_u64(values: U64Array, name: str) -> tuple[Any, int, int]:
    """Return (keepalive, address, count) for a contiguous native uint64 view of ``values``."""
    try:
        mv = memoryview(values)  # type: ignore[arg-type]
    except TypeError:
        arr = array("Q", values)
        return arr, arr.buffer_info()[0], len(arr)
    if mv.itemsize != 8 or mv.format.lstrip("@=<") not in ("Q", "L") or mv.ndim != 1:
        try:
            arr = array("Q", mv.tolist())
        except (TypeError, OverflowError) as e:
            raise TypeError(f"{name}: expected 1-D uint64 values, got format {mv.format!r}") from e
        return arr, arr.buffer_info()[0], len(arr)
    if not mv.c_contiguous or mv.readonly:
        arr = array("Q", mv.cast("B").cast("Q") if mv.c_contiguous else mv.tolist())
        return arr, arr.buffer_info()[0], len(arr)
    n = mv.shape[0] if mv.shape else 0
    if n == 0:
        return mv, 0, 0
    carr = (ctypes.c_uint64 * n).from_buffer(mv)
    return (mv, carr), ctypes.addressof(carr), n


class PreparedSegments:
    """Segments as (local offset, remote offset, length) uint64 tables, converted once, for repeated
    :meth:`UcpEndpoint.put_batch_rel` calls with different base addresses."""

    def __init__(self, local_offsets: U64Array, remote_offsets: U64Array, lengths: U64Array) -> None:
        self._keep_l, self.p_local, n = _as_u64(local_offsets, "local_offsets")
        self._keep_r, self.p_remote, nr = _as_u64(remote_offsets, "remote_offsets")
        self._keep_n, self.p_lens, nl = _as_u64(lengths, "lengths")
        if not n == nr == nl:
            raise ValueError(f"segment tables differ in length: {n}, {nr}, {nl}")
        self.n = n

    def absolute(self, local_base: int, remote_base: int) -> tuple[array[int], array[int], array[int]]:
        """The tables with the bases added (modulo 2**64)."""
        mask = (1 << 64) - 1
        def table(addr: int) -> list[int]:
            return list((ctypes.c_uint64 * self.n).from_address(addr)) if self.n else []

        loc, rem, lens = table(self.p_local), table(self.p_remote), table(self.p_lens)
        return (array("Q", [(local_base + x) & mask for x in loc]), array("Q", [(remote_base + x) & mask for x in rem]),
                array("Q", lens))



# --------------------------------------------------------------------------- endpoint
class UcpRkey(Handle):
    """An unpacked remote key, valid for the endpoint that unpacked it."""

    _what = "UcpRkey"

    def __init__(self, ep: UcpEndpoint, packed: bytes) -> None:
        lib = ep._lib
        super().__init__(lib, None)
        self._ep = ep
        buf = ctypes.create_string_buffer(packed, len(packed))
        h = c_vp()
        lib.check(lib.ep_rkey_unpack(ep._handle(), buf, ctypes.byref(h)), "ucp_ep_rkey_unpack")
        self._h = h.value

    def close(self) -> None:
        """``ucp_rkey_destroy``.  Idempotent."""
        if self._h is None or os.getpid() != self._pid:
            self._h = None
            return
        h, self._h = self._h, None
        try:
            self._ep._rkeys.remove(self)
        except ValueError:
            pass
        self._lib.rkey_destroy(h)

    destroy = close


def _wait_request(worker: UcpWorker, req: int | None, timeout_s: float, what: str) -> None:
    """Progress ``worker`` until ``req`` completes; free it.  TimeoutError/UcpError."""
    lib = worker._lib
    if req is None:
        return
    if req >= (1 << 64) + UCS_ERR_LAST:
        status = req - (1 << 64)
        raise UcpError(f"{what} failed: {lib.status_string(status)} ({status})", status)
    deadline = time.monotonic() + timeout_s
    spin_until = time.monotonic() + min(0.002, timeout_s)
    try:
        while True:
            worker.progress()
            st = lib.request_check_status(req)
            if st != UCS_INPROGRESS:
                lib.check(st, what)
                return
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"{what} did not complete within {timeout_s} s")
            if now >= spin_until:
                worker.wait_for_events(min(0.005, deadline - now))
    finally:
        lib.request_free(req)


class UcpEndpoint(Handle):
    """Endpoint to one peer worker.  All operations use the creating worker."""

    _what = "UcpEndpoint"

    def __init__(self, worker: UcpWorker, remote_address: bytes, peer_error_handling: bool) -> None:
        lib = worker._lib
        super().__init__(lib, None)
        self._worker = worker
        self._rkeys: list[UcpRkey] = []
        addr_buf = ctypes.create_string_buffer(remote_address, len(remote_address))
        p = UcpEpParams()
        p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        p.address = ctypes.addressof(addr_buf)
        p.err_mode = UCP_ERR_HANDLING_MODE_PEER if peer_error_handling else UCP_ERR_HANDLING_MODE_NONE
        h = c_vp()
        lib.check(lib.ep_create(worker._handle(), ctypes.byref(p), ctypes.byref(h)), "ucp_ep_create")
        self._h = h.value
        self._param0 = UcpRequestParam()  # op_attr_mask = 0: no callback, contig bytes
        self._param0_ref = ctypes.byref(self._param0)
        self._put_fn_addr = ctypes.cast(lib.put_nbx, c_vp).value
        self._free_fn_addr = ctypes.cast(lib.request_free, c_vp).value
        self._param0_addr = ctypes.addressof(self._param0)

    @property
    def worker(self) -> UcpWorker:
        return self._worker

    def unpack_rkey(self, packed: bytes) -> UcpRkey:
        """Unpack a peer's :meth:`UcpMemory.pack_rkey` blob (local, blocking).  Raises UcpError."""
        rk = UcpRkey(self, bytes(packed))
        self._rkeys.append(rk)
        return rk

    def _raise_ptr(self, req: int, what: str) -> None:
        status = req - (1 << 64)
        raise UcpError(f"{what} failed: {self._lib.status_string(status)} ({status})", status)

    def put(self, local_addr: int, length: int, remote_addr: int, rkey: UcpRkey) -> None:
        """Non-blocking put of ``length`` bytes from ``local_addr`` to ``remote_addr``.

        The local buffer must stay unchanged until :meth:`flush` returns
        (which also guarantees remote completion).  Raises UcpError.
        """
        req = self._lib.put_nbx(self._handle(), local_addr, length, remote_addr, rkey._handle(), self._param0_ref)
        if req:
            if req >= (1 << 64) + UCS_ERR_LAST:
                self._raise_ptr(req, "ucp_put_nbx")
            self._lib.request_free(req)

    def put_batch(self, local_addrs: U64Array, remote_addrs: U64Array, lengths: U64Array | int, rkey: UcpRkey) -> None:
        """Non-blocking: issue ``len(local_addrs)`` puts with one rkey.

        Arrays: ``array('Q')``, numpy ``uint64`` (C-contiguous: zero-copy),
        any uint64 buffer, or a sequence of ints; ``lengths`` may be one int.
        The loop runs in a small compiled helper (see :func:`batch_impl`).
        Same buffer rules as :meth:`put`.  Raises ValueError / UcpError (puts
        before the failing index were issued).
        """
        ep = self._handle()
        rk = rkey._handle()
        keep_l, p_local, n = _as_u64(local_addrs, "local_addrs")
        keep_r, p_remote, nr = _as_u64(remote_addrs, "remote_addrs")
        if nr != n:
            raise ValueError(f"local_addrs has {n} entries but remote_addrs has {nr}")
        scalar_len = 0
        p_lens: int | None = None
        keep_n: Any = None
        if isinstance(lengths, int):
            scalar_len = lengths
        else:
            keep_n, p_lens, nl = _as_u64(lengths, "lengths")
            if nl != n:
                raise ValueError(f"local_addrs has {n} entries but lengths has {nl}")
        if n == 0:
            return
        helper = load_helper()
        if helper is not None:
            err = ctypes.c_int64(0)
            done = helper(
                self._put_fn_addr,
                self._free_fn_addr,
                ep,
                rk,
                ctypes.addressof(self._param0),
                p_local,
                p_remote,
                p_lens,
                scalar_len,
                n,
                ctypes.byref(err),
            )
            del keep_l, keep_r, keep_n
            if done != n:
                raise UcpError(
                    f"ucp_put_nbx failed at batch index {done}: {self._lib.status_string(err.value)}", err.value
                )
            return
        loc = (ctypes.c_uint64 * n).from_address(p_local)
        rem = (ctypes.c_uint64 * n).from_address(p_remote)
        lens: Iterable[int] = (ctypes.c_uint64 * n).from_address(p_lens) if p_lens else [scalar_len] * n
        for la, ra, ln in zip(loc, rem, lens, strict=False):
            self.put(la, ln, ra, rkey)
        del keep_l, keep_r, keep_n

    def flush(self, timeout_s: float = 30.0) -> None:
        """Blocking: wait until every earlier put/atomic on this endpoint is remotely complete.

        Progresses the worker (spinning ~2 ms, then sleeping on its event fd).
        Raises TimeoutError after ``timeout_s`` (the flush request is released
        and completes in the background; call flush again later), UcpError on
        failure.
        """
        req = self._lib.ep_flush_nbx(self._handle(), self._param0_ref)
        _wait_request(self._worker, req, timeout_s, "ucp_ep_flush_nbx")

    def put_batch_rel(self, segs: PreparedSegments, local_base: int, remote_base: int, rkey: UcpRkey) -> None:
        """Non-blocking: put every segment of ``segs``, at ``local_base``/``remote_base`` plus its offsets.

        One foreign call (the C helper) however many segments; same buffer rules and errors as
        :meth:`put_batch` (puts before a failing one were issued).
        """
        if segs.n == 0:
            return
        h = wait_helpers()
        if h is None or load_helper() is None:
            loc, rem, lens = segs.absolute(local_base, remote_base)
            self.put_batch(loc, rem, lens, rkey)
            return
        err = ctypes.c_int64(0)
        mask = (1 << 64) - 1
        done = h.put_batch_rel(self._put_fn_addr, self._free_fn_addr, self._handle(), rkey._handle(),
                               self._param0_addr, segs.p_local, segs.p_remote, segs.p_lens,
                               local_base & mask, remote_base & mask, segs.n, ctypes.byref(err))
        if done != segs.n:
            raise UcpError(f"ucp_put_nbx failed at batch index {done}: {self._lib.status_string(err.value)}", err.value)

    def flush_nb(self) -> int | None:
        """Start a flush of every earlier put/atomic on this endpoint (non-blocking).

        Returns None when everything had already completed, else a request to drive with
        :meth:`UcpWorker.progress_until` and release with :meth:`UcpWorker.request_free`.  Raises UcpError.
        """
        req = self._lib.ep_flush_nbx(self._handle(), self._param0_ref)
        if req is not None and req >= (1 << 64) + UCS_ERR_LAST:
            self._raise_ptr(req, "ucp_ep_flush_nbx")
        return req  # type: ignore[no-any-return]

    def atomic_add64(self, remote_addr: int, rkey: UcpRkey, value: int, timeout_s: float = 30.0) -> None:
        """Post an atomic 64-bit add at ``remote_addr`` (8-byte aligned).

        Blocks only until local completion (the operand is copied); remote
        visibility is guaranteed after :meth:`flush`.  Raises UcpError /
        TimeoutError.
        """
        operand = ctypes.c_uint64(value & 0xFFFFFFFFFFFFFFFF)
        p = UcpRequestParam()
        p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE
        p.datatype = dt_make_contig(8)
        req = self._lib.atomic_op_nbx(
            self._handle(),
            UCP_ATOMIC_OP_ADD,
            ctypes.addressof(operand),
            1,
            remote_addr,
            rkey._handle(),
            ctypes.byref(p),
        )
        _wait_request(self._worker, req, timeout_s, "ucp_atomic_op_nbx")

    def transports(self) -> str:
        """Human-readable lane/transport description (``ucp_ep_print_info``).

        Look for ``cma``/``sysv``/``posix`` vs ``tcp`` in it.  Local, blocking.
        """
        lib = self._lib
        h = self._handle()
        buf, size = c_vp(), ctypes.c_size_t()
        stream = lib.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not stream:
            raise UcpError("open_memstream failed")
        try:
            lib.ep_print_info(h, stream)
        finally:
            lib.fclose(stream)
        try:
            return ctypes.string_at(buf.value, size.value).decode(errors="replace")  # type: ignore[arg-type]
        finally:
            lib.free(buf)

    def transport_list(self) -> list[tuple[str, str]]:
        """(transport, device) per lane via ``ucp_ep_query``, e.g. ``[("cma", "memory"), ...]``."""
        entries = (UcpTransportEntry * 32)()
        attr = UcpEpAttr()
        attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS
        attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(UcpTransportEntry))
        attr.transports.num_entries = len(entries)
        attr.transports.entry_size = ctypes.sizeof(UcpTransportEntry)
        self._lib.check(self._lib.ep_query(self._handle(), ctypes.byref(attr)), "ucp_ep_query")
        out = []
        for i in range(min(attr.transports.num_entries, len(entries))):
            e = entries[i]
            out.append(((e.transport_name or b"").decode(), (e.device_name or b"").decode()))
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Destroy rkeys and close the endpoint in flush mode (blocking, bounded).

        On timeout a RuntimeWarning is issued and the endpoint is left for
        ``ucp_worker_destroy`` to reclaim.  Idempotent; never raises UcpError.
        """
        if self._h is None or os.getpid() != self._pid:
            self._h = None
            return
        for rk in list(self._rkeys):
            rk.close()
        h, self._h = self._h, None
        try:
            self._worker._endpoints.remove(self)
        except ValueError:
            pass
        if self._worker._h is None:
            return
        req = self._lib.ep_close_nbx(h, self._param0_ref)
        try:
            _wait_request(self._worker, req, timeout_s, "ucp_ep_close_nbx")
        except (TimeoutError, UcpError) as e:
            warnings.warn(f"UcpEndpoint.close: {e}", RuntimeWarning, stacklevel=2)
