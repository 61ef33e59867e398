"""Configuration: explicit argument > environment variable > default. Read at ``open()``, never at import.

Environment variables follow one scheme: ``KV_TRANSPORT`` names the backend and ``NET_IFNAME`` the network
interface (both shared with other tools); every other knob is ``KV_TRANSPORT_<NAME>``: a core option of
``kvtransport.open(name=...)`` is ``KV_TRANSPORT_<OPTION>``, a backend's own knob is
``KV_TRANSPORT_<BACKEND>_<KNOB>`` (e.g. ``KV_TRANSPORT_UCX_LIBDIR``), an integration's is
``KV_TRANSPORT_<INTEGRATION>_<KNOB>``. Older names keep working for now with a DeprecationWarning (and one
logged warning) naming the new one. Booleans accept 1/0, true/false, yes/no, on/off (any case); anything
else is a ConfigurationError naming the variable. An empty variable counts as unset.

Core variables:
    KV_TRANSPORT           backend name, or ``auto`` (default): the best available for the layout's memory
    NET_IFNAME             network interface for bootstrap, side channel and the backend's own knobs
                           (default: loopback, for peers on this host)
    KV_TRANSPORT_SECRET    shared secret; when set, peers must prove it (HMAC) in the handshake
    KV_TRANSPORT_PORT      side-channel port (default 0: any free port)
    KV_TRANSPORT_TIMEOUT   default bound in seconds for connect/handshake/internal waits (default 30)
    KV_TRANSPORT_CAPACITY  sequence slots of a receiver (default 1024)
    KV_TRANSPORT_COALESCE  boolean: merge adjacent blocks into runs (default on)
    KV_TRANSPORT_CHECKSUM  boolean: debug option, CRC-32 of every put verified on arrival (host memory)
    KV_TRANSPORT_DOORBELL  boolean, off: signals only by the side channel, never by a device-written doorbell
                           (kvtransport.doorbell; default on: used where the link can write one)

The helpers (:func:`read_env`, :func:`env_bool`, :func:`env_int`, :func:`env_float`, :func:`parse_bool`,
:func:`unknown_option`) are public so that backends and integrations parse their own knobs the same way.
"""

from __future__ import annotations

import difflib
import fcntl
import logging
import os
import socket
import struct
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import checks
from .errors import ConfigurationError, InterfaceNotFound

DEFAULT_CAPACITY = 1024
MAX_CAPACITY = 1 << 20
"""Sequence slots a receiver may be opened with (each costs a little memory up front)."""
DEFAULT_TIMEOUT = 30.0
ENV_PREFIX = "KV_TRANSPORT_"
"""Prefix of every knob other than ``KV_TRANSPORT`` and ``NET_IFNAME``."""
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

T = TypeVar("T")
log = logging.getLogger("kvtransport.config")
_warned_names: set[str] = set()


# ---------------------------------------------------------------------- environment helpers
def read_env(name: str, *, deprecated: Iterable[str] = (), env: Mapping[str, str] | None = None) -> str | None:
    """The value of ``name`` in ``env`` (default ``os.environ``), else of the first set name in ``deprecated``
    (older names of the same knob: a DeprecationWarning, and one logged warning per process, name the new
    one). None when none is set; an empty or blank value counts as unset. Never raises, never blocks."""
    return _lookup(name, deprecated, env)[1]


def _lookup(name: str, deprecated: Iterable[str], env: Mapping[str, str] | None) -> tuple[str, str | None]:
    """(the variable that was read, its value) for :func:`read_env`; ``(name, None)`` when none is set."""
    env = os.environ if env is None else env
    value = env.get(name)
    if value is not None and value.strip():
        return name, value
    for old in deprecated:
        value = env.get(old)
        if value is not None and value.strip():
            message = f"{old} is deprecated: set {name} instead (same meaning)"
            warnings.warn(message, DeprecationWarning, stacklevel=3)
            if old not in _warned_names:  # DeprecationWarning is hidden by default; a user setting must be seen
                _warned_names.add(old)
                log.warning("%s", message)
            return old, value
    return name, None


