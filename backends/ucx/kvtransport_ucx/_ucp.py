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
compiled), ``KV_TRANSPORT_UCX_NO_C_HELPER`` (boolean: issue puts from Python).
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import hashlib
import logging
import os
import select
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from array import array
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Union

from kvtransport.config import env_bool, read_env
from kvtransport.errors import ConfigurationError

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

#: (major, minor) versions of libucp whose struct layouts were checked against
#: the wheel's headers (see tests/backends/test_ucp_binding.py::test_struct_layouts).
VERIFIED_VERSIONS: frozenset[tuple[int, int]] = frozenset({(1, 21), (1, 22)})

# --------------------------------------------------------------------------- constants
UCS_OK = 0
UCS_INPROGRESS = 1
UCS_ERR_BUSY = -15
UCS_ERR_LAST = -100

UCS_THREAD_MODE_SINGLE = 0
UCS_THREAD_MODE_MULTI = 2

UCS_MEMORY_TYPE_HOST = 0
UCS_MEMORY_TYPE_CUDA = 1

UCP_PARAM_FIELD_FEATURES = 1 << 0
UCP_PARAM_FIELD_NAME = 1 << 8
UCP_FEATURE_RMA = 1 << 1
UCP_FEATURE_AMO64 = 1 << 3
UCP_FEATURE_WAKEUP = 1 << 4

UCP_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0

UCP_EP_PARAM_FIELD_REMOTE_ADDRESS = 1 << 0
UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE = 1 << 1
UCP_ERR_HANDLING_MODE_NONE = 0
UCP_ERR_HANDLING_MODE_PEER = 1

UCP_MEM_MAP_PARAM_FIELD_ADDRESS = 1 << 0
UCP_MEM_MAP_PARAM_FIELD_LENGTH = 1 << 1
UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE = 1 << 4

UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
UCP_OP_ATTR_FIELD_FLAGS = 1 << 4

UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3

UCP_ATOMIC_OP_ADD = 0
UCP_DATATYPE_CONTIG = 0
UCP_DATATYPE_SHIFT = 3


def _dt_make_contig(elem_size: int) -> int:
    return (elem_size << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG


# --------------------------------------------------------------------------- structs
c_u64 = ctypes.c_uint64
c_vp = ctypes.c_void_p
#: ``ucs_status_t`` is a *packed* enum: one signed byte, not an int.
c_status = ctypes.c_int8


class _UcpParams(ctypes.Structure):
    """``ucp_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("features", c_u64),
        ("request_size", ctypes.c_size_t),
        ("request_init", c_vp),
        ("request_cleanup", c_vp),
        ("tag_sender_mask", c_u64),
        ("mt_workers_shared", ctypes.c_int),
        ("estimated_num_eps", ctypes.c_size_t),
        ("estimated_num_ppn", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("node_local_id", ctypes.c_size_t),
    ]


class _UcsCpuSet(ctypes.Structure):
    """``ucs_cpu_set_t`` (UCS_CPU_SETSIZE == 1024 bits)."""

    _fields_ = [("ucs_bits", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong))))]


class _UcpWorkerParams(ctypes.Structure):
    """``ucp_worker_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("thread_mode", ctypes.c_int),
        ("cpu_mask", _UcsCpuSet),
        ("events", ctypes.c_uint),
        ("user_data", c_vp),
        ("event_fd", ctypes.c_int),
        ("flags", c_u64),
        ("name", ctypes.c_char_p),
        ("am_alignment", ctypes.c_size_t),
        ("client_id", c_u64),
    ]


class _UcpErrHandler(ctypes.Structure):
    """``ucp_err_handler_t``."""

    _fields_ = [("cb", c_vp), ("arg", c_vp)]


class _UcsSockAddr(ctypes.Structure):
    """``ucs_sock_addr_t``."""

    _fields_ = [("addr", c_vp), ("addrlen", ctypes.c_uint32)]


