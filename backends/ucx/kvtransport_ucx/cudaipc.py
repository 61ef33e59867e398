"""CUDA IPC fast path for CUDA peers on one host: one kernel launch copies every segment of a put.

UCX's cuda_ipc lane turns each segment into its own ``cudaMemcpyAsync``; a 2k-token request is 4,096 of
them, and per-copy overhead then dominates (a few GB/s on an NVLink that carries ~390). Here the receiver
exports a CUDA IPC handle per allocation of its KV cache (:func:`export_extents`), the sender maps them
once (:class:`PeerMapping`, ``cuIpcOpenMemHandle`` with lazy peer access) and puts through the shared
device copier of ``kvtransport.gpu`` (one launch per put on the caller's current stream, ordered
after the kernels that produced the KV).

What is UCX-specific stays here: the IPC handle exchange (MSCCL++ registers memory its own way) and
:func:`wait_in_c`, which waits for a launch in one GIL-free foreign call (the C helper) and then performs
the ``_ucp.After`` actions — the completion message goes out from the same call that saw the copy land.

Needs the CUDA driver (ctypes) and CuPy (to compile the kernel); without CuPy the backend falls back to
UCX puts and says so in the path it reports.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any

from kvtransport.errors import TransferError, TransferTimeout
from kvtransport.gpu import Driver, PeerWindows, SegmentCopier

from . import _ucp

SPIN_S = 50e-6
"""A flush polls the copy's event without sleeping this long (copies of a layer often end within it)."""
SLEEP_S = 20e-6
"""... and then sleeps this long between polls (plus the kernel's timer slack)."""
log = logging.getLogger("kvtransport.ucx")


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _IpcDriver(Driver):
    """The copy path's driver calls (address ranges, error wording) plus CUDA IPC's, through ctypes."""

    def __init__(self) -> None:
        super().__init__()
        u64 = ctypes.c_uint64
        self.get_handle = self.lib.cuIpcGetMemHandle
        self.get_handle.argtypes = [ctypes.POINTER(_IpcHandle), u64]
        self.open_handle = self.lib.cuIpcOpenMemHandle_v2
        self.open_handle.argtypes = [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint]
        self.close_handle = self.lib.cuIpcCloseMemHandle
        self.close_handle.argtypes = [u64]


_driver: _IpcDriver | None = None
_driver_lock = threading.Lock()


def driver() -> _IpcDriver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _IpcDriver()
        return _driver


def export_extents(extents: list[tuple[int, int]]) -> list[list[Any]]:
    """For each (addr, len) extent: [addr, len, allocation base, IPC handle hex]. Needs a current context;
    each extent must lie in one CUDA allocation (``kvtransport.gpu.allocation_extents`` cuts them so)."""
    drv = driver()
    out: list[list[Any]] = []
    for addr, length in extents:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        drv.check(drv.address_range(ctypes.byref(base), ctypes.byref(size), addr), "cuMemGetAddressRange")
        if addr + length > base.value + size.value:
            raise TransferError("a KV extent spans several CUDA allocations; CUDA IPC needs one allocation per extent")
        handle = _IpcHandle()
        drv.check(drv.get_handle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        out.append([addr, length, base.value, ctypes.string_at(ctypes.addressof(handle), 64).hex()])  # NULs kept
    return out


class PeerMapping(PeerWindows):
    """The peer's exported KV extents (see :func:`export_extents`) mapped into this process.

    Opens one IPC handle per extent (none when the peer is this process: its addresses are valid as they
    are), with ``copier``'s device context current when one is given (the dialling thread may have none).
    Raises TransferError on a malformed handle or a CUDA error, with nothing left open; ``close`` unmaps
    (only once no copy can still write there: the caller's business)."""

    def __init__(self, exported: list[list[Any]], same_process: bool, copier: SegmentCopier | None = None) -> None:
        drv = driver()
        self._copier = copier
        self._opened: list[int] = []
        rows = []
        prev = copier.enter_context() if copier is not None else None
        try:
            for addr, length, base, handle_hex in exported:
                addr, length, base = int(addr), int(length), int(base)
                if same_process:
                    mapped_base = base
                else:
                    raw = bytes.fromhex(str(handle_hex))
                    if len(raw) != 64:
                        raise TransferError("malformed CUDA IPC handle from peer")
                    handle = _IpcHandle()
                    ctypes.memmove(ctypes.addressof(handle), raw, 64)
                    ptr = ctypes.c_uint64()
                    drv.check(drv.open_handle(ctypes.byref(ptr), handle, 1), "cuIpcOpenMemHandle")  # lazy peer access
                    mapped_base = ptr.value
                    self._opened.append(mapped_base)
                rows.append((addr, length, mapped_base + (addr - base)))
        except BaseException:
            self._unmap(drv)
            raise
        finally:
            if copier is not None:
                copier.leave_context(prev)
        super().__init__(rows)

    def close(self) -> None:
        """Unmap the peer's memory (with the device context current; a failure is logged, not raised)."""
        copier = self._copier
        prev = copier.enter_context() if copier is not None else None
        try:
            self._unmap(driver())
        finally:
            if copier is not None:
                copier.leave_context(prev)

    def _unmap(self, drv: _IpcDriver) -> None:
        for ptr in self._opened:
            rc = drv.close_handle(ptr)
            if rc:
                log.warning("CUDA IPC: cuIpcCloseMemHandle(%#x) returned %s; the mapping stays", ptr, rc)
        self._opened = []


def wait_in_c(copier: SegmentCopier, mark: Any, timeout: float, after: _ucp.After | None = None) -> bool:
    """Block until the launch behind ``mark`` (a ``kvtransport.gpu.Mark``) completed, bounded by ``timeout``.

    With the C helper the whole wait is one GIL-free foreign call that polls ``cuEventQuery`` (spinning
    SPIN_S, then sleeping SLEEP_S between polls) and then performs ``after``; returns True. Without it
    (or after a driver result the C loop does not understand) the copier's own Python wait runs and
    ``after`` is not performed: returns False, and the caller does what ``after`` would have.
    TransferTimeout past ``timeout``; TransferError on a CUDA error."""
    if mark is None:
        return False
    fn = copier.driver.query_addr
    deadline = time.monotonic() + timeout
    if fn and _ucp.wait_helpers() is not None and not _c_wait_refused:
        prev = copier.enter_context()  # the driver call needs the device's context current on this thread
        try:
            rc = _ucp.wait_query(fn, int(mark.event.ptr), Driver.NOT_READY,
                                 spin_s=SPIN_S, sleep_s=SLEEP_S, timeout_s=timeout, after=after)
        finally:
            copier.leave_context(prev)
        if rc == 0:
            return True
        if rc == Driver.NOT_READY:
            raise TransferTimeout(f"CUDA IPC copy did not finish within {timeout:.3g}s")
        _refuse_c_wait(rc)
    copier.wait(mark, max(0.0, deadline - time.monotonic()))  # raises the typed error for a CUDA failure
    return False


_c_wait_refused = False


def _refuse_c_wait(rc: Any) -> None:
    """A driver result the C loop does not understand: from now on wait through the copier (which raises
    the typed error for a real CUDA failure). Said once."""
    global _c_wait_refused
    if not _c_wait_refused:
        _c_wait_refused = True
        log.warning("CUDA IPC: cuEventQuery returned %s; waiting through the copier from now on", rc)