def parse_bool(name: str, value: str) -> bool:
    """``value`` of the setting ``name`` as a boolean: 1/true/yes/on or 0/false/no/off (any case, blanks
    around ignored). Anything else raises ConfigurationError naming the setting and the accepted words."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigurationError(f"{name}={value!r} is not a boolean: use one of {', '.join(TRUE_WORDS)} "
                             f"or {', '.join(FALSE_WORDS)}")


def env_bool(name: str, default: bool, *, deprecated: Iterable[str] = (), env: Mapping[str, str] | None = None) -> bool:
    """Boolean knob ``name`` (strict: see :func:`parse_bool`), ``default`` when unset. Raises
    ConfigurationError naming the variable that was set (``name`` or a deprecated alias)."""
    used, value = _lookup(name, deprecated, env)
    return default if value is None else parse_bool(used, value)


def env_int(name: str, default: int, *, deprecated: Iterable[str] = (), env: Mapping[str, str] | None = None) -> int:
    """Integer knob ``name``, ``default`` when unset. Raises ConfigurationError for anything but an integer."""
    return _env_parsed(name, default, int, "an integer", deprecated, env)


def env_float(name: str, default: float, *, deprecated: Iterable[str] = (), env: Mapping[str, str] | None = None,
              unit: str = "number") -> float:
    """Number knob ``name``, ``default`` when unset. Raises ConfigurationError when ``float()`` refuses the
    value (range checks are the caller's: see :func:`resolve` for the timeout's)."""
    return _env_parsed(name, default, float, f"a {unit}", deprecated, env)


def _env_parsed(name: str, default: T, parse: Callable[[str], T], what: str, deprecated: Iterable[str],
                env: Mapping[str, str] | None) -> T:
    used, value = _lookup(name, deprecated, env)
    if value is None:
        return default
    try:
        return parse(value)
    except ValueError:
        raise ConfigurationError(f"{used}={value!r} is not {what}") from None


def unknown_option(name: str, valid: Iterable[str], where: str) -> ConfigurationError:
    """The error for an option ``name`` that ``where`` (e.g. ``"kvtransport.open()"``) does not take: names the
    closest valid option (difflib) and lists them all. Returned, not raised, so callers ``raise`` it."""
    choices = sorted(set(valid))
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigurationError(f"{where}: unknown option {name!r}{hint}; valid options: {', '.join(choices) or 'none'}")


# ---------------------------------------------------------------------- settings
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


CORE_OPTIONS = ("capacity", "timeout", "port", "secret", "coalesce", "checksum", "doorbell")
"""Keyword options of ``kvtransport.open()`` handled by the core; each also reads ``KV_TRANSPORT_<NAME>``."""


def resolve(
    backend: str | None = None,
    ifname: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    capacity: int | None = None,
    timeout: float | None = None,
    port: int | None = None,
    secret: str | bytes | None = None,
    coalesce: bool | None = None,
    checksum: bool | None = None,
    doorbell: bool | None = None,
    **backend_options: Any,
) -> Settings:
    """Resolve settings: each argument that is not None, else its environment variable, else the default.
    Remaining keyword options are the backend's (``kvtransport.open`` checks their names against the backend's
    declared options). Raises ConfigurationError (or InterfaceNotFound) naming the setting; never blocks."""
    env = os.environ if env is None else env
    name = (backend or read_env("KV_TRANSPORT", env=env) or "auto").strip().lower()
    iface = ifname or read_env("NET_IFNAME", env=env)
    address = interface_address(iface) if iface else "127.0.0.1"
    capacity = _typed("capacity", capacity, int) if capacity is not None else env_int(
        "KV_TRANSPORT_CAPACITY", DEFAULT_CAPACITY, env=env)
    port = _typed("port", port, int) if port is not None else env_int("KV_TRANSPORT_PORT", 0, env=env)
    if timeout is None:
        timeout = checks.timeout_seconds(env_float("KV_TRANSPORT_TIMEOUT", DEFAULT_TIMEOUT, env=env,
                                                   unit="number of seconds"),
                                         "KV_TRANSPORT_TIMEOUT", zero_ok=False, error=ConfigurationError)
    else:
        timeout = checks.timeout_seconds(timeout, "timeout", zero_ok=False, error=ConfigurationError)
    flags = {}
    for key, value, default in (("coalesce", coalesce, True), ("checksum", checksum, False),
                                ("doorbell", doorbell, True)):
        flags[key] = _typed(key, value, bool) if value is not None else env_bool(
            f"{ENV_PREFIX}{key.upper()}", default, env=env)
    if secret is None:
        secret = read_env("KV_TRANSPORT_SECRET", env=env)
    if isinstance(secret, str):
        secret = secret.encode()
    elif secret is not None and not isinstance(secret, bytes):
        raise ConfigurationError(f"secret must be str or bytes, got {type(secret).__name__}")
    settings = Settings(backend=name, ifname=iface, address=address, secret=secret or None, port=port,
                        capacity=capacity, timeout=timeout, backend_options=dict(backend_options), **flags)
    if not 0 <= settings.port < 65536:
        raise ConfigurationError(f"port {settings.port} out of range 0..65535")
    if not 1 <= settings.capacity <= MAX_CAPACITY:
        raise ConfigurationError(f"capacity must be 1..{MAX_CAPACITY} sequence slots, got {settings.capacity}")
    return settings


def _typed(name: str, value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (a bool is no int here); else ConfigurationError naming the option."""
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ConfigurationError(f"{name}={value!r}: expected {kind.__name__}, got {type(value).__name__}")


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