class _UcpEpParams(ctypes.Structure):
    """``ucp_ep_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("address", c_vp),
        ("err_mode", ctypes.c_int),
        ("err_handler", _UcpErrHandler),
        ("user_data", c_vp),
        ("flags", ctypes.c_uint),
        ("sockaddr", _UcsSockAddr),
        ("conn_request", c_vp),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", _UcsSockAddr),
    ]


class _UcpMemMapParams(ctypes.Structure):
    """``ucp_mem_map_params_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("address", c_vp),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", c_vp),
    ]


class _UcpRequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (1.22 layout; 1.21 has the same prefix, and we
    only ever set fields of that prefix)."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", c_vp),
        ("cb", c_vp),
        ("datatype", c_u64),
        ("user_data", c_vp),
        ("reply_buffer", c_vp),
        ("memory_type", ctypes.c_int),
        ("recv_info", c_vp),
        ("memh", c_vp),
        ("remote_datatype", c_u64),
        ("remote", c_vp),
        ("remote_count", ctypes.c_size_t),
        ("_reserve", ctypes.c_uint64 * 8),  # slack: never read by us
    ]


class _UcpTransportEntry(ctypes.Structure):
    """``ucp_transport_entry_t``."""

    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _UcpTransports(ctypes.Structure):
    """``ucp_transports_t``."""

    _fields_ = [
        ("entries", ctypes.POINTER(_UcpTransportEntry)),
        ("num_entries", ctypes.c_uint),
        ("entry_size", ctypes.c_size_t),
    ]


class _SockaddrStorage(ctypes.Structure):
    """``struct sockaddr_storage`` (128 bytes, 8-byte aligned on Linux)."""

    _fields_ = [("_data", ctypes.c_uint64 * 16)]


class _UcpEpAttr(ctypes.Structure):
    """``ucp_ep_attr_t``."""

    _fields_ = [
        ("field_mask", c_u64),
        ("name", ctypes.c_char * 32),
        ("local_sockaddr", _SockaddrStorage),
        ("remote_sockaddr", _SockaddrStorage),
        ("transports", _UcpTransports),
        ("user_data", c_vp),
    ]


#: Offsets/sizes checked by the layout test against the installed headers.
STRUCTS: dict[str, type[ctypes.Structure]] = {
    "ucp_params_t": _UcpParams,
    "ucp_worker_params_t": _UcpWorkerParams,
    "ucp_ep_params_t": _UcpEpParams,
    "ucp_mem_map_params_t": _UcpMemMapParams,
    "ucp_request_param_t": _UcpRequestParam,
    "ucp_transport_entry_t": _UcpTransportEntry,
    "ucp_transports_t": _UcpTransports,
    "ucp_ep_attr_t": _UcpEpAttr,
}


