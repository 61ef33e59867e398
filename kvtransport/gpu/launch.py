"""One kernel launch per put: the copy kernel, its launcher (:class:`SegmentCopier`, an event ring and marks)
and the per-link putter that builds a request's segment table once (:class:`MappedPutter`)."""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..coalesce import BlockRun
from ..errors import TransferError, TransferTimeout
from ..layout import KVLayout
from . import driver as _driver
from .segments import PeerWindows, segments, split, uniform

log = logging.getLogger("kvtransport.cudacopy")

PLANS = 64
"""Requests whose device tables are kept (by runs identity)."""
SPIN_S = 50e-6
"""A flush polls its event without sleeping this long, then sleeps ``SLEEP_S`` between polls."""
SLEEP_S = 20e-6

KERNEL = r"""
// One CTA copies one segment: 16-byte loads and stores when everything is 16-byte aligned, bytes otherwise.
__device__ __forceinline__ void kvt_copy_segment(const unsigned long long* __restrict__ segs, int i,
                                                 unsigned long long src_base, unsigned long long dst_base) {
    const unsigned long long src = src_base + segs[3 * i], dst = dst_base + segs[3 * i + 1], len = segs[3 * i + 2];
    if (((src | dst | len) & 15ull) == 0) {
        const int4* s = reinterpret_cast<const int4*>(src);
        int4* d = reinterpret_cast<int4*>(dst);
        const unsigned long long n16 = len >> 4;
        for (unsigned long long k = threadIdx.x; k < n16; k += blockDim.x) d[k] = s[k];
    } else {
        const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
        unsigned char* d = reinterpret_cast<unsigned char*>(dst);
        for (unsigned long long k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
    }
    __threadfence_system();
}

extern "C" __global__ void kvt_segment_copy(const unsigned long long* __restrict__ segs, int n,
                                            unsigned long long src_base, unsigned long long dst_base) {
    const int i = blockIdx.x;
    if (i < n) kvt_copy_segment(segs, i, src_base, dst_base);
}

// Every layer of a request in one launch: blockIdx.y picks the layer, whose (source, destination) base
// addresses are bases[2 * y], bases[2 * y + 1]; the segment table is the one kvt_segment_copy uses.
extern "C" __global__ void kvt_segment_copy_layers(const unsigned long long* __restrict__ segs, int n,
                                                   const unsigned long long* __restrict__ bases) {
    const int i = blockIdx.x;
    if (i < n) kvt_copy_segment(segs, i, bases[2 * blockIdx.y], bases[2 * blockIdx.y + 1]);
}

// A doorbell (kvtransport.doorbell): after every copy before it on the stream, store ``value`` into a
// completion word in host memory the receiver reads.
extern "C" __global__ void kvt_doorbell(unsigned long long* word, unsigned long long value) {
    __threadfence_system();
    *reinterpret_cast<volatile unsigned long long*>(word) = value;
    __threadfence_system();
}
"""
MAX_GRID_Y = 65535
"""CUDA's limit on a grid's y dimension: the most layers one ``kvt_segment_copy_layers`` launch covers."""






class Mark:
    """Completion of everything a stream held when it was recorded (an event from the copier's ring, or
    its own event when ``slot`` is -1)."""

    __slots__ = ("copier", "event", "generation", "slot")

    def __init__(self, copier: SegmentCopier, event: Any, slot: int = -1, generation: int = 0) -> None:
        self.copier, self.event, self.slot, self.generation = copier, event, slot, generation

    @property
    def done(self) -> bool:
        """Non-blocking; raises TransferError on a CUDA error (e.g. a peer mapping gone bad)."""
        copier = self.copier
        if self.slot >= 0 and copier.generations[self.slot] != self.generation and copier.ring[self.slot] is self.event:
            return True  # the ring re-recorded this event, which it does only once this recording completed
        prev = self.copier.enter_context()  # the driver call needs it (flushes run on other threads)
        try:
            rc = self.copier.driver.query(self.event.ptr)
        finally:
            self.copier.leave_context(prev)
        if rc == _driver._Driver.NOT_READY:
            return False
        self.copier.driver.check(rc, "device copy")
        return True


