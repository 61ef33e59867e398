"""The parking object: a cooperative GIL hand-off between a link's signaller thread and the threads that
call the sender API (:class:`Parking`).

The core creates one per outbound link of a one-sided backend (:mod:`kvtransport.sending`) and hands it to a
backend's :meth:`kvtransport.backend.FlushAndSend.flush_and_send`, which reads ``flag``/``since`` and calls
``park()`` around its GIL-free waits. Backends never create one. Standard library only (the backend
interface imports it).
"""

from __future__ import annotations

import ctypes
import threading
import time

YIELD_S = 0.002
"""Longest a sender API call lets a signaller thread that needs the interpreter run first (see Parking)."""
STARVED_NS = 200_000
"""A signaller kept from the interpreter this long by a busy caller thread gets it at the next API call."""
BUSY_GAP_NS = 200_000
"""A caller that spent this long outside the sender API since its last call is taken to be busy in Python."""


class Parking:
    """Cooperative GIL hand-off between a signaller thread and the threads that call the sender API.

    A thread that waits for the GIL while another runs Python waits up to the interpreter's switch interval
    (5 ms by default; it is process-global, so we leave it alone). The signaller mostly waits *without* the
    GIL — idle, or in a backend's wait written in C — and needs the interpreter only for short stretches
    between. ``flag`` is 1 while it is parked like that and 0 when it needs the interpreter, since ``since``
    (ns, ``time.monotonic_ns``): the signaller clears it when it is woken with work, and a backend's C wait
    just before it returns. A sender API call may then block (releasing the GIL) until the signaller parks
    again, at most YIELD_S (see ``after_call`` for when). Each such hand-off costs two thread wake-ups
    (~0.1 ms on a loaded 2-core VM), so a tight loop of puts and signals — which is not where the
    interpreter is held for long — does not yield at every call.

    What a backend may do with it (on the signaller thread, inside ``flush_and_send``): call :meth:`park`
    right before a wait that releases the GIL, and have that wait, when it ends, store
    ``time.monotonic_ns()`` into ``since`` and then 0 into ``flag`` (both are ctypes integers, so C code can
    write them through pointers without the GIL). Nothing else; none of this raises.
    """

    flag: ctypes.c_int32
    """1: the signaller is parked (waits without the GIL); 0: it needs the interpreter."""
    since: ctypes.c_int64
    """When ``flag`` last went to 0 (ns of ``time.monotonic_ns``, i.e. CLOCK_MONOTONIC)."""

    def __init__(self) -> None:
        self.flag = ctypes.c_int32(1)
        self.since = ctypes.c_int64(0)
        self._last_call = 0
        self._last_gap = 0
        self._parked = threading.Event()
        self._parked.set()
        self._lock = threading.Lock()

    def park(self) -> None:
        """Signaller: about to wait without the GIL (idle, or a wait in C that clears ``flag`` when it ends)."""
        with self._lock:
            self.flag.value = 1
            self._parked.set()

    def unpark(self) -> None:
        """The signaller needs the interpreter (it was woken with work, or returned from a wait)."""
        if self.flag.value:
            self.since.value = time.monotonic_ns()
            self.flag.value = 0

    def yield_to_signaller(self, starved_ns: int = 0) -> None:
        """Caller: if the signaller has needed the interpreter for ``starved_ns`` or more, let it run until
        it parks (bounded by YIELD_S)."""
        if self.flag.value or time.monotonic_ns() - self.since.value < starved_ns:
            return
        with self._lock:
            if self.flag.value:
                return
            self._parked.clear()
        self._parked.wait(YIELD_S)

    def after_call(self, *, end_of_burst: bool) -> None:
        """Caller, at the end of a sender API call: yield when it pays. A call that ends a burst (a
        request's ``signal``) is followed by other work, so a signaller that needs the interpreter gets it
        now; so it does when the caller spent BUSY_GAP_NS or more elsewhere before this call or the one
        before (it is busy in Python between a put/signal pair and the next); in a tight loop of calls only a
        signaller starved for STARVED_NS does."""
        now = time.monotonic_ns()
        gap, self._last_call = now - self._last_call, now
        busy = gap >= BUSY_GAP_NS or self._last_gap >= BUSY_GAP_NS  # a put and its signal come as a pair
        self._last_gap = gap
        if self.flag.value:
            return
        self.yield_to_signaller(0 if end_of_burst or busy else STARVED_NS)
