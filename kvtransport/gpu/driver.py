"""The CUDA driver calls of the device copy path, through ctypes (:class:`Driver`). ``_Driver`` is the name
the rest of :mod:`kvtransport.gpu` creates drivers through: tests substitute a fake driver there."""

from __future__ import annotations

import ctypes

from ..errors import TransferError


class Driver:
    """The CUDA driver calls of the launch path, through ctypes (each call releases the GIL, ~1 µs).
    Backends subclass it to bind further calls from ``lib`` (e.g. CUDA IPC's)."""

    NOT_READY = 600

    def __init__(self) -> None:
        self.lib = lib = ctypes.CDLL("libcuda.so.1")  # subclasses bind further calls from it
        vp, ui = ctypes.c_void_p, ctypes.c_uint
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [vp, ui, ui, ui, ui, ui, ui, ui, vp, ctypes.POINTER(vp), vp]
        self.launch.restype = ctypes.c_int
        self.record = lib.cuEventRecord
        self.record.argtypes = [vp, vp]
        self.record.restype = ctypes.c_int
        self.query = lib.cuEventQuery
        self.query.argtypes = [vp]
        self.query.restype = ctypes.c_int
        self.query_addr = ctypes.cast(self.query, vp).value  # for waits written in C (the ucx helper)
        self.ctx_get = lib.cuCtxGetCurrent
        self.ctx_get.argtypes = [ctypes.POINTER(vp)]
        self.ctx_set = lib.cuCtxSetCurrent
        self.ctx_set.argtypes = [vp]
        self.address_range = lib.cuMemGetAddressRange_v2
        self.address_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self.address_range.restype = ctypes.c_int
        self.host_register = lib.cuMemHostRegister_v2
        self.host_register.argtypes = [vp, ctypes.c_size_t, ui]
        self.host_register.restype = ctypes.c_int
        self.host_unregister = lib.cuMemHostUnregister
        self.host_unregister.argtypes = [vp]
        self.host_unregister.restype = ctypes.c_int
        self.host_device_pointer = lib.cuMemHostGetDevicePointer_v2
        self.host_device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), vp, ui]
        self.host_device_pointer.restype = ctypes.c_int
        self.stream_wait_event = lib.cuStreamWaitEvent
        self.stream_wait_event.argtypes = [vp, vp, ui]
        self.stream_wait_event.restype = ctypes.c_int
        self._error_string = lib.cuGetErrorString
        self._error_string.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = ctypes.c_char_p()
            self._error_string(rc, ctypes.byref(msg))
            raise TransferError(f"{what} failed: CUDA error {rc} ({(msg.value or b'?').decode()})")


_Driver = Driver
"""The name this module creates its drivers through (tests substitute a fake driver here)."""
