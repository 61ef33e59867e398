"""The C helper of :mod:`kvtransport_ucx._ucp` (``_ucp_batch.c``): batched puts, and the wait loops that run
without the GIL (progress until a request completes, poll a CUDA event, then write a completion message).

The helper is plain C loaded with ctypes (no Python headers). The normal path is the install-time build:
``backends/ucx/setup.py`` compiles it as the optional extension ``kvtransport_ucx._ucp_batch_ext`` next to this
file when the package is installed. Only where that build is missing (a checkout whose extension was not built,
or an install-time build too old to have every entry point) is the source compiled once on first use, as a
fallback, into ``KV_TRANSPORT_UCX_CACHE`` (default ``~/.cache/kvtransport_ucx``) under a name keyed by the source's
hash (a C compiler is needed only for this). If neither works, or ``KV_TRANSPORT_UCX_NO_C_HELPER`` is set, puts
and waits loop in Python instead: :func:`batch_impl` says which (the ucx transport's ``stats()`` has it as ``batch``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Literal

from kvtransport.errors import ConfigurationError

from ._ucp_abi import c_u64, c_vp
from ._ucp_lib import env_flag, env_knob

_HELPER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ucp_batch.c")
_HELPER_SYMBOLS = ("kvt_put_batch", "kvt_put_batch_rel", "kvt_progress_until", "kvt_wait_query", "kvt_after_append",
                   "kvt_after_close")
_helper: Any = None
_helper_tried = False
_helper_lib: ctypes.CDLL | None = None
_helper_lib_tried = False
_helper_lib_lock = threading.Lock()


def _cache_dir() -> str:
    base = env_knob("CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvtransport_ucx"
    )
    return base


def _has_symbols(lib: ctypes.CDLL, names: Sequence[str]) -> bool:
    return all(hasattr(lib, n) for n in names)


def _helper_library() -> ctypes.CDLL | None:
    """The compiled helper, or None when there is none (then Python loops); loaded once per process.

    Normally the install-time build (``_ucp_batch_ext*.so``, from setup.py). Only when that is missing, or lacks
    an entry point, is the source compiled on first use, as a fallback, once per source hash into the cache."""
    global _helper_lib, _helper_lib_tried
    with _helper_lib_lock:
        if _helper_lib_tried:
            return _helper_lib
        _helper_lib_tried = True
        try:
            no_helper = env_flag("NO_C_HELPER")
        except ConfigurationError:  # refused at open() already (check_environment); not worth a failed put
            no_helper = False
        if no_helper:
            return None
        import glob

        prebuilt = None
        built = sorted(glob.glob(os.path.join(os.path.dirname(_HELPER_SRC), "_ucp_batch_ext*.so")))
        try:
            if built:  # the normal path: built at install time (setup.py); an older build may lack newer entry points
                prebuilt = ctypes.CDLL(built[0])
                if _has_symbols(prebuilt, _HELPER_SYMBOLS):
                    _helper_lib = prebuilt
                    return _helper_lib
            # fallback (a checkout whose extension was not built, or a stale build): compile once per source hash
            with open(_HELPER_SRC, "rb") as fh:
                src = fh.read()
            tag = hashlib.sha1(src + sys.platform.encode() + (sysconfig.get_config_var("MULTIARCH") or "").encode())
            out_dir = _cache_dir()
            so_path = os.path.join(out_dir, f"_ucp_batch-{tag.hexdigest()[:16]}.so")
            if not os.path.exists(so_path):
                cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
                if shutil.which(cc) is None:
                    cc = "cc"
                os.makedirs(out_dir, exist_ok=True)
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
                os.close(fd)
                try:
                    subprocess.run(
                        [cc, "-O2", "-shared", "-fPIC", "-o", tmp, _HELPER_SRC],
                        check=True,
                        capture_output=True,
                        timeout=60,
                    )
                    os.replace(tmp, so_path)  # atomic: concurrent builders are fine
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            _helper_lib = ctypes.CDLL(so_path)
        except (OSError, subprocess.SubprocessError) as e:
            _helper_lib = prebuilt  # an older install-time build still serves put_batch
            warnings.warn(
                f"kvtransport_ucx: C helper unavailable ({e}); "
                + ("waits" if prebuilt is not None else "put_batch and waits") + " fall back to Python loops",
                RuntimeWarning,
                stacklevel=3,
            )
        return _helper_lib


def load_helper() -> Any:
    """The C batch-put function (see _ucp_batch.c); None when it cannot be built."""
    global _helper, _helper_tried
    if _helper_tried:
        return _helper
    _helper_tried = True
    lib = _helper_library()
    try:
        _helper = _bind_helper(lib) if lib is not None else None
    except AttributeError:
        _helper = None
    return _helper


def _bind_helper(h: ctypes.CDLL) -> Any:
    """Declare the helper's signature (see _ucp_batch.c)."""
    f = h.kvt_put_batch
    f.restype = ctypes.c_int64
    f.argtypes = [
        c_vp,
        c_vp,
        c_vp,
        c_vp,
        c_vp,
        c_vp,
        c_vp,
        c_vp,
        c_u64,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_int64),
    ]
    return f


