"""Host copy ceilings: how fast this machine moves the same bytes by plain copies, to put a transfer's
figure next to. Shared by ``kvtransport demo`` and the bench's :class:`~kvtransport.bench.baselines.Ceiling`.

A ceiling is the *best* of several ways to copy, each timed by its best sample (other work on a shared
machine only slows a sample down): one ``memmove`` in one thread, the same bytes split over several threads
(``ctypes.memmove`` releases the GIL), and, where a second process holds the source, one
``process_vm_readv`` of it (the kernel's cross-process copy, what UCX's CMA lane does per piece).
Which one wins depends on the machine: on the 2-core development VM one thread beats two, and the kernel's
copy can beat or trail glibc's. No heavy imports; addresses are plain integers.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

MIN_THREADED_BYTES = 8 << 20
"""Below this a threaded copy measures thread start-up, not copying: only one thread is used."""


def copy_threads() -> int:
    """Threads for the multi-threaded copy: the CPUs this process may run on, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def memcpy_seconds(dst: int, src: int, nbytes: int, threads: int = 1) -> float:
    """Seconds of one copy of ``nbytes`` from address ``src`` to ``dst``, split into ``threads`` equal parts
    copied by as many threads at once. Blocking; the caller owns both buffers."""
    if threads <= 1 or nbytes < MIN_THREADED_BYTES:
        t0 = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        return time.perf_counter() - t0
    step = -(-nbytes // threads)
    parts = [(dst + i, src + i, min(step, nbytes - i)) for i in range(0, nbytes, step)]
    workers = [threading.Thread(target=ctypes.memmove, args=part, daemon=True) for part in parts]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def remote_read_seconds(pid: int, remote: int, dst: int, nbytes: int) -> float:
    """Seconds of one ``process_vm_readv`` of ``nbytes`` at address ``remote`` of process ``pid`` into local
    address ``dst`` (partial reads are continued). Raises OSError where the kernel refuses (no ptrace
    permission between the two processes, or not Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.process_vm_readv
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                   ctypes.c_ulong]
    done = 0
    t0 = time.perf_counter()
    while done < nbytes:
        local, far = _IoVec(dst + done, nbytes - done), _IoVec(remote + done, nbytes - done)
        got = fn(pid, ctypes.byref(local), 1, ctypes.byref(far), 1, 0)
        if got <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        done += got
    return time.perf_counter() - t0


class CopyCeiling:
    """Best-sample timings of each copy method for one size; :meth:`best` is the ceiling.

    Call :meth:`sample` as often as wanted (e.g. once after each timed transfer, so that both see the same
    load); ``remote`` is ``(pid, address)`` of a source buffer of ``nbytes`` in another process, or None."""

    def __init__(self, nbytes: int, dst: int, src: int, remote: tuple[int, int] | None = None) -> None:
        self.nbytes, self.dst, self.src, self.remote = nbytes, dst, src, remote
        self.threads = copy_threads()
        self.seconds: dict[str, float] = {}
        self.notes: list[str] = []

    def sample(self) -> None:
        """One timing of each method (blocking, a few copies of ``nbytes``)."""
        self._keep("memcpy 1 thread", memcpy_seconds(self.dst, self.src, self.nbytes))
        if self.threads > 1 and self.nbytes >= MIN_THREADED_BYTES:
            self._keep(f"memcpy {self.threads} threads", memcpy_seconds(self.dst, self.src, self.nbytes, self.threads))
        if self.remote is not None:
            try:
                self._keep("cross-process read", remote_read_seconds(*self.remote, self.dst, self.nbytes))
            except OSError as exc:
                self.notes.append(f"cross-process read unavailable: {exc.strerror or exc}")
                self.remote = None

    def _keep(self, method: str, seconds: float) -> None:
        if seconds > 0:
            self.seconds[method] = min(seconds, self.seconds.get(method, float("inf")))

    def gbps(self) -> dict[str, float]:
        """Method -> GB/s (decimal) of its best sample."""
        return {m: self.nbytes / s / 1e9 for m, s in self.seconds.items()}

    def best(self) -> tuple[str, float]:
        """(method, GB/s) of the fastest method. Raises ValueError before any sample."""
        if not self.seconds:
            raise ValueError("no copy was timed yet")
        method = min(self.seconds, key=lambda m: self.seconds[m])
        return method, self.nbytes / self.seconds[method] / 1e9