class SegmentCopier:
    """Compiles the copy kernel once and launches it on torch's current stream of ``device_index``.

    Launches go straight to ``cuLaunchKernel``/``cuEventRecord`` (a few µs per put instead of the ~30 µs
    of CuPy's generic launch and a fresh event). Events come from a ring reused round-robin, but a slot is
    re-recorded only once its last recording completed (else the slot gets a fresh event and the old one
    stays with the marks that hold it); each re-recording bumps the slot's generation, so a mark from an
    earlier generation knows its launch completed. So a mark never reports another launch's completion —
    also when links or threads launch on different streams — and no wait chases a later launch."""

    EVENTS = 512

    def __init__(self, device_index: int) -> None:
        import cupy  # type: ignore[import-not-found]  # only on GPU hosts

        self.cupy = cupy
        self.device_index = device_index
        self.driver = _driver._Driver()
        with cupy.cuda.Device(device_index):
            self.kernel = cupy.RawKernel(KERNEL, "kvt_segment_copy")
            self.kernel.compile()
            self.layers_kernel = cupy.RawKernel(KERNEL, "kvt_segment_copy_layers")
            self.layers_kernel.compile()
            self._func = ctypes.c_void_p(int(self.kernel.kernel.ptr))
            self._layers_func = ctypes.c_void_p(int(self.layers_kernel.kernel.ptr))
            self.bell_kernel = cupy.RawKernel(KERNEL, "kvt_doorbell")
            self.bell_kernel.compile()
            self._bell_func = ctypes.c_void_p(int(self.bell_kernel.kernel.ptr))
            self.ring = [cupy.cuda.Event(disable_timing=True) for _ in range(self.EVENTS)]
            ctx = ctypes.c_void_p()
            self.driver.check(self.driver.ctx_get(ctypes.byref(ctx)), "cuCtxGetCurrent")
            self._ctx = ctx.value
        self._next_event = 0
        self.generations = [0] * self.EVENTS
        self.fresh_events = 0  # slots whose event was still pending when their turn came (see the class doc)
        self.fast = True
        self._launched = False
        self._launch_lock = threading.Lock()
        self._args = (ctypes.c_uint64(), ctypes.c_int32(), ctypes.c_uint64(), ctypes.c_uint64())
        self._params = (ctypes.c_void_p * 4)(*(ctypes.addressof(a) for a in self._args))
        self._layer_args = (ctypes.c_uint64(), ctypes.c_int32(), ctypes.c_uint64())
        self._layer_params = (ctypes.c_void_p * 3)(*(ctypes.addressof(a) for a in self._layer_args))
        self._bell_args = (ctypes.c_uint64(), ctypes.c_uint64())
        self._bell_params = (ctypes.c_void_p * 2)(*(ctypes.addressof(a) for a in self._bell_args))
        self._stream_events: dict[int, Any] = {}  # stream -> event of its last launch, since the last doorbell
        self._bell_done: Any = None  # recorded after each doorbell store ...
        self._bell_stream = 0  # ... on this stream
        self.inflight: collections.deque[tuple[Mark, Any]] = collections.deque()  # tables in use by kernels
        self._streams: dict[int, Any] = {}
        self._raw_stream: Any = None

    _KEEP = -1

    def enter_context(self) -> int | None:
        """Make the device's primary context current on this thread (driver calls need it); returns what
        to hand to :meth:`leave_context` so the caller's own current context (torch's device) is restored."""
        current = ctypes.c_void_p()
        self.driver.ctx_get(ctypes.byref(current))
        if current.value == self._ctx:
            return self._KEEP
        self.driver.check(self.driver.ctx_set(self._ctx), "cuCtxSetCurrent")
        return current.value

    def leave_context(self, previous: int | None) -> None:
        if previous != self._KEEP:
            self.driver.ctx_set(previous)

    def _stream_ptr(self) -> int:
        """torch's current stream of the device (its private raw getter when there: ~0.2 µs instead of the
        ~3 µs of building a ``torch.cuda.Stream``)."""
        raw = self._raw_stream
        if raw is None:
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw is None:
                def raw(index: int) -> int:
                    return int(torch.cuda.current_stream(index).cuda_stream)
            self._raw_stream = raw
        return int(raw(self.device_index))

    def _stream(self) -> Any:
        """CuPy's handle on torch's current stream (cached: creating one costs microseconds)."""
        ptr = self._stream_ptr()
        stream = self._streams.get(ptr)
        if stream is None:
            with self.cupy.cuda.Device(self.device_index):
                stream = self._streams[ptr] = self.cupy.cuda.ExternalStream(ptr)
        return stream

    def upload(self, src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> tuple[Any, int]:
        """Copy a segment table (offsets or addresses) to the device, on the caller's current stream."""
        src, dst, lens = split(src, dst, lens)
        table = np.stack([src, dst, lens], axis=1).astype(np.uint64).ravel()
        with self.cupy.cuda.Device(self.device_index), self._stream():
            return self.cupy.asarray(table), len(lens)

    # ------------------------------------------------------------------ doorbells (kvtransport.doorbell)
    def register_host(self, address: int, size: int) -> int:
        """Pin and map host memory ``[address, address + size)`` for the device; returns its device address.
        TransferError when the driver refuses (the caller then does without a doorbell)."""
        drv = self.driver
        prev = self.enter_context()
        try:
            drv.check(drv.host_register(address, size, 0x1 | 0x2), "cuMemHostRegister")  # PORTABLE | DEVICEMAP
            dev = ctypes.c_uint64()
            rc = drv.host_device_pointer(ctypes.byref(dev), address, 0)
            if rc != 0:
                drv.host_unregister(address)
                drv.check(rc, "cuMemHostGetDevicePointer")
            return int(dev.value)
        finally:
            self.leave_context(prev)

    def unregister_host(self, address: int) -> None:
        prev = self.enter_context()
        try:
            self.driver.host_unregister(address)
        finally:
            self.leave_context(prev)

    def write_word(self, device_address: int, value: int) -> None:
        """Enqueue, on torch's current stream, a store of ``value`` into the 8-byte word at
        ``device_address`` that runs after every copy launched so far (on any stream). Non-blocking."""
        drv = self.driver
        with self._launch_lock:
            stream = ctypes.c_void_p(self._stream_ptr())
            prev = self.enter_context()
            try:
                current = stream.value or 0
                for other, event in self._stream_events.items():
                    if other != current:  # copies launched on another stream come first too
                        drv.check(drv.stream_wait_event(stream, event.ptr, 0), "cuStreamWaitEvent")
                if self._bell_done is not None and self._bell_stream != current:
                    # and so does the previous store (on another stream): stores run in the order they were
                    # enqueued, so the word only grows, and copies an earlier store waited for stay covered
                    drv.check(drv.stream_wait_event(stream, self._bell_done.ptr, 0), "cuStreamWaitEvent")
                self._stream_events.clear()
                a_word, a_value = self._bell_args
                a_word.value, a_value.value = device_address, value
                drv.check(drv.launch(self._bell_func, 1, 1, 1, 1, 1, 1, 0, stream, self._bell_params, None),
                          "doorbell launch")
                if self._bell_done is None:
                    with self.cupy.cuda.Device(self.device_index):
                        self._bell_done = self.cupy.cuda.Event(disable_timing=True)
                drv.check(drv.record(self._bell_done.ptr, stream), "cuEventRecord")
                self._bell_stream = current
            finally:
                self.leave_context(prev)

    def bells_done(self, timeout: float) -> bool:
        """Whether every doorbell store enqueued so far has run (polls up to ``timeout``); unregistering a
        word a store is still headed for would fault the context."""
        if self._bell_done is None:
            return True
        try:
            self.wait(Mark(self, self._bell_done), timeout)
        except TransferError:  # not done in time, or the context reports an error: leave the page alone
            return False
        return True

    def upload_array(self, values: np.ndarray) -> Any:
        """A small uint64 array on the device (on the caller's current stream)."""
        with self.cupy.cuda.Device(self.device_index), self._stream():
            return self.cupy.asarray(np.ascontiguousarray(values, dtype=np.uint64))

    def launch(self, table: Any, n: int, src_base: int = 0, dst_base: int = 0) -> Mark:
        """One kernel: segment i copies ``len`` bytes from ``src_base + src_i`` to ``dst_base + dst_i``.

        Runs on torch's current stream (after the kernels that produced the KV). Non-blocking; returns
        the mark of this launch (pass it to :meth:`wait`)."""
        def fast() -> Mark:
            a_table, a_n, a_src, a_dst = self._args
            a_table.value, a_n.value, a_src.value, a_dst.value = int(table.data.ptr), n, src_base, dst_base
            return self._launch_fast(self._func, n, 1, self._params, table)

        return self._launch(fast, lambda: self._launch_cupy(table, n, src_base, dst_base))

    def launch_layers(self, table: Any, n: int, bases: Any, layers: int) -> Mark:
        """One kernel for ``layers`` layers: segment i of layer y copies ``len`` bytes from
        ``bases[2y] + src_i`` to ``bases[2y + 1] + dst_i`` (``bases``: a device array of uint64).

        Same stream and return as :meth:`launch`; ``layers`` ≤ MAX_GRID_Y."""
        if not 0 < layers <= MAX_GRID_Y:
            raise TransferError(f"one launch covers 1 to {MAX_GRID_Y} layers, not {layers}")

        def fast() -> Mark:
            a_table, a_n, a_bases = self._layer_args
            a_table.value, a_n.value, a_bases.value = int(table.data.ptr), n, int(bases.data.ptr)
            return self._launch_fast(self._layers_func, n, layers, self._layer_params, (table, bases))

        return self._launch(fast, lambda: self._launch_layers_cupy(table, n, bases, layers))

    def _launch(self, fast: Callable[[], Mark], slow: Callable[[], Mark]) -> Mark:
        """Launch directly (``fast``), or through CuPy (``slow``) once a first direct launch has failed."""
        with self._launch_lock:  # links of one transport share the argument buffers and the event ring
            if not self.fast:
                return slow()
            try:
                return fast()
            except TransferError as exc:
                if self._launched:
                    raise
                self.fast = False  # the first launch failed: use CuPy's launch from now on, and say so once
                log.warning("direct kernel launch failed (%s); using CuPy's launch (slower per put)", exc)
                return slow()

    def _launch_fast(self, func: Any, grid_x: int, grid_y: int, params: Any, keep: Any) -> Mark:
        drv = self.driver
        stream = ctypes.c_void_p(self._stream_ptr())
        prev = self.enter_context()
        try:
            drv.check(drv.launch(func, grid_x, grid_y, 1, 512, 1, 1, 0, stream, params, None), "copy kernel launch")
            slot = self._next_event
            self._next_event = (slot + 1) % self.EVENTS
            event = self.ring[slot]
            if drv.query(event.ptr) != 0:  # pending (or never recorded: a fresh event reports done, 0)
                with self.cupy.cuda.Device(self.device_index):
                    event = self.ring[slot] = self.cupy.cuda.Event(disable_timing=True)
                self.fresh_events += 1
            drv.check(drv.record(event.ptr, stream), "cuEventRecord")
            self.generations[slot] += 1
            self._stream_events[stream.value or 0] = event  # the object: keeps a replaced ring event alive
        finally:
            self.leave_context(prev)
        self._launched = True
        return self._track(Mark(self, event, slot, self.generations[slot]), keep)

    def _launch_cupy(self, table: Any, n: int, src_base: int, dst_base: int) -> Mark:
        cupy = self.cupy
        stream = self._stream()
        with cupy.cuda.Device(self.device_index), stream:
            self.kernel((n,), (512,), (table, np.int32(n), np.uint64(src_base), np.uint64(dst_base)))
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        return self._track(Mark(self, event), table)

    def _launch_layers_cupy(self, table: Any, n: int, bases: Any, layers: int) -> Mark:
        cupy = self.cupy
        stream = self._stream()
        with cupy.cuda.Device(self.device_index), stream:
            self.layers_kernel((n, layers), (512,), (table, np.int32(n), bases))
            event = cupy.cuda.Event(disable_timing=True)
            event.record(stream)
        return self._track(Mark(self, event), (table, bases))

    TRACK_CHECK = 8
    """Launches in flight before a launch looks for completed ones to let go (each look is a driver query)."""

    def _track(self, mark: Mark, keep: Any) -> Mark:
        """Keep ``keep`` (device tables) alive until the kernels using it are done."""
        inflight = self.inflight
        if len(inflight) >= self.TRACK_CHECK:
            while inflight and inflight[0][0].done:
                inflight.popleft()
        inflight.append((mark, keep))
        return mark

    def wait(self, mark: Mark | None, timeout: float) -> None:
        """Block until ``mark`` completed: spin briefly, then sleep between polls (the GIL is free during
        each poll). TransferTimeout past ``timeout``; TransferError on a CUDA error."""
        if mark is None:
            return
        start = time.monotonic()
        deadline = start + timeout
        while not mark.done:
            now = time.monotonic()
            if now > deadline:
                raise TransferTimeout(f"device copy did not finish within {timeout:.3g}s")
            if now - start < SPIN_S:
                os.sched_yield()  # frees the GIL without the ~55 µs timer slack of time.sleep(0)
            else:
                time.sleep(SLEEP_S)


class MappedPutter:
    """Puts of one outbound link into a peer whose KV memory is mapped here (one launch per put)."""

    def __init__(self, local: KVLayout, remote: KVLayout, windows: PeerWindows, copier: SegmentCopier) -> None:
        self.local, self.remote = local, remote
        self.windows = windows
        self.copier = copier
        self.uniform = uniform(local) and uniform(remote)
        self._plans: collections.OrderedDict[int, tuple[Sequence[BlockRun], tuple[Any, int, int]]] = collections.OrderedDict()
        self._lbases = [layer.planes[0].base for layer in local.layers]
        self._rbases = [layer.planes[0].base for layer in remote.layers]
        self._layer_bases: dict[tuple[int, ...], tuple[Any, int]] = {}
        self.last_event: Mark | None = None

    def _plan(self, runs: Sequence[BlockRun]) -> tuple[Any, int, int]:
        """The device table of ``runs`` relative to layer bases (cached by identity of the runs object)."""
        key = id(runs)
        hit = self._plans.get(key)
        if hit is not None and hit[0] is runs:
            self._plans.move_to_end(key)
            return hit[1]
        l0, r0 = self.local.layers[0], self.remote.layers[0]
        src, dst, lens = segments(l0, r0, runs)
        src_rel = src - np.uint64(l0.planes[0].base)  # modulo 2**64: adding the base back is exact
        dst_rel = dst - np.uint64(r0.planes[0].base)
        span = int((dst_rel + lens).max())
        plan = (*self.copier.upload(src_rel, dst_rel, lens), span)
        self._plans[key] = (runs, plan)
        while len(self._plans) > PLANS:
            self._plans.popitem(last=False)
        return plan

    def put(self, layer: int, runs: Sequence[BlockRun]) -> None:
        """Launch the copy of ``runs`` of ``layer``. Non-blocking."""
        if self.uniform:
            table, n, span = self._plan(runs)
            try:
                dst_base = self.windows.translate_range(self._rbases[layer], span)
            except TransferError:  # the layer's span crosses peer allocations: translate segment by segment
                pass
            else:
                self.last_event = self.copier.launch(table, n, self._lbases[layer], dst_base)
                return
        src, dst, lens = segments(self.local.layers[layer], self.remote.layers[layer], runs)
        table, n = self.copier.upload(src, self.windows.translate(dst, lens), lens)
        self.last_event = self.copier.launch(table, n)

    def _bases(self, layers: tuple[int, ...]) -> tuple[Any, int]:
        """Device array of (local base, mapped peer base) per layer of ``layers``, and the bytes every layer's
        peer window holds past its base (a request whose span exceeds it cannot use one launch)."""
        hit = self._layer_bases.get(layers)
        if hit is not None:
            return hit
        pairs, room = [], None
        for layer in layers:
            local, left = self.windows.locate(self._rbases[layer])
            room = left if room is None else min(room, left)
            pairs += [self._lbases[layer], local]
        bases = self.copier.upload_array(np.array(pairs, dtype=np.uint64))
        self._layer_bases[layers] = hit = (bases, int(room or 0))
        if len(self._layer_bases) > PLANS:
            self._layer_bases.pop(next(iter(self._layer_bases)))
        return hit

    def put_layers(self, layers: Sequence[int], runs: Sequence[BlockRun]) -> None:
        """Launch the copy of ``runs`` of every layer in ``layers`` — one kernel when the layouts are uniform
        and each layer's span lies in one peer allocation, else one launch per layer. Non-blocking."""
        key = tuple(layers)
        if self.uniform and 0 < len(key) <= MAX_GRID_Y:
            table, n, span = self._plan(runs)
            try:
                bases, room = self._bases(key)
            except TransferError:
                room = -1  # a layer base outside the mapped windows: the per-layer path reports it
            if span <= room:
                self.last_event = self.copier.launch_layers(table, n, bases, len(key))
                return
        for layer in key:
            self.put(layer, runs)

    # a doorbell (kvtransport.doorbell): the manager finds these through the link's ``doorbell`` attribute
    def doorbell_map(self, address: int, size: int) -> int | None:
        """Map the host doorbell file for device stores; its device address, or None when not possible."""
        if not self.copier.fast:
            return None
        try:
            return self.copier.register_host(address, size)
        except TransferError as exc:
            log.info("no doorbell (signals go by the side channel only): %s", exc)
            return None

    def doorbell_write(self, device_address: int, value: int) -> None:
        """Store ``value`` at ``device_address`` once every put launched so far has landed. Non-blocking."""
        self.copier.write_word(device_address, value)

    def doorbell_unmap(self, address: int) -> None:
        """Undo :meth:`doorbell_map` once the stores headed there have run (else leave it mapped)."""
        try:
            if self.copier.bells_done(1.0):
                self.copier.unregister_host(address)
            else:
                log.warning("doorbell stores still pending at close: leaving the doorbell page pinned")
        except TransferError:
            pass

    def landed(self, mark: Mark | None) -> bool:
        """Whether the launch behind ``mark`` completed (False when unsure). Non-blocking."""
        try:
            return mark is None or mark.done
        except TransferError:  # let flush report it
            return False

    def flush(self, timeout: float) -> None:
        """Block until every launch so far completed (bounded by ``timeout``)."""
        self.copier.wait(self.last_event, timeout)

    def close(self) -> None:
        self._plans.clear()
