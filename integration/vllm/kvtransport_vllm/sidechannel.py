"""Threads of the scheduler side channel: a server (prefill role) and per-peer clients (decode role).

Neither blocks the scheduler: everything received lands in an ``inbox`` queue that the scheduler drains once
per step, and everything sent goes through a per-connection outbound queue with its own writer thread.
Inbox events (tuples)::

    ("hello", engine_id, hello_msg)      server: a decode engine connected (carries its workers' metadata)
    ("msg", engine_id, msg)              server: a dst / cancel / renew message from that engine
    ("bye", engine_id, reason)           server: that engine's connection ended (it died or closed)
    ("fail", seq, reason)                client: the prefill side cannot serve ``seq`` (or is unreachable)
    ("lost", (host, port), reason)       client: an established connection to that prefill ended
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtransport.sidechannel import block_with_send_bound, enable_keepalive

from .protocol import PROTOCOL_VERSION, ProtocolFailure, describe_mismatch, recv_message, send_message

log = logging.getLogger("vllm.kvtransport")

Inbox = queue.Queue[tuple[Any, ...]]  # see module docstring
CompatFn = Callable[[], tuple[str, dict[str, Any]]]




class _Conn:
    """One established connection: a writer thread draining ``out`` and a reader loop run by the owner.

    Reads block (the reader loop is woken by ``close``); each send is bounded by ``send_timeout`` (a peer that
    is alive but stopped reading fails the connection instead of blocking the writer for ever), and TCP
    keepalive probes a silent peer."""

    def __init__(self, sock: socket.socket, label: str, send_timeout: float) -> None:
        block_with_send_bound(sock, send_timeout)
        enable_keepalive(sock)  # a silent peer host is declared lost after ~25 s (kvtransport.sidechannel)
        self.sock = sock
        self.label = label
        self.out: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.closed = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name=f"kvt-sc-w-{label}", daemon=True)
        self._writer.start()

    def send(self, msg: dict[str, Any]) -> None:
        if not self.closed.is_set():
            self.out.put(msg)

    def _write_loop(self) -> None:
        while True:
            msg = self.out.get()
            if msg is None or self.closed.is_set():
                return
            try:
                send_message(self.sock, msg)
            except (OSError, ProtocolFailure) as exc:
                log.warning("side channel to %s: send failed: %s", self.label, exc)
                self.close()
                return

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        self.out.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class SideChannelServer:
    """Listens on ``(address, port)``; accepts decode engines after a compatibility check.

    Started by the prefill (producer) scheduler. ``send(engine_id, msg)`` is non-blocking.
    """

    def __init__(self, address: str, port: int, engine_id: str, compat: CompatFn, inbox: Inbox,
                 timeout: float, lease: float = 0.0,
                 answer_now: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None) -> None:
        """``answer_now(msg)``, called on the connection's reader thread for each message: a reply to send at
        once instead of queueing ``msg`` for the scheduler (which runs only while its engine steps), or None."""
        self.engine_id = engine_id
        self._answer_now = answer_now
        self.lease = lease
        self._compat = compat
        self._inbox = inbox
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conns: dict[str, _Conn] = {}
        self._closed = False
        self._sock = socket.create_server((address, port), reuse_port=False)
        self.host, self.port = self._sock.getsockname()[:2]
        threading.Thread(target=self._accept_loop, name="kvt-sc-accept", daemon=True).start()

    def send(self, engine_id: str, msg: dict[str, Any]) -> bool:
        """Queue ``msg`` for ``engine_id``; False when that engine is not connected."""
        with self._lock:
            conn = self._conns.get(engine_id)
        if conn is None or conn.closed.is_set():
            return False
        conn.send(msg)
        return True

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), name="kvt-sc-in",
                             daemon=True).start()

    def _serve(self, sock: socket.socket, label: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        engine = None
        why = "connection ended"
        try:
            sock.settimeout(self._timeout)
            hello = recv_message(sock)
            if hello.get("type") != "hello":
                raise ProtocolFailure(f"expected hello, got {hello.get('type')!r}")
            ours, info = self._compat()
            reason = None
            if hello.get("version") != PROTOCOL_VERSION:
                reason = f"side-channel protocol version {hello.get('version')} != ours {PROTOCOL_VERSION}"
            elif hello.get("compat") != ours:
                reason = "incompatible KV caches: " + describe_mismatch(info, hello.get("compat_info") or {})
            if reason is not None:
                log.error("refusing decode engine %s from %s: %s", hello.get("engine_id"), label, reason)
                send_message(sock, {"type": "refuse", "version": PROTOCOL_VERSION, "reason": reason})
                return
            engine = str(hello["engine_id"])
            send_message(sock, {"type": "welcome", "version": PROTOCOL_VERSION, "engine_id": self.engine_id,
                                "compat": ours, "compat_info": info, "lease": self.lease})
            conn = _Conn(sock, label, self._timeout)
            with self._lock:
                old = self._conns.pop(engine, None)
                self._conns[engine] = conn
            if old is not None:
                old.close()
            self._inbox.put(("hello", engine, hello))
            while True:
                msg = recv_message(sock)
                reply = self._answer_now(msg) if self._answer_now is not None else None
                if reply is not None:
                    conn.send(reply)
                else:
                    self._inbox.put(("msg", engine, msg))
        except (OSError, ProtocolFailure, KeyError) as exc:
            why = str(exc)
            if not self._closed:
                log.info("side channel from %s (engine %s) ended: %s", label, engine, exc)
        finally:
            current = False
            with self._lock:
                conn2 = self._conns.get(engine) if engine else None
                if engine is not None and conn2 is not None and conn2.sock is sock:
                    del self._conns[engine]
                    conn2.close()
                    current = True
            if current and not self._closed:  # not replaced by a newer connection of the same engine
                self._inbox.put(("bye", engine, why))
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()


class PeerClient:
    """A decode scheduler's connection to one prefill scheduler at ``host:port``. Never blocks the caller.

    Connects on a thread (retrying until ``timeout``), says hello, then forwards queued messages. If the
    peer refuses or cannot be reached, every queued or later ``dst`` message turns into ``("fail", seq,
    reason)`` events, so the requests take vLLM's failure path instead of waiting for a timeout.
    """

    def __init__(self, host: str, port: int, hello: Callable[[], dict[str, Any]], compat: CompatFn,
                 inbox: Inbox, timeout: float) -> None:
        self.host, self.port = host, int(port)
        self.label = f"{host}:{port}"
        self._hello = hello
        self._compat = compat
        self._inbox = inbox
        self._timeout = timeout
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []
        self._conn: _Conn | None = None
        self.error: str | None = None
        self.peer_engine: str | None = None
        self.peer_lease: float | None = None
        threading.Thread(target=self._run, name=f"kvt-sc-c-{self.label}", daemon=True).start()

    @property
    def dead(self) -> bool:
        return self.error is not None

    def send(self, msg: dict[str, Any]) -> None:
        """Queue ``msg`` (sent once connected; failed at once when the peer is dead)."""
        with self._lock:
            if self.error is None:
                if self._conn is None:
                    self._pending.append(msg)
                    return
                conn = self._conn
            else:
                conn = None
        if conn is None:
            self._fail_msgs([msg], self.error or "peer unreachable")
        else:
            conn.send(msg)

    def _fail_msgs(self, msgs: list[dict[str, Any]], reason: str) -> None:
        for m in msgs:
            if m.get("type") == "dst":
                for d in m.get("dsts", []):
                    self._inbox.put(("fail", d["seq"], reason))

    def _die(self, reason: str) -> None:
        with self._lock:
            if self.error is None:
                self.error = reason
            pending, self._pending = self._pending, []
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        self._fail_msgs(pending, reason)

    def _run(self) -> None:
        deadline = time.monotonic() + self._timeout
        sock = None
        delay = 0.05
        while sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
            except OSError as exc:
                if time.monotonic() + delay > deadline:
                    self._die(f"cannot reach prefill side channel {self.label}: {exc}")
                    return
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._timeout)
            send_message(sock, self._hello())
            reply = recv_message(sock)
            if reply.get("type") == "refuse":
                raise ProtocolFailure(f"prefill {self.label} refused us: {reply.get('reason')}")
            if reply.get("type") != "welcome" or reply.get("version") != 1:
                raise ProtocolFailure(f"unexpected handshake reply {reply.get('type')!r} from {self.label}")
            ours, info = self._compat()
            if reply.get("compat") != ours:
                raise ProtocolFailure(
                    f"prefill {self.label} is incompatible: {describe_mismatch(info, reply.get('compat_info') or {})}")
            self.peer_engine = str(reply.get("engine_id"))
            lease = reply.get("lease")
            self.peer_lease = float(lease) if isinstance(lease, (int, float)) and lease > 0 else None
        except (OSError, ProtocolFailure) as exc:
            log.error("kvtransport side channel: %s", exc)
            sock.close()
            self._die(str(exc))
            return
        conn = _Conn(sock, self.label, self._timeout)
        with self._lock:
            self._conn = conn
            pending, self._pending = self._pending, []
        for m in pending:
            conn.send(m)
        try:
            while True:
                msg = recv_message(sock)
                if msg.get("type") == "fail":
                    for seq in msg.get("seqs", []):
                        self._inbox.put(("fail", seq, str(msg.get("reason", "prefill failed"))))
        except (OSError, ProtocolFailure) as exc:
            reason = f"side channel to prefill {self.label} lost: {exc}"
            closed = self.error is not None
            self._die(reason)
            if not closed:  # the prefill went away (not our close()): its transfers cannot complete
                self._inbox.put(("lost", (self.host, self.port), reason))

    def close(self) -> None:
        self._die("closed")