# --------------------------------------------------------------------------- errors
class UcpError(RuntimeError):
    """A UCP call failed.  ``status`` is the ``ucs_status_t`` (negative) or None."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class UcpUnavailableError(ImportError):
    """libucp cannot be loaded (not installed, or an unverified version)."""


# --------------------------------------------------------------------------- loading
_INSTALL_HINT = (
    "install PyPI's UCX wheel into this environment: `pip install ucxx-cu12` (or just `pip install libucx-cu12`)"
)


class _Lib:
    """The loaded libraries and typed function pointers."""

    def __init__(self, ucp: ctypes.CDLL, ucs: ctypes.CDLL, path: str) -> None:
        self.ucp = ucp
        self.ucs = ucs
        self.path = path
        P = ctypes.POINTER
        st = c_status

        def fn(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
            f = getattr(lib, name)
            f.restype = restype
            f.argtypes = list(argtypes)
            return f

        self.ucs_status_string = fn(ucs, "ucs_status_string", ctypes.c_char_p, st)
        self.get_version = fn(ucp, "ucp_get_version", None, P(ctypes.c_uint), P(ctypes.c_uint), P(ctypes.c_uint))
        self.config_read = fn(ucp, "ucp_config_read", st, ctypes.c_char_p, ctypes.c_char_p, P(c_vp))
        self.config_modify = fn(ucp, "ucp_config_modify", st, c_vp, ctypes.c_char_p, ctypes.c_char_p)
        self.config_release = fn(ucp, "ucp_config_release", None, c_vp)
        self.init_version = fn(ucp, "ucp_init_version", st, ctypes.c_uint, ctypes.c_uint, P(_UcpParams), c_vp, P(c_vp))
        self.cleanup = fn(ucp, "ucp_cleanup", None, c_vp)
        self.worker_create = fn(ucp, "ucp_worker_create", st, c_vp, P(_UcpWorkerParams), P(c_vp))
        self.worker_destroy = fn(ucp, "ucp_worker_destroy", None, c_vp)
        self.worker_get_address = fn(ucp, "ucp_worker_get_address", st, c_vp, P(c_vp), P(ctypes.c_size_t))
        self.worker_release_address = fn(ucp, "ucp_worker_release_address", None, c_vp, c_vp)
        self.worker_progress = fn(ucp, "ucp_worker_progress", ctypes.c_uint, c_vp)
        self.worker_get_efd = fn(ucp, "ucp_worker_get_efd", st, c_vp, P(ctypes.c_int))
        self.worker_arm = fn(ucp, "ucp_worker_arm", st, c_vp)
        self.worker_signal = fn(ucp, "ucp_worker_signal", st, c_vp)
        self.mem_map = fn(ucp, "ucp_mem_map", st, c_vp, P(_UcpMemMapParams), P(c_vp))
        self.mem_unmap = fn(ucp, "ucp_mem_unmap", st, c_vp, c_vp)
        self.rkey_pack = fn(ucp, "ucp_rkey_pack", st, c_vp, c_vp, P(c_vp), P(ctypes.c_size_t))
        self.rkey_buffer_release = fn(ucp, "ucp_rkey_buffer_release", None, c_vp)
        self.ep_create = fn(ucp, "ucp_ep_create", st, c_vp, P(_UcpEpParams), P(c_vp))
        self.ep_close_nbx = fn(ucp, "ucp_ep_close_nbx", c_vp, c_vp, P(_UcpRequestParam))
        self.ep_flush_nbx = fn(ucp, "ucp_ep_flush_nbx", c_vp, c_vp, P(_UcpRequestParam))
        self.ep_print_info = fn(ucp, "ucp_ep_print_info", None, c_vp, c_vp)
        self.ep_query = fn(ucp, "ucp_ep_query", st, c_vp, P(_UcpEpAttr))
        self.ep_rkey_unpack = fn(ucp, "ucp_ep_rkey_unpack", st, c_vp, c_vp, P(c_vp))
        self.rkey_destroy = fn(ucp, "ucp_rkey_destroy", None, c_vp)
        self.put_nbx = fn(ucp, "ucp_put_nbx", c_vp, c_vp, c_vp, ctypes.c_size_t, c_u64, c_vp, P(_UcpRequestParam))
        self.atomic_op_nbx = fn(
            ucp,
            "ucp_atomic_op_nbx",
            c_vp,
            c_vp,
            ctypes.c_int,
            c_vp,
            ctypes.c_size_t,
            c_u64,
            c_vp,
            P(_UcpRequestParam),
        )
        self.request_check_status = fn(ucp, "ucp_request_check_status", st, c_vp)
        self.request_free = fn(ucp, "ucp_request_free", None, c_vp)

        major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
        self.get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
        self.version: tuple[int, int, int] = (major.value, minor.value, release.value)

        libc_name = ctypes.util.find_library("c") or "libc.so.6"
        self.libc = ctypes.CDLL(libc_name)
        self.open_memstream = fn(self.libc, "open_memstream", c_vp, P(c_vp), P(ctypes.c_size_t))
        self.fclose = fn(self.libc, "fclose", ctypes.c_int, c_vp)
        self.free = fn(self.libc, "free", None, c_vp)

    def status_string(self, status: int) -> str:
        s = self.ucs_status_string(status)
        return s.decode() if s else f"ucs_status {status}"

    def check(self, status: int, what: str) -> None:
        if status != UCS_OK:
            raise UcpError(f"{what} failed: {self.status_string(status)} ({status})", status)


def _env(knob: str) -> str | None:
    """``KV_TRANSPORT_UCX_<knob>`` (or its deprecated ``KVTRANSPORT_UCX_<knob>``), None when unset."""
    return read_env(f"KV_TRANSPORT_UCX_{knob}", deprecated=(f"KVTRANSPORT_UCX_{knob}",))


def _env_flag(knob: str) -> bool:
    """Boolean ``KV_TRANSPORT_UCX_<knob>`` (strict; off when unset). Raises ConfigurationError."""
    return env_bool(f"KV_TRANSPORT_UCX_{knob}", False, deprecated=(f"KVTRANSPORT_UCX_{knob}",))


def check_environment() -> None:
    """Parse every ``KV_TRANSPORT_UCX_*`` knob now (called at ``open()``), so that a bad value is a
    ConfigurationError naming the variable there, not a surprise at the first put."""
    for knob in ("ALLOW_UNVERIFIED", "NO_C_HELPER"):
        _env_flag(knob)


def _find_wheel_libucp() -> tuple[ctypes.CDLL, ctypes.CDLL, str]:
    """Load libucp/libucs via the ``libucx`` wheel (or KV_TRANSPORT_UCX_LIBDIR)."""
    flags = ctypes.RTLD_LOCAL
    libdir = _env("LIBDIR")
    if libdir:
        ucs_path = os.path.join(libdir, "libucs.so")
        ucp_path = os.path.join(libdir, "libucp.so")
        if not os.path.exists(ucp_path):
            ucp_path += ".0"
            ucs_path += ".0"
        try:
            ucs = ctypes.CDLL(ucs_path, flags)
            return ctypes.CDLL(ucp_path, flags), ucs, ucp_path
        except OSError as e:
            raise UcpUnavailableError(f"KV_TRANSPORT_UCX_LIBDIR={libdir!r}: cannot load libucp: {e}") from e
    try:
        import libucx  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as e:
        raise UcpUnavailableError(f"libucp not found (no `libucx` package): {_INSTALL_HINT}") from e
    try:
        # Preloads libucs, libucs_signal, libuct, libucp in dependency order
        # (RTLD_LOCAL), honouring RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY.
        loaded = [h for h in libucx.load_library() if h is not None]
    except OSError as e:
        raise UcpUnavailableError(f"libucx.load_library() failed: {e}; {_INSTALL_HINT}") from e
    by_name: dict[str, ctypes.CDLL] = {os.path.basename(h._name).split(".so")[0]: h for h in loaded}
    ucp_h, ucs_h = by_name.get("libucp"), by_name.get("libucs")
    if ucp_h is None or ucs_h is None:
        raise UcpUnavailableError(f"the libucx package did not provide libucp/libucs; {_INSTALL_HINT}")
    return ucp_h, ucs_h, str(ucp_h._name)


class _LogLimiter:
    """A libucs log handler (``ucs_log_push_handler``) that lets each message site (file:line) print at most
    ``burst`` times per ``window`` seconds; the rest are suppressed and counted in one line through our logger
    when the window ends. A peer that fails in a loop (garbage keys, a dead endpoint) must not flood stderr.

    Runs on whatever thread UCX logs from (ctypes takes the GIL); never raises into C."""

    SIGNATURE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_uint, ctypes.c_char_p, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    STOP, CONTINUE = 0, 1  # ucs_log_func_rc_t

    def __init__(self, burst: int = 5, window: float = 10.0) -> None:
        self.burst = burst
        self.window = window
        self.sites: dict[tuple[bytes, int], list[Any]] = {}  # site -> [window start, printed, suppressed, format]
        self.lock = threading.Lock()
        self.callback = self.SIGNATURE(self._handle)
        self.log = logging.getLogger("kvtransport.ucx")

    def _handle(self, file: bytes | None, line: int, function: bytes | None, level: int, comp: int | None,
                fmt: bytes | None, ap: int | None) -> int:
        try:
            now = time.monotonic()
            key = (file or b"", int(line))
            with self.lock:
                site = self.sites.get(key)
                if site is None or now - site[0] >= self.window:
                    if site is not None and site[2]:
                        self.log.warning("libucx: %d more messages like %r (%s:%d) suppressed in %.0fs", site[2],
                                         (site[3] or b"").decode(errors="replace")[:160],
                                         key[0].decode(errors="replace").rsplit("/", 1)[-1], key[1], self.window)
                    site = [now, 0, 0, fmt]
                    self.sites[key] = site
                    while len(self.sites) > 4096:
                        self.sites.pop(next(iter(self.sites)))
                if site[1] < self.burst:
                    site[1] += 1
                    return self.CONTINUE
                site[2] += 1
                first = site[2] == 1
            if first:  # (outside the lock: the logger may take its own)
                self.log.warning("libucx: repeating message %r (%s:%d); further ones from there are suppressed for "
                                 "%.0fs", (fmt or b"").decode(errors="replace")[:160],
                                 key[0].decode(errors="replace").rsplit("/", 1)[-1], key[1], self.window)
            return self.STOP
        except Exception:  # never into C
            return self.CONTINUE


_log_limiter: _LogLimiter | None = None


def _install_log_limiter(ucs: ctypes.CDLL) -> None:
    """Push the rate-limiting log handler once per process (popped at exit: UCX may log during teardown)."""
    global _log_limiter
    if _log_limiter is not None:
        return
    try:
        push, pop = ucs.ucs_log_push_handler, ucs.ucs_log_pop_handler
    except AttributeError:  # a libucs without handlers: its own logging stays as it is
        return
    push.restype = pop.restype = None
    push.argtypes = [_LogLimiter.SIGNATURE]
    pop.argtypes = []
    _log_limiter = _LogLimiter()
    push(_log_limiter.callback)
    atexit.register(pop)


_lib: _Lib | None = None
_lib_error: BaseException | None = None
_lib_lock = threading.Lock()


def _load() -> _Lib:
    """Load (once) and return the library; raise UcpUnavailableError if impossible."""
    global _lib, _lib_error
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        if _lib_error is not None:
            raise UcpUnavailableError(str(_lib_error)) from _lib_error
        try:
            ucp, ucs, path = _find_wheel_libucp()
            lib = _Lib(ucp, ucs, path)
            if lib.version[:2] not in VERIFIED_VERSIONS and not _env_flag("ALLOW_UNVERIFIED"):
                verified = ", ".join(f"{a}.{b}" for a, b in sorted(VERIFIED_VERSIONS))
                raise UcpUnavailableError(
                    f"libucp {'.'.join(map(str, lib.version))} at {path} is not a version whose struct layouts "
                    f"kvtransport_ucx verified ({verified}); install a matching wheel, e.g. "
                    f"`pip install 'libucx-cu12>=1.21,<1.23'`, or set KV_TRANSPORT_UCX_ALLOW_UNVERIFIED=1 at your risk"
                )
        except (UcpUnavailableError, OSError, AttributeError, ConfigurationError) as e:
            _lib_error = e
            if isinstance(e, UcpUnavailableError):
                raise
            if isinstance(e, ConfigurationError):  # a bad KV_TRANSPORT_UCX_* value: its message is the fix
                raise UcpUnavailableError(str(e)) from e
            raise UcpUnavailableError(f"cannot load libucp: {e}; {_INSTALL_HINT}") from e
        _install_log_limiter(ucs)
        _lib = lib
        return lib


def is_available() -> bool:
    """True if a verified libucp can be loaded (loads it as a side effect)."""
    try:
        _load()
        return True
    except UcpUnavailableError:
        return False


def load_error() -> str | None:
    """Why libucp cannot be loaded, or None if it can."""
    try:
        _load()
        return None
    except UcpUnavailableError as e:
        return str(e)


def ucx_version() -> tuple[int, int, int]:
    """(major, minor, release) of the loaded libucp.  Raises UcpUnavailableError."""
    return _load().version


def library_path() -> str:
    """Filesystem path of the loaded libucp.  Raises UcpUnavailableError."""
    return _load().path


# --------------------------------------------------------------------------- batch helper
_HELPER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ucp_batch.c")
_HELPER_SYMBOLS = ("kvt_put_batch", "kvt_put_batch_rel", "kvt_progress_until", "kvt_wait_query", "kvt_after_append",
                   "kvt_after_close")
_helper: Any = None
_helper_tried = False
_helper_lib: ctypes.CDLL | None = None
_helper_lib_tried = False
_helper_lib_lock = threading.Lock()


def _cache_dir() -> str:
    base = _env("CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvtransport_ucx"
    )
    return base


def _has_symbols(lib: ctypes.CDLL, names: Sequence[str]) -> bool:
    return all(hasattr(lib, n) for n in names)


def _helper_library() -> ctypes.CDLL | None:
    """The compiled helper (install-time build, else compiled once per source hash); None on failure."""
    global _helper_lib, _helper_lib_tried
    with _helper_lib_lock:
        if _helper_lib_tried:
            return _helper_lib
        _helper_lib_tried = True
        try:
            no_helper = _env_flag("NO_C_HELPER")
        except ConfigurationError:  # refused at open() already (check_environment); not worth a failed put
            no_helper = False
        if no_helper:
            return None
        import glob

        prebuilt = None
        built = sorted(glob.glob(os.path.join(os.path.dirname(_HELPER_SRC), "_ucp_batch_ext*.so")))
        try:
            if built:  # compiled at install time (setup.py); an older build may lack newer entry points
                prebuilt = ctypes.CDLL(built[0])
                if _has_symbols(prebuilt, _HELPER_SYMBOLS):
                    _helper_lib = prebuilt
                    return _helper_lib
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


def _load_helper() -> Any:
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
    """Which put_batch implementation is in use ("c" needs a C compiler once)."""
    return "c" if _load_helper() is not None else "python"


# --------------------------------------------------------------------------- helpers
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


class _Handle:
    """Base: owns a C handle, remembers the creating pid."""

    _what = "handle"

    def __init__(self, lib: _Lib, handle: int | None) -> None:
        self._lib = lib
        self._h: int | None = handle
        self._pid = os.getpid()

    @property
    def closed(self) -> bool:
        return self._h is None

    def _handle(self) -> int:
        h = self._h
        if h is None:
            raise UcpError(f"{self._what} is closed")
        if os.getpid() != self._pid:
            raise UcpError(f"{self._what} was created in process {self._pid}; UCX handles cannot cross fork()")
        return h

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __del__(self) -> None:
        # Only release in the owning process; never raise from __del__.
        try:
            if self._h is not None and os.getpid() == self._pid and not sys.is_finalizing():
                self.close()
        except Exception:
            pass


# --------------------------------------------------------------------------- context
class UcpContext(_Handle):
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
        lib = _load()
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
            params = _UcpParams()
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
class UcpMemory(_Handle):
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
        p = _UcpMemMapParams()
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
class UcpWorker(_Handle):
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
        p = _UcpWorkerParams()
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


# --------------------------------------------------------------------------- endpoint
class UcpRkey(_Handle):
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


class UcpEndpoint(_Handle):
    """Endpoint to one peer worker.  All operations use the creating worker."""

    _what = "UcpEndpoint"

    def __init__(self, worker: UcpWorker, remote_address: bytes, peer_error_handling: bool) -> None:
        lib = worker._lib
        super().__init__(lib, None)
        self._worker = worker
        self._rkeys: list[UcpRkey] = []
        addr_buf = ctypes.create_string_buffer(remote_address, len(remote_address))
        p = _UcpEpParams()
        p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
        p.address = ctypes.addressof(addr_buf)
        p.err_mode = UCP_ERR_HANDLING_MODE_PEER if peer_error_handling else UCP_ERR_HANDLING_MODE_NONE
        h = c_vp()
        lib.check(lib.ep_create(worker._handle(), ctypes.byref(p), ctypes.byref(h)), "ucp_ep_create")
        self._h = h.value
        self._param0 = _UcpRequestParam()  # op_attr_mask = 0: no callback, contig bytes
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
        helper = _load_helper()
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
        if h is None or _load_helper() is None:
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
        p = _UcpRequestParam()
        p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE
        p.datatype = _dt_make_contig(8)
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
        entries = (_UcpTransportEntry * 32)()
        attr = _UcpEpAttr()
        attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS
        attr.transports.entries = ctypes.cast(entries, ctypes.POINTER(_UcpTransportEntry))
        attr.transports.num_entries = len(entries)
        attr.transports.entry_size = ctypes.sizeof(_UcpTransportEntry)
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
