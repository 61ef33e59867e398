"""Loading libucp/libucs for :mod:`kvtransport_ucx._ucp`: the ``KV_TRANSPORT_UCX_*`` knobs, finding the libraries
(the ``libucx`` wheel, or ``KV_TRANSPORT_UCX_LIBDIR``), the version gate (:data:`VERIFIED_VERSIONS`), the rate
limit on libucs's own log lines, the process-wide :class:`~kvtransport_ucx._ucp_abi.UcpLib`, and :class:`Handle`,
the base of every object of the binding (it holds that ``UcpLib``).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
import time
from typing import Any

from kvtransport.config import env_bool, read_env
from kvtransport.errors import ConfigurationError

from ._ucp_abi import UcpError, UcpLib, UcpUnavailableError

#: (major, minor) versions of libucp whose struct layouts were checked against
#: the wheel's headers (see tests/backends/test_ucp_binding.py::test_struct_layouts).
VERIFIED_VERSIONS: frozenset[tuple[int, int]] = frozenset({(1, 21), (1, 22)})


# --------------------------------------------------------------------------- loading
_INSTALL_HINT = (
    "install PyPI's UCX wheel into this environment: `pip install ucxx-cu12` (or just `pip install libucx-cu12`)"
)


def env_knob(knob: str) -> str | None:
    """``KV_TRANSPORT_UCX_<knob>`` (or its deprecated ``KVTRANSPORT_UCX_<knob>``), None when unset."""
    return read_env(f"KV_TRANSPORT_UCX_{knob}", deprecated=(f"KVTRANSPORT_UCX_{knob}",))


def env_flag(knob: str) -> bool:
    """Boolean ``KV_TRANSPORT_UCX_<knob>`` (strict; off when unset). Raises ConfigurationError."""
    return env_bool(f"KV_TRANSPORT_UCX_{knob}", False, deprecated=(f"KVTRANSPORT_UCX_{knob}",))


def check_environment() -> None:
    """Parse every ``KV_TRANSPORT_UCX_*`` knob now (called at ``open()``), so that a bad value is a
    ConfigurationError naming the variable there, not a surprise at the first put."""
    for knob in ("ALLOW_UNVERIFIED", "NO_C_HELPER"):
        env_flag(knob)


def _find_wheel_libucp() -> tuple[ctypes.CDLL, ctypes.CDLL, str]:
    """Load libucp/libucs via the ``libucx`` wheel (or KV_TRANSPORT_UCX_LIBDIR)."""
    flags = ctypes.RTLD_LOCAL
    libdir = env_knob("LIBDIR")
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


_lib: UcpLib | None = None
_lib_error: BaseException | None = None
_lib_lock = threading.Lock()


def load_library() -> UcpLib:
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
            lib = UcpLib(ucp, ucs, path)
            if lib.version[:2] not in VERIFIED_VERSIONS and not env_flag("ALLOW_UNVERIFIED"):
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
        load_library()
        return True
    except UcpUnavailableError:
        return False


def load_error() -> str | None:
    """Why libucp cannot be loaded, or None if it can."""
    try:
        load_library()
        return None
    except UcpUnavailableError as e:
        return str(e)


def ucx_version() -> tuple[int, int, int]:
    """(major, minor, release) of the loaded libucp.  Raises UcpUnavailableError."""
    return load_library().version


def library_path() -> str:
    """Filesystem path of the loaded libucp.  Raises UcpUnavailableError."""
    return load_library().path


# --------------------------------------------------------------------------- handles
class Handle:
    """Base: owns a C handle, remembers the creating pid."""

    _what = "handle"

    def __init__(self, lib: UcpLib, handle: int | None) -> None:
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

