"""Configuration: explicit argument > environment variable > default. Read at ``open()``, never at import.

Environment variables:
    KV_TRANSPORT          backend name, or ``auto`` (default): the best available for the layout's memory
    NET_IFNAME            network interface for bootstrap, side channel and the backend's own knobs
                          (default: loopback, for peers on this host)
    KV_TRANSPORT_SECRET   shared secret; when set, peers must prove it (HMAC) in the handshake
    KV_TRANSPORT_PORT     side-channel port (default 0: any free port)
    KV_TRANSPORT_TIMEOUT  default bound in seconds for connect/handshake/internal waits (default 30)
    KV_TRANSPORT_CHECKSUM 1: debug option, CRC-32 of every put verified on arrival (host memory)
    KV_TRANSPORT_DOORBELL 0: signals only by the side channel, never by a device-written doorbell
                          (kvtransport.doorbell; default 1: used where the link can write one)
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import ConfigurationError, InterfaceNotFound

DEFAULT_CAPACITY = 1024
DEFAULT_TIMEOUT = 30.0


@dataclass(frozen=True)
class Settings:
    """Resolved settings of one CommManager (see the module docstring for sources)."""

    backend: str = "auto"
    ifname: str | None = None
    address: str = "127.0.0.1"
    port: int = 0
    capacity: int = DEFAULT_CAPACITY
    timeout: float = DEFAULT_TIMEOUT
    secret: bytes | None = field(default=None, repr=False)
    coalesce: bool = True
    checksum: bool = False
    doorbell: bool = True
    backend_options: Mapping[str, Any] = field(default_factory=dict)


CORE_OPTIONS = {f.name for f in fields(Settings)} - {"backend", "ifname", "address", "backend_options"}


def resolve(
    backend: str | None = None,
    ifname: str | None = None,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> Settings:
    """Resolve settings. Unknown keyword options are handed to the backend (it rejects what it does not know)."""
    env = os.environ if env is None else env
    name = (backend or env.get("KV_TRANSPORT") or "auto").strip().lower()
    iface = ifname or env.get("NET_IFNAME") or None
    address = interface_address(iface) if iface else "127.0.0.1"
    core = {k: options.pop(k) for k in list(options) if k in CORE_OPTIONS}
    if "port" not in core and env.get("KV_TRANSPORT_PORT"):
        core["port"] = _env_int(env, "KV_TRANSPORT_PORT")
    if "timeout" not in core and env.get("KV_TRANSPORT_TIMEOUT"):
        core["timeout"] = _env_float(env, "KV_TRANSPORT_TIMEOUT")
    if "checksum" not in core and env.get("KV_TRANSPORT_CHECKSUM"):
        core["checksum"] = env["KV_TRANSPORT_CHECKSUM"].strip().lower() in ("1", "true", "yes", "on")
    if "doorbell" not in core and env.get("KV_TRANSPORT_DOORBELL"):
        core["doorbell"] = env["KV_TRANSPORT_DOORBELL"].strip().lower() not in ("0", "false", "no", "off")
    secret = core.pop("secret", None)
    if secret is None and env.get("KV_TRANSPORT_SECRET"):
        secret = env["KV_TRANSPORT_SECRET"]
    if isinstance(secret, str):
        secret = secret.encode()
    settings = Settings(backend=name, ifname=iface, address=address, secret=secret or None,
                        backend_options=dict(options), **core)
    if not 0 <= settings.port < 65536:
        raise ConfigurationError(f"port {settings.port} out of range 0..65535")
    if settings.capacity < 1:
        raise ConfigurationError(f"capacity must be >= 1, got {settings.capacity}")
    if not settings.timeout > 0:
        raise ConfigurationError(f"timeout must be > 0 seconds, got {settings.timeout}")
    return settings


def _env_int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigurationError(f"{key}={env[key]!r} is not an integer") from None


def _env_float(env: Mapping[str, str], key: str) -> float:
    try:
        return float(env[key])
    except ValueError:
        raise ConfigurationError(f"{key}={env[key]!r} is not a number of seconds") from None


# ---------------------------------------------------------------------- interfaces
def list_interfaces() -> dict[str, str | None]:
    """Interface name -> IPv4 address (None when it has none), as the kernel reports them."""
    return {name: _ipv4_of(name) for _, name in socket.if_nameindex()}


def _ipv4_of(name: str) -> str | None:
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def interface_address(ifname: str) -> str:
    """The IPv4 address of ``ifname``; raises InterfaceNotFound listing what exists."""
    ifaces = list_interfaces()
    if ifname not in ifaces:
        listing = ", ".join(f"{n} ({a or 'no IPv4'})" for n, a in sorted(ifaces.items())) or "none"
        raise InterfaceNotFound(f"NET_IFNAME={ifname} not found; interfaces: {listing}")
    addr = ifaces[ifname]
    if addr is None:
        have = ", ".join(n for n, a in sorted(ifaces.items()) if a) or "none"
        raise InterfaceNotFound(f"NET_IFNAME={ifname} has no IPv4 address; interfaces with one: {have}")
    return addr


def host_id() -> str:
    """Identifies this machine (boot id + hostname), so backends can tell same-host peers apart."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