class After(ctypes.Structure):
    """What the helper's waits do when they end (see ``struct kvt_after`` in _ucp_batch.c).

    ``parked`` (optional): an int32 the helper sets to 0 just before it returns, i.e. when the calling thread
    is about to need the interpreter again, after storing the time of that in ``since`` (an int64, ns of
    CLOCK_MONOTONIC like ``time.monotonic_ns()``). ``yield_flag`` (optional): a progress loop returns early once it
    is nonzero. ``fd``/``buf``/``len``: on success, the helper writes the bytes to the socket ``fd`` before it
    returns (``sent``: bytes written, or -errno); then whatever another thread added through the
    :class:`Mailbox` while the wait was on."""

    _fields_ = [
        ("parked", ctypes.POINTER(ctypes.c_int32)),
        ("since", ctypes.POINTER(ctypes.c_int64)),
        ("yield_flag", ctypes.POINTER(ctypes.c_int32)),
        ("fd", ctypes.c_int32),
        ("buf", ctypes.c_char_p),
        ("len", c_u64),
        ("sent", ctypes.c_int64),
        ("mbox", ctypes.c_int32),
        ("extra", ctypes.c_char_p),
        ("extra_len", c_u64),
        ("extra_sent", ctypes.c_int64),
    ]

    @classmethod
    def make(
        cls, *, parked: Any = None, since: Any = None, yield_flag: Any = None, fd: int = -1, data: bytes = b""
    ) -> After:
        a = cls()
        if parked is not None:
            a.parked = ctypes.pointer(parked)
        if since is not None:
            a.since = ctypes.pointer(since)
        if yield_flag is not None:
            a.yield_flag = ctypes.pointer(yield_flag)
        a.fd = fd
        a.buf = data or None
        a.len = len(data)
        a.mbox = MBOX_CLOSED
        return a


MBOX_OPEN, MBOX_CLOSED, MBOX_FULL = 0, 1, 2


class Mailbox:
    """The one-slot mailbox of a wait in progress: another thread may have bytes written right after the
    wait's own (e.g. a signal queued behind the batch being flushed, with nothing issued in between).
    ``append`` and ``close`` must be serialised by the caller; ``close`` once the wait has returned."""

    def __init__(self, after: After) -> None:
        self._after = after
        self._extra: bytes | None = None

    def open(self) -> None:
        self._after.mbox = MBOX_OPEN

    def append(self, data: bytes) -> bool:
        """Have ``data`` written after the wait's bytes; False when the wait ended or the slot is taken."""
        h = wait_helpers()
        if h is None or self._extra is not None or not data:
            return False
        self._extra = data  # kept alive until close()
        if h.after_append(ctypes.byref(self._after), data, len(data)):
            return True
        self._extra = None
        return False

    def close(self) -> tuple[bytes | None, int]:
        """Close the slot; returns (the appended bytes or None, how many of them the wait wrote)."""
        h = wait_helpers()
        prev = int(h.after_close(ctypes.byref(self._after))) if h is not None else MBOX_CLOSED
        extra, self._extra = self._extra, None
        if extra is None or prev == MBOX_FULL:  # never appended, or the wait never got to it
            return extra, 0
        return extra, max(0, int(self._after.extra_sent))


class _WaitHelpers:
    """The helper's newer entry points: puts from offset tables, GIL-free loops (see _ucp_batch.c)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.put_batch_rel = lib.kvt_put_batch_rel
        self.put_batch_rel.restype = ctypes.c_int64
        self.put_batch_rel.argtypes = [c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_vp, c_u64, c_u64, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_int64)]
        self.progress_until = lib.kvt_progress_until
        self.progress_until.restype = ctypes.c_int64
        self.progress_until.argtypes = [c_vp, c_vp, c_vp, c_vp, c_u64, c_u64, ctypes.POINTER(c_u64),
                                        ctypes.POINTER(After)]
        self.wait_query = lib.kvt_wait_query
        self.wait_query.restype = ctypes.c_int64
        self.wait_query.argtypes = [c_vp, c_vp, ctypes.c_int64, c_u64, c_u64, c_u64, ctypes.POINTER(After)]
        self.after_append = lib.kvt_after_append
        self.after_append.restype = ctypes.c_int32
        self.after_append.argtypes = [ctypes.POINTER(After), ctypes.c_char_p, c_u64]
        self.after_close = lib.kvt_after_close
        self.after_close.restype = ctypes.c_int32
        self.after_close.argtypes = [ctypes.POINTER(After)]


_wait_helpers_obj: _WaitHelpers | None = None
_wait_helpers_tried = False


def wait_helpers() -> _WaitHelpers | None:
    """The GIL-free wait loops of the C helper, or None (then callers loop in Python)."""
    global _wait_helpers_obj, _wait_helpers_tried
    if not _wait_helpers_tried:
        lib = _helper_library()
        if lib is not None and _has_symbols(lib, _HELPER_SYMBOLS[1:]):
            _wait_helpers_obj = _WaitHelpers(lib)
        _wait_helpers_tried = True
    return _wait_helpers_obj


def wait_query(
    fn_addr: int, handle: int, not_ready: int, *, spin_s: float, sleep_s: float, timeout_s: float,
    after: After | None = None,
) -> int | None:
    """Poll the C function at ``fn_addr`` with ``handle`` (e.g. ``cuEventQuery(event)``) until it stops returning
    ``not_ready``, spinning ``spin_s`` and then sleeping ``sleep_s`` between polls, for up to ``timeout_s``; all
    in one foreign call that releases the GIL (then ``after``, see :class:`After`). Returns the last result, or
    None without the C helper."""
    h = wait_helpers()
    if h is None:
        return None
    return int(h.wait_query(fn_addr, handle, not_ready, int(spin_s * 1e9), int(sleep_s * 1e9),
                            int(max(0.0, timeout_s) * 1e9), ctypes.byref(after) if after is not None else None))


def batch_impl() -> Literal["c", "python"]:
    """Which put_batch implementation is in use: "c" (the install-time build of the helper, or its fallback build,
    which needs a C compiler once) or "python"."""
    return "c" if load_helper() is not None else "python"

