"""Run a sender and a receiver in two real processes (spawn) and collect their results.

Each role is a function ``fn(link: RoleLink, cfg: dict) -> dict`` importable by module path. The receiver
publishes its metadata with ``link.publish(bytes)``; the sender gets it with ``link.peer_metadata()``.
``link.barrier(name)`` lets a role wait until the other reached the same named point. A role that hangs
past the deadline is killed after dumping its stacks (faulthandler), and the harness raises.

``hosts`` puts a role on a host of its own (:class:`kvtransport.workload.netns.Host`: a network namespace,
hostname and NET_IFNAME); ``at_barrier`` runs a function in the parent while both roles stand at a named
barrier (e.g. take a link down), before either is released.
past the deadline is killed after dumping its stacks (faulthandler), and the harness raises. A role that
raises is reported as :class:`RoleFailed`, which carries the role's own exception when it could travel
(a KVTransportError always can), so a caller can show that error as if it had been raised locally.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .netns import Host


class HarnessError(AssertionError):
    """A role failed, crashed or hung; the message carries its traceback or stack dump."""


class RoleFailed(HarnessError):
    """A role raised. ``role``: which; ``error``: the exception it raised, rebuilt in this process (None when
    it could not be pickled); the message carries the role's traceback as well."""

    def __init__(self, role: str, error: BaseException | None, text: str) -> None:
        super().__init__(f"{role} failed:\n{text}")
        self.role = role
        self.error = error


class RoleLink:
    """A role's line to the parent process."""

    def __init__(self, conn: Connection, role: str) -> None:
        self.conn = conn
        self.role = role

    def publish(self, metadata: bytes) -> None:
        self.conn.send(("meta", metadata))

    def peer_metadata(self, timeout: float = 60.0) -> bytes:
        return bytes(self._expect("meta", timeout))

    def barrier(self, name: str, timeout: float = 60.0) -> None:
        self.conn.send(("barrier", name))
        got = self._expect("barrier", timeout)
        if got != name:
            raise HarnessError(f"{self.role}: barrier {name!r} met {got!r}")

    def send_value(self, value: Any) -> None:
        self.conn.send(("value", value))

    def recv_value(self, timeout: float = 60.0) -> Any:
        return self._expect("value", timeout)

    def _expect(self, kind: str, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise HarnessError(f"{self.role}: nothing from the other role within {timeout}s (waiting for {kind})")
        got_kind, value = self.conn.recv()
        if got_kind != kind:
            raise HarnessError(f"{self.role}: expected {kind}, got {got_kind}")
        return value


def _role_main(conn: Connection, role: str, target: str, cfg: dict[str, Any], hang_after: float,
               host: Host | None = None) -> None:
    try:
        if host is not None:  # first: namespaces are per thread, and the watchdog below is a thread
            host.enter()
    except BaseException as exc:
        conn.send(("error", f"could not enter host {host}: {type(exc).__name__}: {exc}"))
        return
    faulthandler.dump_traceback_later(hang_after, exit=True, file=sys.stderr)
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    try:
        module, _, name = target.rpartition(".")
        fn: Callable[[RoleLink, dict[str, Any]], dict[str, Any]] = getattr(importlib.import_module(module), name)
        result = fn(RoleLink(conn, role), cfg)
        conn.send(("result", result))
    except BaseException as exc:  # report everything to the parent
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        try:
            blob: bytes | None = pickle.dumps(exc.with_traceback(None))
        except Exception:  # an exception that does not pickle still reports its text
            blob = None
        conn.send(("error", (text, blob)))
    finally:
        faulthandler.cancel_dump_traceback_later()


def run_pair(
    receiver: str, sender: str, cfg: dict[str, Any], *, timeout: float = 120.0,
    hosts: Mapping[str, Host] | None = None, at_barrier: Mapping[str, Callable[[], None]] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``receiver`` and ``sender`` (dotted function paths) in two processes; return their results.

    Relays metadata, barriers and values between them. ``hosts`` maps a role to the host it runs on (see
    the module docstring); ``at_barrier`` maps a barrier name to a function the parent calls once both
    roles reached it (what it raises fails the pair). Raises HarnessError if either fails or the pair
    does not finish within ``timeout`` seconds (both are killed; no process is left behind)."""
    ctx = mp.get_context("spawn")
    ends = {}
    procs = {}
    for role, target in (("receiver", receiver), ("sender", sender)):
        parent, child = ctx.Pipe()
        host = (hosts or {}).get(role)
        p = ctx.Process(target=_role_main, args=(child, role, target, cfg, timeout - 5, host), name=f"kvt-{role}")
        p.start()
        child.close()
        ends[role], procs[role] = parent, p
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    other = {"receiver": "sender", "sender": "receiver"}
    pending_barrier: dict[str, str] = {}
    try:
        while len(results) < 2:
            if time.monotonic() > deadline:
                raise HarnessError(f"pair did not finish within {timeout}s; finished: {sorted(results)}")
            ready = mp.connection.wait([c for r, c in ends.items() if r not in results], timeout=0.5)
            for ready_conn in ready:
                role = next(r for r, c in ends.items() if c is ready_conn)
                conn = ends[role]
                try:
                    kind, value = conn.recv()
                except EOFError:
                    procs[role].join(timeout=5)  # reap it, so that its exit code is known
                    raise HarnessError(f"{role} died (exit code {procs[role].exitcode})") from None
                if kind == "result":
                    results[role] = value
                elif kind == "error":
                    text, blob = value
                    raise RoleFailed(role, _unpickle(blob), text)
                elif kind == "barrier":
                    value = str(value)
                    if pending_barrier.get(other[role]) is not None:
                        action = (at_barrier or {}).get(value)
                        if action is not None:
                            action()
                        ends[other[role]].send(("barrier", pending_barrier.pop(other[role])))
                        conn.send(("barrier", value))
                    else:
                        pending_barrier[role] = value
                else:  # meta / value: forward to the other role
                    ends[other[role]].send((kind, value))
            for role, p in procs.items():
                if role not in results and not p.is_alive() and not ends[role].poll():
                    raise HarnessError(f"{role} exited with code {p.exitcode} without a result")
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results["receiver"], results["sender"]


def _unpickle(blob: bytes | None) -> BaseException | None:
    """The role's exception from its pickle (the pipe is this test harness's own, between processes it
    spawned: nothing from a peer); None if it does not rebuild here."""
    if blob is None:
        return None
    try:
        exc = pickle.loads(blob)
    except Exception:
        return None
    return exc if isinstance(exc, BaseException) else None
