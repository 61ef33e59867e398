"""CUDA IPC fast path for CUDA peers on one host: one kernel launch copies every segment of a put.

UCX's cuda_ipc lane turns each segment into its own ``cudaMemcpyAsync``; a 2k-token request is 4,096 of
them, and per-copy overhead then dominates (a few GB/s on an NVLink that carries ~390). Here the sender
maps the receiver's KV memory once (``cuIpcOpenMemHandle`` with lazy peer access) and launches one kernel
per put on the caller's current stream — ordered after the kernels that produced the KV — where each
CTA copies one chunk of at most ``CHUNK`` bytes with 16-byte loads and stores (NVLink stores into the
peer GPU, or plain stores when both processes share one GPU). ``flush`` waits on an event recorded after
the last launch: it spins for ``SPIN_S`` and then sleeps ``SLEEP_S`` between polls, in one foreign call
that releases the GIL (the C helper), so a busy interpreter thread does not stretch the wait.

Needs the CUDA driver (ctypes) and CuPy (to compile and launch the kernel); without CuPy the backend
falls back to UCX puts and says so in the path it reports.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import logging
import threading
import time
from typing import Any

import numpy as np

from kvtransport.cudacopy import CHUNK as CHUNK  # re-exported: the copy kernel's piece size
from kvtransport.cudacopy import KERNEL as _KERNEL
from kvtransport.cudacopy import split as _split
from kvtransport.errors import TransferError, TransferTimeout

from . import _ucp

SPIN_S = 50e-6
"""A flush polls the copy's event without sleeping this long (copies of a layer often end within it)."""
SLEEP_S = 20e-6
"""... and then sleeps this long between polls (plus the kernel's timer slack)."""
CUDA_ERROR_NOT_READY = 600
log = logging.getLogger("kvtransport.ucx")



class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """The few CUDA driver calls we need, through ctypes (no CUDA headers or bindings required)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, sz = ctypes.c_uint64, ctypes.c_size_t
        self.get_range = lib.cuMemGetAddressRange_v2
        self.get_range.argtypes = [ctypes.POINTER(u64), ctypes.POINTER(sz), u64]
        self.get_handle = lib.cuIpcGetMemHandle
        self.get_handle.argtypes = [ctypes.POINTER(_IpcHandle), u64]
        self.open_handle = lib.cuIpcOpenMemHandle_v2
        self.open_handle.argtypes = [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint]
        self.close_handle = lib.cuIpcCloseMemHandle
        self.close_handle.argtypes = [u64]
        self.error_string = lib.cuGetErrorString
        self.error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.event_query = lib.cuEventQuery
        self.event_query.restype = ctypes.c_int
        self.event_query.argtypes = [ctypes.c_void_p]
        self.event_query_addr = ctypes.cast(self.event_query, ctypes.c_void_p).value

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self.error_string(rc, ctypes.byref(msg))
            raise TransferError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


_driver: _Driver | None = None
_driver_lock = threading.Lock()


def driver() -> _Driver:
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def export_extents(extents: list[tuple[int, int]]) -> list[list[Any]]:
    """For each (addr, len) extent: [addr, len, allocation base, IPC handle hex]. Needs a current context."""
    drv = driver()
    out: list[list[Any]] = []
    for addr, length in extents:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        drv.check(drv.get_range(ctypes.byref(base), ctypes.byref(size), addr), "cuMemGetAddressRange")
        if addr + length > base.value + size.value:
            raise TransferError("a KV extent spans several CUDA allocations; CUDA IPC needs one allocation per extent")
        handle = _IpcHandle()
        drv.check(drv.get_handle(ctypes.byref(handle), base.value), "cuIpcGetMemHandle")
        out.append([addr, length, base.value, ctypes.string_at(ctypes.addressof(handle), 64).hex()])  # NULs kept
    return out


class PeerMapping:
    """The peer's KV extents mapped into this process; translates peer addresses to local pointers."""

    def __init__(self, exported: list[list[Any]], same_process: bool) -> None:
        drv = driver()
        self._opened: list[int] = []
        rows = []
        try:
            for addr, length, base, handle_hex in exported:
                addr, length, base = int(addr), int(length), int(base)
                if same_process:
                    mapped_base = base  # our own memory: the addresses are valid as they are
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
                rows.append((addr, addr + length, mapped_base + (addr - base)))
        except BaseException:
            self.close()
            raise
        rows.sort()
        self._rows = rows
        self._row_starts = [r[0] for r in rows]
        self.starts = np.array([r[0] for r in rows], dtype=np.uint64)
        self.ends = np.array([r[1] for r in rows], dtype=np.uint64)
        self.local = np.array([r[2] for r in rows], dtype=np.uint64)

    def translate_range(self, remote: int, nbytes: int) -> int:
        """Local pointer for the peer range ``[remote, remote + nbytes)``, which must lie in one extent."""
        i = bisect.bisect_right(self._row_starts, remote) - 1  # plain ints: this runs once per put
        if i < 0 or remote + nbytes > self._rows[i][1]:
            raise TransferError("a put targets memory outside the peer's registered KV cache")
        start, _, local = self._rows[i]
        return local + (remote - start)

    def translate(self, remote: np.ndarray, lens: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.starts, remote, side="right") - 1
        if (idx < 0).any() or ((remote + lens) > self.ends[np.maximum(idx, 0)]).any():
            raise TransferError("a put targets memory outside the peer's registered KV cache")
        return self.local[idx] + (remote - self.starts[idx])

    def close(self) -> None:
        drv = driver()
        for ptr in self._opened:
            drv.close_handle(ptr)
        self._opened = []


