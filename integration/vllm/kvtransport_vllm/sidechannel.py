"""Threads of the scheduler side channel: a server (prefill role) and per-peer clients (decode role).

Neither blocks the scheduler: everything received lands in an ``inbox`` queue that the scheduler drains once
per step, and a send is written by the calling thread when the socket takes it at once (no thread hand-off on
the latency path), else queued for the connection's writer thread. Inbox events (tuples)::

    ("hello", engine_id, hello_msg)      server: a decode engine connected (carries its workers' metadata)
    ("msg", engine_id, msg)              server: a dst / cancel / renew message from that engine
    ("bye", engine_id, reason)           server: that engine's connection ended (it died or closed)
    ("fail", seq, reason)                client: the prefill side cannot serve ``seq`` (or is unreachable)
    ("ready", (host, port), xfers)       client: that prefill is about to compute these transfers (allocate now)
    ("lost", (host, port), reason)       client: an established connection to that prefill ended
    ("senders", (host, port), senders)   client: that prefill's workers' kvtransport instance ids (rank -> id)
    ("first", (host, port), xfer, token) client: that prefill sampled ``token`` as the first token of ``xfer``
    ("workers", (host, port), worker_at) client: that prefill's workers' destination channels (rank -> (host, port))

A prefill *worker* runs a server too (``compat=None``): its destination channel, which takes ``dst`` messages
straight from decodes (no compatibility check: the scheduler's channel made it; the secret is proved the same
way). Its events go to the pusher's queue. A decode reaches it with a ``PeerClient(..., worker=True)``, whose
end fails nothing (the prefill's scheduler still forwards every destination to its workers).
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvtransport.admission import Admission, PendingHello, RateLimitedLog
from kvtransport.sidechannel import block_with_send_bound, enable_keepalive

from .protocol import (
    MAX_HELLO,
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    REFUSED,
    AuthFailure,
    ConnectionClosed,
    MalformedMessage,
    ProtocolFailure,
    check_hello,
    check_message,
    check_senders,
    check_worker_at,
    describe_mismatch,
    encode_message,
    is_sealed,
    new_nonce,
    parse_message,
    parse_nonce,
    recv_frame,
    recv_message,
    seal,
    send_frame,
    send_message,
    unseal,
)

log = logging.getLogger("vllm.kvtransport")

Inbox = queue.Queue[Any]  # tuples: see the module docstring
CompatFn = Callable[[], tuple[str, dict[str, Any]]]
MAX_HANDSHAKES = 32
"""Authenticated handshakes (compatibility check, welcome) running at once; more wait in the admission queue."""
PREAUTH_TIMEOUT_S = 10.0
"""A connection must send its hello this soon (or within the connect timeout, if shorter)."""
MAX_BACKLOG_BYTES = 64 << 20
"""Bytes queued for one connection that its peer has not read; more fail the connection (a stalled peer)."""
MAX_INBOX = 65536
"""Events waiting for the scheduler; a peer's reader waits (up to the connection timeout) while that many wait,
then the connection is dropped (a peer that floods)."""
RECONNECT_PROBE_S = 1.0
"""How long a hello under an engine id that is still connected waits for the old connection's answer to a
ping: answered, the newcomer is refused (the id is taken); not answered, the old connection is closed and the
newcomer takes the id (a restarted instance gets in within this long)."""
_LENGTH = struct.Struct("!I")

class _Conn:
    """One established connection: sends written at once by the caller when the socket takes them (else queued
    for a writer thread, in order), and a reader loop run by the owner.

    Reads block (the reader loop is woken by ``close``); each queued send is bounded by ``send_timeout`` (a peer
    that is alive but stopped reading fails the connection instead of blocking the writer for ever), at most
    MAX_BACKLOG_BYTES wait, and TCP keepalive probes a silent peer."""

    def __init__(self, sock: socket.socket, label: str, send_timeout: float) -> None:
        block_with_send_bound(sock, send_timeout)
        enable_keepalive(sock)  # a silent peer host is declared lost after ~25 s (kvtransport.sidechannel)
        self.sock = sock
        self.label = label
        self.closed = threading.Event()
        self._wlock = threading.Condition()
        self._backlog: deque[bytes] = deque()
        self._queued = 0
        self._writing = False  # the writer thread holds a frame: a direct send now would overtake it
        self.pong = ""  # the token of the last pong received (server side; see SideChannelServer._old_conn_gone)
        self._writer = threading.Thread(target=self._write_loop, name=f"kvt-sc-w-{label}", daemon=True)
        self._writer.start()

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` without blocking: written now when nothing is queued and the socket takes it, else
        queued. A message too large for the protocol is dropped (logged); a full backlog closes the connection."""
        try:
            data = encode_message(msg)
        except ProtocolFailure as exc:
            log.error("side channel to %s: %s; not sent", self.label, exc)
            return
        with self._wlock:
            if self.closed.is_set():
                return
            if not self._backlog and not self._writing:
                try:
                    sent = self.sock.send(data, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                except OSError:
                    sent = 0  # the writer meets the error and closes the connection
                if sent == len(data):
                    return
                data = data[sent:]
            if self._queued + len(data) > MAX_BACKLOG_BYTES:
                overflow = True
            else:
                overflow = False
                self._backlog.append(data)
                self._queued += len(data)
                self._wlock.notify()
        if overflow:
            log.warning("side channel to %s: %d bytes unread by the peer; closing", self.label, self._queued)
            self.close()

    def _write_loop(self) -> None:
        while True:
            with self._wlock:
                while not self._backlog and not self.closed.is_set():
                    self._wlock.wait()
                if self.closed.is_set():
                    return
                data = self._backlog.popleft()
                self._queued -= len(data)
                self._writing = True
            try:
                self.sock.sendall(data)
            except OSError as exc:
                log.warning("side channel to %s: send failed: %s", self.label, exc)
                self.close()
                return
            finally:
                with self._wlock:
                    self._writing = False

    def close(self) -> None:
        with self._wlock:
            if self.closed.is_set():
                return
            self.closed.set()
            self._backlog.clear()
            self._queued = 0
            self._wlock.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _deliver(inbox: Inbox, event: tuple[Any, ...], timeout: float) -> None:
    """Put a peer's ``event`` in the scheduler's inbox; while MAX_INBOX events wait there, the peer's reader
    waits (at most ``timeout``: TCP then pushes back on the peer). Raises ProtocolFailure (the caller drops the
    connection) when the scheduler does not drain it in time. The scheduler's own events never wait."""
    deadline = time.monotonic() + timeout
    while inbox.qsize() >= MAX_INBOX:
        if time.monotonic() > deadline:
            raise ProtocolFailure(f"{MAX_INBOX} side-channel events wait for the scheduler: dropping a peer "
                                  "that floods")
        time.sleep(0.01)
    inbox.put(event)


class SideChannelServer:
    """Listens on ``(address, port)``; accepts decode engines that prove ``secret`` (when set) and pass the
    compatibility check (see :mod:`.protocol` for the handshake).

    Started by the prefill (producer) scheduler. ``send(engine_id, msg)`` is non-blocking. Only checked
    messages (``check_hello`` / ``check_message``) reach the inbox; a malformed one is dropped and counted in
    ``dropped``, the connection stays. Connections are admitted as the core's are
    (:class:`kvtransport.admission.Admission`): until its hello is complete and (with a secret) proved, a
    connection costs no thread and at most what it sent of one ``MAX_HELLO`` frame, within
    ``PREAUTH_TIMEOUT_S``; an accept error or a thread that cannot start is logged and survived.
    """

    def __init__(self, address: str, port: int, engine_id: str, compat: CompatFn | None, inbox: Inbox,
                 timeout: float, lease: float = 0.0,
                 answer_now: Callable[[str, dict[str, Any]], dict[str, Any] | None] | None = None,
                 secret: bytes | None = None, senders: Callable[[], dict[str, str]] | None = None,
                 worker_at: Callable[[], dict[str, list[Any]]] | None = None, name: str = "kvt-sc-accept") -> None:
        """``answer_now(engine, msg)``, called on the connection's reader thread for each checked message: a
        reply to send at once instead of queueing ``msg`` for the scheduler (which runs only while its engine
        steps), or None. ``senders()``: tp rank (str) -> the kvtransport instance id of our worker of that rank,
        and ``worker_at()``: tp rank (str) -> [host, port] of that worker's destination channel, both told to
        each decode in the welcome. ``compat`` None: a worker's destination channel (no compatibility check)."""
        self._senders = senders
        self._worker_at = worker_at
        self.engine_id = engine_id
        self._secret = secret
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.dropped = 0  # malformed messages from authenticated peers
        self.refused = 0  # handshakes refused (unauthenticated, incompatible or malformed)
        self._answer_now = answer_now
        self.lease = lease
        self._compat = compat
        self._inbox = inbox
        self._timeout = timeout
        self._lock = threading.Lock()
        self._conns: dict[str, _Conn] = {}
        self._closed = False
        self._sock = socket.create_server((address, port), reuse_port=False, backlog=1024)
        self.host, self.port = self._sock.getsockname()[:2]
        self._logs = RateLimitedLog(log)
        self.admission = Admission(self._sock, greet=_greet, header_size=_LENGTH.size,
                                   message_length=lambda header: int(_LENGTH.unpack(header)[0]),
                                   on_hello=self._on_hello, preauth_timeout=min(timeout, PREAUTH_TIMEOUT_S),
                                   max_hello_bytes=MAX_HELLO, name=name)
        self.admission.start()

    def send(self, engine_id: str, msg: dict[str, Any]) -> bool:
        """Queue ``msg`` for ``engine_id``; False when that engine is not connected."""
        with self._lock:
            conn = self._conns.get(engine_id)
        if conn is None or conn.closed.is_set():
            return False
        conn.send(msg)
        return True

    def _on_hello(self, pending: PendingHello) -> bool | None:
        """Admission thread: a connection sent its complete hello. A stranger is refused here, told nothing
        but that (no thread, no compatibility fields); the rest of the handshake runs on a thread of its own.
        True when taken, False while MAX_HANDSHAKES run (offered again), None when refused."""
        try:
            if pending.leftover:
                raise AuthFailure("sent more than its hello before the welcome")
            hello = unseal(pending.payload, self._secret, pending.nonce)  # the HMAC first, on the raw bytes
            if hello.get("type") != "hello":
                raise AuthFailure(f"expected hello, got {str(hello.get('type'))[:32]!r}")
        except (AuthFailure, MalformedMessage) as exc:  # a stranger: told nothing but that it was refused
            self.refused += 1
            self._logs.log(logging.WARNING, "unauthenticated", "refusing a side-channel peer from %s: "
                           "unauthenticated: %s", pending.label, exc)
            _tell_and_close(pending.sock, {"type": "refuse", "version": PROTOCOL_VERSION, "reason": REFUSED})
            return None
        if self._closed:
            pending.sock.close()
            return None
        if not self._handshakes.acquire(blocking=False):
            return False
        try:
            threading.Thread(target=self._serve, args=(pending.sock, pending.label, hello), name="kvt-sc-in",
                             daemon=True).start()
        except RuntimeError as exc:  # no thread could be started now: refuse this one, keep serving
            self._handshakes.release()
            self._logs.log(logging.WARNING, "spawn", "side channel: cannot start a thread for %s (%s); closed",
                           pending.label, exc)
            pending.sock.close()
            return None
        return True

    def _refuse(self, sock: socket.socket, label: str, engine: object, reason: str, told: str,
                retry: bool = False) -> None:
        """Tell the peer it is refused; ``retry``: what refused it may pass (the peer may try again)."""
        self.refused += 1
        self._logs.log(logging.ERROR, "refused", "refusing decode engine %s from %s: %s", str(engine)[:64], label,
                       reason)
        send_message(sock, {"type": "refuse", "version": PROTOCOL_VERSION, "reason": told, "retry": retry})

    def _handshake(self, sock: socket.socket, label: str,
                   hello: dict[str, Any]) -> tuple[dict[str, Any], _Conn] | None:
        """Check the (authenticated) hello; take the engine id for this connection, registered before the welcome
        leaves (so a second handshake of the same id, however close behind, finds it held); returns the checked
        hello and the connection, or None when refused (the peer was told)."""
        ours, info = self._compat() if self._compat is not None else (None, {})
        try:
            if hello.get("version") != PROTOCOL_VERSION:
                raise MalformedMessage(f"side-channel protocol version {str(hello.get('version'))[:16]} != ours "
                                       f"{PROTOCOL_VERSION}")
            checked = check_hello(hello)
            checked["nonce"] = parse_nonce(hello.get("nonce"))
        except ProtocolFailure as exc:
            self._refuse(sock, label, hello.get("engine_id"), str(exc), f"malformed hello: {exc}")
            return None
        if self._compat is not None and hello.get("compat") != ours:  # our log has the values; the peer the names
            raw = hello.get("compat_info")
            theirs: dict[str, Any] = raw if isinstance(raw, dict) else {}
            self._refuse(sock, label, checked["engine_id"], "incompatible KV caches: " + describe_mismatch(info, theirs),
                         "incompatible KV caches, fields that differ: "
                         + describe_mismatch(info, theirs, values=False))
            return None
        engine = checked["engine_id"]
        conn = old = None
        if self._old_conn_gone(engine):  # a second peer under a live engine's id is refused
            with self._lock:  # (and one whose handshake got in meanwhile)
                old = self._conns.get(engine)
                if old is None or old.closed.is_set():
                    conn = self._conns[engine] = _Conn(sock, label, self._timeout)
        if conn is None:
            self._refuse(sock, label, engine, "an engine with this id is connected and alive",
                         f"engine id {str(engine)[:64]} is already connected", retry=True)
            return None
        if old is not None:  # the probe's loser: closed already
            old.close()
        welcome: dict[str, Any] = {"type": "welcome", "version": PROTOCOL_VERSION, "engine_id": self.engine_id}
        if self._compat is not None:  # the scheduler's channel (a worker's destination channel checks nothing)
            welcome.update(compat=ours, compat_info=info, lease=self.lease,
                           senders=self._senders() if self._senders else {},
                           worker_at=self._worker_at() if self._worker_at else {})
        try:
            send_frame(sock, seal(welcome, self._secret, checked.pop("nonce")))
        except BaseException:
            with self._lock:
                if self._conns.get(engine) is conn:
                    del self._conns[engine]
            conn.close()
            raise
        return checked, conn

    def _serve(self, sock: socket.socket, label: str, authenticated: dict[str, Any]) -> None:
        engine = None
        why = "connection ended"
        try:
            try:
                sock.setblocking(True)
                sock.settimeout(self._timeout)
                taken = self._handshake(sock, label, authenticated)
            finally:
                self._handshakes.release()
            if taken is None:
                return
            hello, conn = taken
            engine = hello["engine_id"]
            _deliver(self._inbox, ("hello", engine, hello), self._timeout)
            while True:
                try:
                    msg = check_message(recv_message(sock))
                except MalformedMessage as exc:
                    self.dropped += 1
                    log.warning("side channel from %s (engine %s): dropped a message: %s", label, engine, exc)
                    continue
                if msg["type"] == "pong":
                    conn.pong = msg["token"]
                    continue
                reply = self._answer_now(engine, msg) if self._answer_now is not None else None
                if reply is not None:
                    conn.send(reply)
                else:
                    _deliver(self._inbox, ("msg", engine, msg), self._timeout)
        except (OSError, ProtocolFailure) as exc:
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

    def _old_conn_gone(self, engine: str) -> bool:
        """Whether no live connection of decode ``engine`` remains, so a newcomer may take the id. The
        connection holding it is pinged with a fresh token: a peer that answers with a ``pong`` carrying it
        within RECONNECT_PROBE_S is alive and keeps the id (the newcomer is refused); one that does not (gone,
        hung, or an impostor that took the id and does not play along) is closed and loses it. Handshake thread;
        bounded by RECONNECT_PROBE_S."""
        with self._lock:
            old = self._conns.get(engine)
        if old is None or old.closed.is_set():
            return True
        token = new_nonce().hex()
        old.send({"type": "ping", "token": token})
        deadline = time.monotonic() + min(RECONNECT_PROBE_S, self._timeout)
        while time.monotonic() < deadline:
            with self._lock:
                current = self._conns.get(engine)
            if current is not old or old.closed.is_set():
                return True
            if old.pong == token:
                return False
            time.sleep(0.01)
        log.warning("decode engine %s did not answer a ping within %.1f s: its connection is closed and the id "
                    "goes to the newcomer", str(engine)[:64], RECONNECT_PROBE_S)
        old.close()
        return True

    def close(self) -> None:
        self._closed = True
        self.admission.close()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            c.close()


def _greet() -> tuple[bytes, bytes]:
    """A fresh nonce and the challenge message carrying it (sent to each connection on accept)."""
    nonce = new_nonce()
    body = json.dumps({"type": "challenge", "version": PROTOCOL_VERSION, "nonce": nonce.hex()},
                      separators=(",", ":")).encode()
    return nonce, _LENGTH.pack(len(body)) + body


def _tell_and_close(sock: socket.socket, msg: dict[str, Any]) -> None:
    """Best effort: one small non-blocking write of ``msg``, then close (a connection still being admitted)."""
    try:
        body = json.dumps(msg, separators=(",", ":")).encode()
        sock.setblocking(False)
        sock.send(_LENGTH.pack(len(body)) + body)
    except OSError:
        pass
    finally:
        sock.close()


class _Retry(Exception):
    """A handshake attempt failed in a way a later attempt may not (see PeerClient._connect_once); its
    message is the reason."""


class PeerClient:
    """A decode scheduler's connection to one prefill scheduler at ``host:port``. Never blocks the caller.

    Connects on a thread (retrying until ``timeout``), says hello, then forwards queued messages. If the
    peer refuses or cannot be reached, every queued or later ``dst`` message turns into ``("fail", seq,
    reason)`` events, so the requests take vLLM's failure path instead of waiting for a timeout.

    ``worker``: a link to a prefill worker's destination channel instead. It checks no compatibility (the
    scheduler's channel did), takes nothing from the peer, and its failure fails nothing: what it could not
    deliver reaches the workers through their scheduler.
    """

    def __init__(self, host: str, port: int, hello: Callable[[], dict[str, Any]], compat: CompatFn,
                 inbox: Inbox, timeout: float, secret: bytes | None = None, worker: bool = False) -> None:
        self.worker = worker
        self._secret = secret
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
        if self.worker:  # the scheduler's channel carries the same destinations
            return
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
        delay = 0.05
        warned = False  # the first retry is logged as a warning, later ones at debug level
        while True:
            try:
                sock = self._connect_once(deadline)
                break
            except _Retry as exc:  # a busy or restarting prefill: try again while the connect timeout lasts
                if time.monotonic() + delay > deadline:
                    log.error("kvtransport side channel: %s", str(exc))
                    self._die(str(exc))
                    return
                log.log(logging.DEBUG if warned else logging.WARNING,
                        "kvtransport side channel: %s; retrying for %.0f s more", str(exc),
                        deadline - time.monotonic())
                warned = True
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except ProtocolFailure as exc:  # refused, incompatible, unauthenticated: final
                log.error("kvtransport side channel: %s", exc)
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
                if self.worker:  # a worker's channel sends nothing we act on but a ping: answered, the rest dropped
                    try:
                        ping = recv_message(sock, MAX_HELLO)
                    except MalformedMessage:
                        continue
                    self._pong(conn, ping)
                    continue
                try:
                    msg = recv_message(sock)
                    seqs, xfers = msg.get("seqs", []), msg.get("xfers", [])
                    if not isinstance(seqs, list) or not isinstance(xfers, list):
                        raise MalformedMessage("seqs / xfers must be lists")
                except MalformedMessage as exc:
                    log.warning("side channel to prefill %s: dropped a message: %s", self.label, exc)
                    continue
                mtype = msg.get("type")
                if mtype == "ping":
                    self._pong(conn, msg)
                elif mtype == "fail":
                    for seq in seqs:
                        _deliver(self._inbox, ("fail", str(seq)[:MAX_ID_CHARS],
                                               str(msg.get("reason", "prefill failed"))[:2000]), self._timeout)
                elif mtype == "ready":
                    _deliver(self._inbox, ("ready", (self.host, self.port), [str(x)[:MAX_ID_CHARS] for x in xfers]),
                             self._timeout)
                elif mtype == "first":
                    xfer, token = msg.get("xfer"), msg.get("token")
                    if not isinstance(xfer, str) or not 0 < len(xfer) <= MAX_ID_CHARS or isinstance(token, bool) \
                            or not isinstance(token, int) or not 0 <= token < 1 << 31:
                        log.warning("side channel to prefill %s: dropped a malformed first-token message", self.label)
                        continue
                    _deliver(self._inbox, ("first", (self.host, self.port), xfer, token), self._timeout)
        except (OSError, ProtocolFailure) as exc:
            reason = f"side channel to prefill {self.label} lost: {exc}"
            closed = self.error is not None
            self._die(reason)
            if not closed and not self.worker:  # the prefill went away (not our close()): its transfers cannot complete
                self._inbox.put(("lost", (self.host, self.port), reason))

    @staticmethod
    def _pong(conn: _Conn, msg: dict[str, Any]) -> None:
        """Answer a prefill's ping (it proves this connection still holds our engine id there)."""
        token = msg.get("token")
        if msg.get("type") == "ping" and isinstance(token, str) and len(token) <= 128:
            conn.send({"type": "pong", "token": token})

    def _connect_once(self, deadline: float) -> socket.socket:
        """One connect and handshake, bounded by ``deadline``: the connected socket (welcome checked). Raises
        _Retry for what a later attempt may fix (unreachable, reset, closed or timed out before the welcome, a
        refusal the prefill marks ``retry``) and ProtocolFailure for what it cannot (refused, incompatible,
        unauthenticated, another protocol)."""
        try:
            sock = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
        except OSError as exc:
            raise _Retry(f"cannot reach prefill side channel {self.label}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(max(0.1, min(self._timeout, deadline - time.monotonic())))
            challenge = recv_message(sock, MAX_HELLO)
            if challenge.get("type") != "challenge" or challenge.get("version") != PROTOCOL_VERSION:
                raise ProtocolFailure(f"unexpected handshake opening {str(challenge.get('type'))[:32]!r} (protocol "
                                      f"{str(challenge.get('version'))[:16]}, ours {PROTOCOL_VERSION}) from "
                                      f"{self.label}: run the same kvtransport-vllm version on both sides")
            ours_nonce = new_nonce()
            send_frame(sock, seal({**self._hello(), "nonce": ours_nonce.hex()}, self._secret,
                                  parse_nonce(challenge.get("nonce"))))
            payload = recv_frame(sock, MAX_HELLO)
            if not is_sealed(payload):  # a refusal comes unsealed; anything else unsealed fails unseal() below
                frame = parse_message(payload)
                if frame.get("type") == "refuse":
                    reason = f"prefill {self.label} refused us: {str(frame.get('reason'))[:2000]}"
                    if frame.get("retry") is True:
                        raise _Retry(reason)
                    raise ProtocolFailure(reason)
            try:
                reply = unseal(payload, self._secret, ours_nonce)
            except AuthFailure:
                raise ProtocolFailure(f"prefill {self.label} did not prove KV_TRANSPORT_SECRET (set the same "
                                      "secret on both sides)") from None
            if reply.get("type") != "welcome":
                raise ProtocolFailure(f"unexpected sealed reply {str(reply.get('type'))[:32]!r} from {self.label}")
            if reply.get("version") != PROTOCOL_VERSION:
                raise ProtocolFailure(f"prefill {self.label} speaks side-channel protocol "
                                      f"{str(reply.get('version'))[:16]}, ours {PROTOCOL_VERSION}")
            self.peer_engine = str(reply.get("engine_id"))[:MAX_ID_CHARS]
            if self.worker:
                sock.settimeout(self._timeout)
                return sock
            ours, info = self._compat()
            if reply.get("compat") != ours:
                raise ProtocolFailure(
                    f"prefill {self.label} is incompatible: {describe_mismatch(info, reply.get('compat_info') or {})}")
            senders = check_senders(reply.get("senders"))
            if senders:
                self._inbox.put(("senders", (self.host, self.port), senders))
            worker_at = check_worker_at(reply.get("worker_at"))
            if worker_at:
                self._inbox.put(("workers", (self.host, self.port), worker_at))
            lease = reply.get("lease")
            self.peer_lease = float(lease) if isinstance(lease, (int, float)) and lease > 0 else None
            sock.settimeout(self._timeout)
            return sock
        except (OSError, ConnectionClosed) as exc:
            sock.close()
            raise _Retry(f"handshake with prefill side channel {self.label} broke off: {exc}") from None
        except BaseException:
            sock.close()
            raise

    def close(self) -> None:
        self._die("closed")
