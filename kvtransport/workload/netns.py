"""Several "hosts" on one Linux machine, for tests and the bench: network namespaces joined by veth pairs.

Each host is a network namespace with its loopback up; a link is a veth pair with one end in each of two
hosts and addresses from 198.18.0.0/15 (reserved for benchmarking, RFC 2544). A process becomes one of
these hosts with :meth:`Host.enter` (the harness does it for its roles, see ``run_pair(hosts=...)``): it
moves into the host's network namespace and into new UTS, IPC and mount namespaces (its own hostname, its
own System V IPC, and a ``/sys`` that lists the namespace's interfaces, which is where UCX looks for them).
UTS alone does not make two processes look like two hosts to UCX: it identifies a host by the kernel's
boot id and reaches peers in the same IPC namespace over shared memory and CMA; a separate IPC namespace
leaves it TCP.

Needs root and iproute2 (``ip``): :func:`unavailable_reason` says what is missing, for skips. Everything a
:class:`Network` creates is removed by :meth:`Network.close` (also on error, as a context manager); names
carry the creator's pid, so :func:`remove_stale` can clear what a killed run left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_REC = 0x4000
MS_SLAVE = 0x80000
MNT_DETACH = 2
NETNS_DIR = "/run/netns"
PREFIX = "kvt"
"""Namespace names are ``kvt-<pid>-<n>-<host>``, veth names ``kv<pid>n<n><a|b>`` (at most 15 characters)."""
_STALE = re.compile(rf"^{PREFIX}-(\d+)-")
_counter = 0
_counter_lock = threading.Lock()


class NetnsError(RuntimeError):
    """A namespace operation failed; the message carries the command and what it printed."""


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"{what}: {os.strerror(err)} (errno {err})")


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be built here (not root, no iproute2, no namespace support), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "iproute2 is not installed (`ip` not found): apt-get install iproute2"
    name = f"{PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", name)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def our_namespaces() -> list[str]:
    """Namespaces named like ours (any creator)."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return []
    return sorted(n for n in names if _STALE.match(n))


def stale_namespaces() -> list[str]:
    """Namespaces named like ours whose creator process no longer exists (left behind by a killed run)."""
    return [n for n in our_namespaces() if (m := _STALE.match(n)) and not _pid_alive(int(m.group(1)))]


def remove_stale() -> list[str]:
    """Delete :func:`stale_namespaces` (and the veths in them); returns their names."""
    removed = stale_namespaces()
    for name in removed:
        _ip("netns", "del", name, check=False)
    return removed


@dataclass(frozen=True)
class Host:
    """One host of a :class:`Network`: its namespace, hostname and the interface NET_IFNAME names."""

    name: str
    netns: str
    hostname: str
    ifname: str
    address: str
    interfaces: tuple[tuple[str, str], ...] = ()
    """Every (interface, IPv4 address) of the host but loopback, in the order the links were made."""

    def _join_netns(self) -> Any:
        """Move the calling thread into this host's network namespace; returns libc. Raises NetnsError."""
        libc = _libc()
        fd = os.open(os.path.join(NETNS_DIR, self.netns), os.O_RDONLY)
        try:
            _check(libc.setns(fd, CLONE_NEWNET), f"setns into {self.netns}")
        finally:
            os.close(fd)
        return libc

    def enter(self, *, set_ifname: bool = True) -> None:
        """Make the calling process this host: join its network namespace; new UTS (hostname), IPC and
        mount namespaces with ``/sys`` remounted for the namespace; ``NET_IFNAME`` set to :attr:`ifname`
        unless ``set_ifname`` is False. Call it first thing in a fresh process, before any thread starts
        (namespaces are per thread; raises NetnsError otherwise). Irreversible for the process."""
        tasks = len(os.listdir("/proc/self/task"))
        if tasks != 1:
            raise NetnsError(f"Host.enter needs a single-threaded process; this one has {tasks} threads")
        libc = self._join_netns()
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC), "unshare mount/UTS/IPC namespaces")
        _check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "make / a slave mount")
        libc.umount2(b"/sys", MNT_DETACH)
        _check(libc.mount(self.netns.encode(), b"/sys", b"sysfs", 0, None), "mount /sys for the namespace")
        socket.sethostname(self.hostname)
        if set_ifname:
            os.environ["NET_IFNAME"] = self.ifname

    def run(self, fn: Callable[[], T]) -> T:
        """Call ``fn`` on a fresh thread inside this host's network namespace (sockets it opens live there)
        and return its result or raise its exception. Blocking; the calling thread stays where it is."""
        out: dict[str, Any] = {}

        def body() -> None:
            try:
                self._join_netns()
                out["value"] = fn()
            except BaseException as exc:
                out["error"] = exc

        t = threading.Thread(target=body, name=f"kvt-netns-{self.name}", daemon=True)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]  # type: ignore[no-any-return]


def connect_error(host: Host, address: str, port: int, timeout: float = 2.0) -> str | None:
    """Try a TCP connection from ``host`` to ``address:port``: None if it was accepted (then closed at
    once), else the error's name (``ConnectionRefusedError``, ``TimeoutError``, ...)."""

    def attempt() -> str | None:
        try:
            with socket.create_connection((address, port), timeout=timeout):
                return None
        except OSError as exc:
            return type(exc).__name__

    return host.run(attempt)


def listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of the calling process's network namespace (IPv4 and
    IPv6, from /proc/net/tcp{,6}; ``::`` / ``0.0.0.0`` mean every interface)."""
    out = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A":  # TCP_LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(addr_hex)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 8 else socket.AF_INET6
            out.append((socket.inet_ntop(family, words), int(port_hex, 16)))
    return out


class Network:
    """Hosts and links of one test or bench run. Use as a context manager (closes on error too).

    ``add_host``/``add_link`` build; ``host(name)`` returns the :class:`Host` to hand to a process;
    ``set_link(a, b, up)`` takes a link down or up (a partition: the peers' sockets stay open, packets are
    lost); ``close`` removes every namespace and veth. Blocking (runs ``ip``); raises NetnsError."""

    def __init__(self) -> None:
        global _counter
        with _counter_lock:
            self.serial = _counter
            _counter += 1
        self.tag = f"{os.getpid()}-{self.serial}"
        self.namespaces: dict[str, str] = {}
        self.veths: list[str] = []  # root-namespace names of every veth end created (until moved)
        self.links: dict[frozenset[str], tuple[tuple[str, str, str], tuple[str, str, str]]] = {}
        self._ifaces: dict[str, list[tuple[str, str]]] = {}
        self.closed = False

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_host(self, name: str) -> None:
        """A namespace with its loopback up."""
        if not re.fullmatch(r"[a-z]", name):
            raise ValueError(f"host names are one lower-case letter, got {name!r}")
        netns = f"{PREFIX}-{self.tag}-{name}"
        _ip("netns", "add", netns)
        self.namespaces[name] = netns
        self._ifaces[name] = []
        _ip("link", "set", "lo", "up", netns=netns)

    def add_link(self, a: str, b: str) -> tuple[str, str]:
        """A veth pair between hosts ``a`` and ``b`` (198.18/15 addresses, one /24 per link, up).
        Returns the two interface names."""
        k = len(self.links)
        if k >= 512:
            raise ValueError("at most 512 links per network")
        names = (f"kv{os.getpid()}n{self.serial}{k}{a}", f"kv{os.getpid()}n{self.serial}{k}{b}")
        if max(len(n) for n in names) > 15:
            names = (f"kv{self.serial % 1000}x{k}{a}{os.getpid() % 10000}", f"kv{self.serial % 1000}x{k}{b}{os.getpid() % 10000}")
        net = f"198.{18 + k // 256}.{k % 256}"
        ends = ((a, names[0], f"{net}.1"), (b, names[1], f"{net}.2"))
        self.veths.extend(names)
        _ip("link", "add", names[0], "type", "veth", "peer", "name", names[1])
        for host, ifname, addr in ends:
            netns = self.namespaces[host]
            _ip("link", "set", ifname, "netns", netns)
            _ip("addr", "add", f"{addr}/24", "dev", ifname, netns=netns)
            _ip("link", "set", ifname, "up", netns=netns)
            self._ifaces[host].append((ifname, addr))
        self.links[frozenset((a, b))] = ends
        return names

    def host(self, name: str, *, via: str | None = None) -> Host:
        """The host ``name``; NET_IFNAME is its first link's interface, or with ``via`` the interface of its
        link to host ``via`` (e.g. ``a``'s second interface, towards ``c``). Raises ValueError without one."""
        ifaces = self._ifaces[name]
        if not ifaces:
            raise ValueError(f"host {name!r} has no link")
        ifname, addr = ifaces[0]
        if via is not None:
            ends = self.links.get(frozenset((name, via)))
            if ends is None or via == name:
                raise ValueError(f"no link between hosts {name!r} and {via!r}")
            ifname, addr = next((i, ad) for h, i, ad in ends if h == name)
        return Host(name, self.namespaces[name], f"{PREFIX}-host-{name}-{self.tag}", ifname, addr, tuple(ifaces))

    def set_link(self, a: str, b: str, *, up: bool) -> None:
        """Take the link between ``a`` and ``b`` down (both ends: nothing gets through, sockets stay) or up."""
        for host, ifname, _ in self.links[frozenset((a, b))]:
            _ip("link", "set", ifname, "up" if up else "down", netns=self.namespaces[host])

    def leftovers(self) -> list[str]:
        """Namespaces and root-namespace veths of this network that still exist (empty after close)."""
        left = [n for n in self.namespaces.values() if os.path.exists(os.path.join(NETNS_DIR, n))]
        left += [v for v in self.veths if os.path.exists(f"/sys/class/net/{v}")]
        return left

    def close(self) -> None:
        """Delete every namespace (which destroys the veths inside) and any veth still in the root
        namespace. Idempotent; never raises for what is already gone."""
        self.closed = True
        for netns in self.namespaces.values():
            _ip("netns", "del", netns, check=False)
        for v in self.veths:
            if os.path.exists(f"/sys/class/net/{v}"):
                _ip("link", "del", v, check=False)


@contextlib.contextmanager
def two_hosts(*, third: bool = False) -> Iterator[Network]:
    """Hosts ``a`` and ``b`` joined by a veth pair (198.18.0.1 / .2); with ``third``, a host ``c`` linked to
    ``a`` by a second pair (198.18.1.2 -> 198.18.1.1: ``a``'s other interface). Removed on exit."""
    net = Network()
    try:
        for name in ("a", "b", "c") if third else ("a", "b"):
            net.add_host(name)
        net.add_link("a", "b")
        if third:
            net.add_link("a", "c")
        yield net
    finally:
        net.close()
