"""Finding, checking and loading the user's MSCCL++ build, and turning its errors into typed ones.

MSCCL++ has no wheel: users build it from source, so what they have varies. Everything here that can be
learnt without importing it (``build_info``) is learnt from the installed files: where it is, its version,
whether InfiniBand was compiled in (an IB-off build has stubs that crash on IB transports instead of
raising), and whether libstdc++ was linked statically (such a build segfaults in its bootstrap sockets as
soon as another libstdc++ is loaded — torch and CuPy load one — so it is refused with the fix).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kvtransport.errors import (
    BackendUnavailable,
    ConfigurationError,
    KVTransportError,
    PeerDisconnected,
    TransferError,
    TransferTimeout,
)

BUILD_DOC = "backends/mscclpp/README.md"
IB_MARKER = b"IB transport out of range"
"""A message only IB-enabled builds contain (ib.cc's USE_IBVERBS branch)."""


@dataclass(frozen=True)
class BuildInfo:
    """What the installed MSCCL++ is, read from its files (no import)."""

    installed: bool
    version: str = ""
    package_dir: str = ""
    library: str = ""
    ib_compiled: bool = False
    static_libstdcxx: bool = False

    def summary(self) -> str:
        if not self.installed:
            return "not installed"
        ib = "IB compiled in" if self.ib_compiled else "built without IB (MSCCLPP_USE_IB=OFF)"
        return f"MSCCL++ {self.version or '?'} at {self.package_dir}, {ib}"


@functools.cache
def build_info() -> BuildInfo:
    """Inspect the installed ``mscclpp`` package without importing it. Never raises."""
    try:
        spec = importlib.util.find_spec("mscclpp")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return BuildInfo(installed=False)
    pkg = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = metadata.version("mscclpp")
    except metadata.PackageNotFoundError:
        version = ""
    libs = sorted((pkg / "lib").glob("libmscclpp.so*")) + sorted(pkg.glob("libmscclpp.so*"))
    if not libs:
        return BuildInfo(installed=True, version=version, package_dir=str(pkg))
    lib = libs[0]
    try:
        blob = lib.read_bytes()
    except OSError:
        blob = b""
    needed = elf_needed(blob)
    if needed is not None:  # an ELF shared object: its DT_NEEDED entries say how libstdc++ is linked
        static = not any(name.startswith("libstdc++") for name in needed)
    else:  # not a readable ELF: look for the name anywhere
        static = bool(blob) and b"libstdc++.so.6" not in blob
    return BuildInfo(
        installed=True,
        version=version,
        package_dir=str(pkg),
        library=str(lib),
        ib_compiled=IB_MARKER in blob,
        static_libstdcxx=static,
    )


def elf_needed(blob: bytes) -> list[str] | None:
    """The DT_NEEDED names of a 64-bit little-endian ELF shared object, or None if ``blob`` is not one."""
    import struct

    if len(blob) < 64 or blob[:4] != b"\x7fELF" or blob[4] != 2 or blob[5] != 1:
        return None
    try:
        shoff, = struct.unpack_from("<Q", blob, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
        for sh_type, off, size, link, entsize in ((sec[1], sec[4], sec[5], sec[6], sec[9]) for sec in sections):
            if sh_type != 6:  # SHT_DYNAMIC
                continue
            strtab_off = sections[link][4]
            names = []
            for pos in range(off, off + size, entsize or 16):
                tag, val = struct.unpack_from("<qQ", blob, pos)
                if tag == 0:
                    break
                if tag == 1:  # DT_NEEDED
                    end = blob.index(b"\0", strtab_off + val)
                    names.append(blob[strtab_off + val:end].decode(errors="replace"))
            return names
    except (struct.error, IndexError, ValueError):
        return None
    return []


def unusable_reason(info: BuildInfo | None = None, environ: dict[str, str] | None = None) -> str | None:
    """Why the installed build cannot be used in this process (with the fix), or None."""
    info = build_info() if info is None else info
    env = os.environ if environ is None else environ
    if not info.installed:
        return (f"MSCCL++ is not installed (no wheel exists for it): build it from upstream source, see {BUILD_DOC}")
    if not info.library:
        return f"MSCCL++ at {info.package_dir} has no libmscclpp.so: the build is incomplete; rebuild it ({BUILD_DOC})"
    if info.static_libstdcxx and "libstdc++" not in env.get("LD_PRELOAD", ""):
        return (
            f"{info.library} links libstdc++ statically; it crashes (SIGSEGV in its bootstrap sockets) once torch "
            "or CuPy has loaded the system libstdc++. Rebuild MSCCL++ with the system compiler "
            "(CXX=/usr/bin/g++), or start Python with LD_PRELOAD=$(g++ -print-file-name=libstdc++.so.6)"
        )
    return None


def load() -> Any:
    """Import and return MSCCL++'s native module. Raises BackendUnavailable with the reason and the fix."""
    reason = unusable_reason()
    if reason:
        raise BackendUnavailable(f"mscclpp backend: {reason}")
    try:
        from mscclpp import _mscclpp  # type: ignore[import-not-found]  # built by the user
    except Exception as exc:  # missing cupy/blake3, ABI mismatch, ...
        raise BackendUnavailable(
            f"mscclpp backend: `import mscclpp` failed: {type(exc).__name__}: {exc} "
            "(it needs cupy, blake3, pybind11 and sortedcontainers; a build for another Python/CUDA must be rebuilt)"
        ) from None
    return _mscclpp


def ib_devices(environ: dict[str, str] | None = None, sysfs: str = "/sys/class/infiniband") -> list[str]:
    """RDMA devices in MSCCL++'s order for IB0..IB7 (``MSCCLPP_HCA_DEVICES`` if set, else sysfs order)."""
    env = os.environ if environ is None else environ
    forced = [d.strip() for d in env.get("MSCCLPP_HCA_DEVICES", "").split(",") if d.strip()]
    if forced:
        return forced
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


_REMEDIES: list[tuple[str, type[KVTransportError], str]] = [
    ("IB transport out of range", BackendUnavailable,
     "an InfiniBand transport was requested but this host has fewer RDMA devices (see `ibv_devices` / "
     "/sys/class/infiniband); peers on this host use CudaIpc (transport=auto), others need an IB/RoCE NIC"),
    ("Cannot allocate memory", BackendUnavailable,
     "RDMA memory registration failed: raise the memlock limit (ulimit -l unlimited; containers: "
     "--ulimit memlock=-1). With MSCCL++ before late 2025 this message may also mean the peer is unreachable"),
    ("No interface named", ConfigurationError,
     "the bootstrap interface does not exist: set NET_IFNAME (and MSCCLPP_SOCKET_IFNAME) to an interface from "
     "`kvtransport doctor`"),
    ("TcpBootstrap connection timeout", TransferTimeout,
     "the peer did not join the MSCCL++ bootstrap in time: is it alive, and is its NET_IFNAME address reachable?"),
    ("Connection refused", PeerDisconnected, "the peer's MSCCL++ bootstrap is not listening (peer gone?)"),
    ("Connection reset", PeerDisconnected, "the peer closed the MSCCL++ connection (peer gone?)"),
]


def translate(exc: BaseException, what: str) -> KVTransportError:
    """The typed kvtransport error (message with a remedy) for an MSCCL++ exception raised by ``what``."""
    if isinstance(exc, KVTransportError):
        return exc
    # MSCCL++ raises (code, message) tuples as args; str() of them is noisy
    args: tuple[Any, ...] = tuple(getattr(exc, "args", ()))
    message = str(args[1]) if len(args) == 2 and isinstance(args[1], str) else str(exc)
    for needle, kind, remedy in _REMEDIES:
        if needle in message:
            return kind(f"mscclpp {what}: {message.strip()} — {remedy}")
    code = args[0] if args else None
    if type(exc).__name__ in ("Error", "BaseError") and code == 4:  # ErrorCode::Timeout (CuError codes differ)
        return TransferTimeout(f"mscclpp {what} timed out: {message}")
    return TransferError(f"mscclpp {what} failed: {type(exc).__name__}: {message}")