class SegmentCopier:
    """Launches the segment-copy kernel on the torch current stream of ``device``; one event per launch."""

    def __init__(self, device_index: int) -> None:
        import cupy

        self.cupy = cupy
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self.kernel = cupy.RawKernel(_KERNEL, "kvt_segment_copy")
            self.kernel.compile()
        self.last_event: Any = None
        self._c_wait = True  # wait in C through the driver's cuEventQuery (see flush)
        self.inflight: collections.deque[tuple[Any, Any]] = collections.deque()  # tables used by launched kernels
        self._streams: dict[int, Any] = {}

    def _stream(self) -> Any:
        """CuPy's handle on torch's current stream (cached: creating one costs microseconds per put)."""
        import torch

        ptr = torch.cuda.current_stream(self.device_index).cuda_stream
        stream = self._streams.get(ptr)
        if stream is None:
            with self.cupy.cuda.Device(self.device_index):
                stream = self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr)
        return stream

    def upload(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> tuple[Any, int]:
        """Copy a segment table (offsets or addresses) to the device, on the caller's current stream."""
        src, dst, lens = _split(src, dst, lens)
        table = np.stack([src, dst, lens], axis=1).astype(np.uint64).ravel()
        with self.cupy.cuda.Device(self.device_index), self._stream():
            return self.cupy.asarray(table), len(lens)

    def launch(self, table: Any, n: int, src_base: int = 0, dst_base: int = 0) -> Any:
        """One kernel: segment i copies ``len`` bytes from ``src_base + src_i`` to ``dst_base + dst_i``.

        Runs on torch's current stream (after the kernels that produced the KV). Non-blocking; returns the
        event recorded after the kernel (pass it to :meth:`flush`)."""
        cupy = self.cupy
        stream = self._stream()
        with cupy.cuda.Device(self.device_index), stream:
            self.kernel((n,), (512,), (table, np.int32(n), np.uint64(src_base), np.uint64(dst_base)))
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        while self.inflight and self.inflight[0][0].done:
            self.inflight.popleft()
        self.inflight.append((event, table))
        self.last_event = event
        return event

    def flush(self, timeout: float, event: Any = None, after: Any = None) -> None:
        """Wait until ``event`` (default: the last launch's) completed; bounded by ``timeout``. ``after``
        (a ``_ucp.After``): what the wait does when it ends, in the same foreign call (see there)."""
        event = self.last_event if event is None else event
        if event is None:
            return
        drv = driver()
        deadline = time.monotonic() + timeout
        rc = None
        if drv.event_query_addr and self._c_wait:
            with self.cupy.cuda.Device(self.device_index):  # the driver call below needs the context current
                rc = _ucp.wait_query(drv.event_query_addr, int(event.ptr), CUDA_ERROR_NOT_READY,
                                     spin_s=SPIN_S, sleep_s=SLEEP_S, timeout_s=timeout, after=after)
            if rc not in (None, 0, CUDA_ERROR_NOT_READY):  # let CuPy's own query decide (it raises real errors)
                log.warning("CUDA IPC: cuEventQuery returned %d; waiting through CuPy from now on", rc)
                self._c_wait = False
                rc = None
        if rc is None:  # no C helper: the same loop in Python (each poll and sleep hands the GIL over)
            start = time.monotonic()
            while not event.done:
                now = time.monotonic()
                if now > deadline:
                    rc = CUDA_ERROR_NOT_READY
                    break
                time.sleep(0 if now - start < SPIN_S else SLEEP_S)
            else:
                rc = 0
        if rc == CUDA_ERROR_NOT_READY:
            raise TransferTimeout(f"CUDA IPC copy did not finish within {timeout:.3g}s")


