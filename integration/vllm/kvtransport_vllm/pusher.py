"""The pusher: the thread of a prefill worker that issues every put/signal/flush (see :mod:`.worker`).

It keeps the worker's :class:`~.pushplan.PushPlanner`: the step's sources (from the plan), each computed layer
(``save_kv_layer`` hands it over: the forward never waits on the network), and destinations, from the plan or
straight from a decode over the worker's destination channel, whichever comes first. What the planner makes due
it puts at once: everything already computed in one batched put when a destination binds late, then layer by
layer. On CUDA it issues its copies on a stream of its own that waits (on the device, not the host) for an event
recorded after the layer's kernels, so copies overlap the next layers' compute and never wait for work issued
after them (which the legacy default stream would); a released request is reported ``finished_sending`` once its
puts were flushed. All CommManager sender calls on a link happen on this thread (one thread per manager: the core's
outbound links are not thread-safe). Connects do not: each destination is connected on a thread of its own,
started as soon as the plan names the destination (bounded by ``connect_timeout``); meanwhile that
destination's puts and signals wait in its own backlog (at most ``MAX_BACKLOG``), replayed in order once
connected or failed if the connect fails, so an unreachable decode never delays the pushes to the others.

What a peer can make this worker hold is capped: links (a socket each) per decode engine (``MAX_LINKS_PER_PEER``)
and in all (``MAX_LINKS``: the least recently used idle link makes room for one a put needs), connect threads at
once (``MAX_CONNECTS``: further links wait their turn), reconnect backoffs remembered (``MAX_BROKEN``), refused
decode engines remembered (``MAX_REFUSED``). A decode engine whose geometry the worker refused (:mod:`.geometry`)
gets nothing: each of its destinations fails at once with the reason (the scheduler tells that decode).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from itertools import chain
from typing import Any

import kvtransport
from kvtransport import KVTransportError, Peer
from kvtransport.admission import RateLimitedLog

from . import trace
from .geometry import MAX_PEER_TP
from .metadata import Bind, Push, SendFailure
from .pushplan import PushPlanner, PutOp, SignalOp

log = logging.getLogger("vllm.kvtransport")

RECONNECT_BACKOFF = 10.0
EXPANDED = 1024
"""Planned pushes whose expansion (unit runs, one push per destination rank) is kept for the next layers."""
MAX_BACKLOG = 65536
"""Puts and signals queued for one destination while it connects; more fail at once."""
MAX_LINKS_PER_PEER = MAX_PEER_TP
"""Links to one decode engine (connected or connecting): one per rank of it this worker sends to, and a decode has at
most MAX_PEER_TP ranks. A hello listing 1,024 workers made this worker open 1,024 sockets and threads (issue 29)."""
MAX_LINKS = 256
"""Links to decode workers in all (connected or connecting; a socket each): 32 decode engines of TP 8, or 256
like-for-like ones. Past it a put that needs a new link closes the least recently used idle one (no unreleased
request put through it); a link an introduction asks for is not opened (its first put will open it)."""
MAX_CONNECTS = 32
"""Connect threads at once: each holds a socket and blocks up to ``connect_timeout`` on a decode that does not
answer (two made-up engines started 2,048 in 3 s, again every reconnect backoff). Further links wait in order."""
_STEP_JOBS = ("plan", "layer", "step_end")
"""Jobs of the step's push path (from our own scheduler and forward): one that raises fails the step's
destinations at once. Not the destination channel's ``msg`` (any decode can send one: its failure must not fail
another decode's pushes) nor ``peers`` (same)."""
MAX_BROKEN = 4 * MAX_LINKS
"""Reconnect backoffs remembered (expired ones go first, then the oldest)."""
MAX_REFUSED = 1024
"""Decode engines whose geometry was refused, remembered with why (the oldest is forgotten first, with its metadata:
nothing can be put to it then)."""
CAPPED = "capped: "
"""How the reason of a link refused for a cap begins."""

Link = tuple[str, int]
"""A destination worker: (decode engine id, its tp rank)."""


class Pusher:
    """The thread that issues every put/signal/flush of one worker (see the module docstring)."""

    def __init__(self, cm: kvtransport.CommManager, tp_rank: int, num_layers: int, timeout: float,
                 cuda: bool = False, group_of: list[int] | None = None, block_size: int = 16,
                 expand: Callable[[Push, dict[str, Any] | None], list[Push]] | None = None,
                 unlike: Callable[[dict[str, Any]], bool] | None = None, lease: float = 30.0) -> None:
        """``expand(push, geometry)``: the pushes a planned push becomes for a decode of that geometry (None:
        like-for-like), raising LayoutError/KVTransportError/ValueError when it cannot be mapped; ``unlike(geo)``:
        whether a decode's geometry differs from ours; ``lease``: how long a destination waits here for its
        prefill request."""
        self.cm = cm
        self.expand = expand or (lambda p, geo: [p])
        self.is_unlike = unlike or (lambda geo: False)
        self.lease = lease
        self.peer_geometry: dict[str, dict[str, Any]] = {}
        self.group_of = group_of or [0] * num_layers  # layer -> its KV cache group
        self.groups = len(set(self.group_of))  # KV cache groups (for the log)
        self.cuda = cuda
        self.stream: Any = None  # CUDA: the pusher's own stream (set on its thread)
        self.tp_rank = tp_rank
        self.num_layers = num_layers
        self.timeout = timeout
        self.q: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self.lock = threading.Lock()
        self.peer_meta: dict[str, dict[int, bytes]] = {}
        self.peers: OrderedDict[Link, Peer] = OrderedDict()  # least recently used first
        # destinations being connected (on their own threads, or waiting for one): their puts and signals, in
        # order, replayed (or failed) when the connect ends
        self.connecting: dict[Link, list[tuple[Push, Callable[[], None]]]] = {}
        self._to_connect: deque[tuple[Link, bytes]] = deque()  # connecting, waiting for a connect thread
        self._connect_threads: dict[Link, threading.Thread] = {}
        self.refused: OrderedDict[str, str] = OrderedDict()  # decode engine -> why its geometry was refused
        self._logs = RateLimitedLog(log)
        self.device: int | None = None
        if cuda:
            import torch

            self.device = torch.cuda.current_device()  # the worker's device: every thread of ours uses it
        self.broken: dict[Link, tuple[float, str]] = {}
        self.failed_seqs: dict[str, str] = {}
        self.touched: dict[str, set[Link]] = defaultdict(set)  # prefill req -> destination workers it put to
        self.releasing: list[str] = []
        # test-only (debug_push_delay): final signals held back, (due, "layerwise" | "whole", pushes); the
        # thread keeps serving other requests meanwhile, and their prefill requests are released after them
        self.delayed: list[tuple[float, str, list[Push]]] = []
        self.finished_sending: set[str] = set()
        self.failures: list[SendFailure] = []
        self.sent_layerwise = 0
        self.sent_whole = 0
        self.direct_unknown = 0  # destinations from a decode engine the scheduler has not introduced yet (ignored)
        self.planner = PushPlanner(self.group_of, block_size, self._geometry_if_unlike)
        # planned push (by identity: the planner hands every layer of a range the same object) -> what we put; the
        # same runs object for every layer lets the CUDA IPC launcher reuse its device table (cached by identity)
        self._expanded: OrderedDict[int, tuple[Push, list[Push]]] = OrderedDict()
        self.thread = threading.Thread(target=self._run, name="kvt-pusher", daemon=True)
        self.thread.start()

    def submit(self, *job: Any) -> None:
        self.q.put(job)

    def take(self) -> tuple[set[str], list[SendFailure]]:
        with self.lock:
            done, self.finished_sending = self.finished_sending, set()
            fails, self.failures = self.failures, []
        return done, fails

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=5)

    # ---------------------------------------------------------------- thread
    def _run(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.set_device(self.device)
            self.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            torch.cuda.set_stream(self.stream)  # this thread's current stream: the backends launch on it
        while True:
            try:
                job = self.q.get(timeout=self._idle_timeout())
            except queue.Empty:
                self._housekeeping()
                continue
            if job is None:
                return
            active = list(self.planner.active)  # (a step_end forgets them before its puts are issued)
            try:
                self._do(job)
            except Exception as exc:  # never let the pusher die: requests would hang
                log.exception("kvtransport pusher: job %s failed", job[0])
                if job[0] in _STEP_JOBS:
                    self._fail_step([*active, *self.planner.active],
                                    f"the prefill worker's push failed ({job[0]}: {type(exc).__name__}: {exc})")
            if self.q.empty():
                self._housekeeping()

    def _fail_step(self, sources: list[Any], reason: str) -> None:
        """A job of the step's push path raised (a bug of ours): what it was to put is unknown, so every
        destination of the step's ``sources`` fails now (its decode is told at once and fails or recomputes the
        request) instead of waiting out its transfer timeout for KV that will not all come. No more puts to
        them. Pusher thread."""
        for src in {id(s): s for s in sources}.values():
            for d in src.dsts.values():
                b = d.bind
                if d.cancelled or b.seq in self.failed_seqs:
                    continue
                self._failed(b.seq, reason)
                with self.lock:
                    self.failures.append(SendFailure(b.seq, b.engine, reason))

    def _held_back(self) -> set[str]:
        """Prefill requests with a final signal still held back (released only after it)."""
        return {p.req_id for _, _, pushes in self.delayed for p in pushes}

    def _idle_timeout(self) -> float | None:
        """How long the thread may wait for a job: releases are flushed as soon as the queue is idle, held-back
        signals when they are due."""
        timeout = None
        if self.releasing and not set(self.releasing) <= self._held_back():
            timeout = 0.02
        if self.delayed:
            due = max(0.0, min(d for d, _, _ in self.delayed) - time.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        if self.planner.pending:  # destinations waiting for their prefill request expire
            timeout = 1.0 if timeout is None else min(timeout, 1.0)
        return timeout

    def _housekeeping(self) -> None:
        try:
            now = time.monotonic()
            due = [d for d in self.delayed if d[0] <= now]
            if due:
                self.delayed = [d for d in self.delayed if d[0] > now]
                for _, kind, pushes in due:
                    self._signal_all(kind, pushes)
            if self.releasing:
                self._flush_releases()
            for b in self.planner.expire(now - self.lease):
                self._logs.log(logging.WARNING, "expired", "kvtransport: destination %s of transfer %s (decode engine "
                               "%s) dropped: its prefill request did not reach this worker within %gs", b.seq, b.xfer,
                               b.engine, self.lease)
        except Exception:  # never let the pusher die
            log.exception("kvtransport pusher: housekeeping failed")

    def _signal_all(self, kind: str, pushes: list[Push]) -> None:
        for p in pushes:
            self._signal(p, kind)

    def _do(self, job: tuple[Any, ...]) -> None:
        kind = job[0]
        if kind == "peers":  # (metadata, ranks to connect, checked geometry, refused engines -> why)
            self._peers(job[1], job[2], job[3], job[4] if len(job) > 4 else {})
        elif kind == "connected":
            self._connected(job[1], job[2])
        elif kind == "plan":  # the step's sources, destinations the scheduler learnt, cancels, given-up sources
            _, sources, binds, cancels, dropped = job
            now = time.monotonic()
            # cancels first: an early destination the scheduler refused must not bind to this step's source (its
            # computed prefix would be put at once) nor come back with this plan's binds
            for xfer, seq in cancels:
                self.planner.cancel(xfer, seq)
            self._run_ops(self.planner.step(sources, now) if sources else [])
            for b in binds:
                self._bind(b, now)
            for rid in dropped:
                self.planner.forget(rid)
        elif kind == "layer":
            _, layer, event = job
            self._after(event)
            self._run_ops(self.planner.layer(layer))
        elif kind == "step_end":
            self._after(job[1])
            self._run_ops(self.planner.step_end())
        elif kind == "msg":  # the destination channel: a decode's dst, straight from it
            self._direct(str(job[1]), job[2])
        elif kind == "release":
            self.releasing.append(job[1])
        # "hello" / "bye" of the destination channel: nothing to do

    def _peers(self, metas: dict[str, dict[int, bytes]], ranks: dict[str, list[int]],
               geometry: dict[str, dict[str, Any]], refused: dict[str, str]) -> None:
        """Decode engines introduced (or refused): keep their metadata (the ranks we may ever connect: below
        MAX_PEER_TP, or ours), geometry or refusal, and connect the ranks we serve at once, within the caps."""
        for engine, meta in metas.items():
            self.peer_meta[engine] = {r: m for r, m in meta.items() if r < MAX_PEER_TP or r == self.tp_rank}
        for engine, geo in geometry.items():
            self.peer_geometry[engine] = geo
            self.refused.pop(engine, None)
        for engine, why in refused.items():
            self.peer_geometry.pop(engine, None)
            self.refused[engine] = why
            self.refused.move_to_end(engine)
        while len(self.refused) > MAX_REFUSED:  # forgotten: with its metadata (no geometry would mean like-for-like)
            self.peer_meta.pop(self.refused.popitem(last=False)[0], None)
        for engine, rs in ranks.items():
            if engine in self.refused:
                continue
            for rank in rs:
                none = self._start_connect((engine, rank))
                if none is not None and none.startswith(CAPPED):
                    break

    def _expand(self, push: Push) -> list[Push]:
        """``self.expand`` of ``push``, once per push object (EXPANDED of them kept)."""
        hit = self._expanded.get(id(push))
        if hit is not None and hit[0] is push:
            return hit[1]
        out = self.expand(push, self._geometry_if_unlike(push.engine))
        self._expanded[id(push)] = (push, out)
        while len(self._expanded) > EXPANDED:
            self._expanded.popitem(last=False)
        return out

    def _geometry_if_unlike(self, engine: str) -> dict[str, Any] | None:
        geo = self.peer_geometry.get(engine)
        return geo if geo is not None and self.is_unlike(geo) else None

    def _bind(self, b: Bind, now: float) -> None:
        ops, what = self.planner.bind(b, now)
        if what.startswith("refused"):  # a flooding decode must not flood the log: one line per interval
            self._logs.log(logging.WARNING, "refused", "kvtransport: destination %s of transfer %s from decode engine "
                           "%s %s", b.seq, b.xfer, b.engine, what)
        elif what in ("before", "during", "after"):
            trace.event("w.bind", b.xfer, seq=b.seq, phase=what)
        self._run_ops(ops)

    def _direct(self, engine: str, msg: dict[str, Any]) -> None:
        """A checked message from a decode's link to our destination channel: bind its destinations."""
        if msg.get("type") != "dst":
            return
        if engine not in self.peer_meta:  # not introduced by our scheduler yet: its plan brings the same dst
            self.direct_unknown += 1
            return
        now = time.monotonic()
        for d in msg.get("dsts", []):
            # the block ids stay the arrays they came as (4 bytes an id; a tuple would cost ~36)
            self._bind(Bind(str(msg["xfer"]), engine, d["seq"], d["blocks"], d["offset"],
                            tuple(d.get("groups", []))), now)

    def _run_ops(self, ops: list[PutOp | SignalOp]) -> None:
        """Carry out the planner's puts and signals (each planned push mapped onto what we put: unit runs, one
        push per destination rank for unlike decodes); a push that cannot be mapped fails (its decode is told)."""
        for op in ops:
            refused = self.refused.get(op.push.engine)
            if refused is not None:
                self._refuse(op.push, refused)
                continue
            try:
                pushes = self._expand(op.push)
            except (kvtransport.LayoutError, KVTransportError, KeyError, ValueError) as exc:
                reason = f"cannot map the KV of {op.push.req_id} onto decode engine {op.push.engine}: {exc}"
                log.warning("kvtransport: %s", reason)
                with self.lock:
                    self.failures.append(SendFailure(op.push.seq, op.push.engine, reason))
                continue
            if isinstance(op, PutOp):
                for p in pushes:
                    self._put(p, op.layers, signal_layers=op.signal_layers)
            else:
                self._signal_later(op.kind, pushes)

    def _after(self, event: Any) -> None:
        """Order the next puts after ``event`` (recorded on the forward's stream): on our stream, on the device."""
        if event is None:
            return
        if self.stream is not None:
            self.stream.wait_event(event)
        else:
            event.synchronize()

    def _signal_later(self, kind: str, pushes: list[Push]) -> None:
        """Signal ``pushes`` now, or hold back those with a (test-only, ``debug_push_delay``) delay: the transfer
        stays open that long while the thread goes on serving the others."""
        now = time.monotonic()
        later = [p for p in pushes if p.delay > 0]
        if later:
            self.delayed.append((now + max(p.delay for p in later), kind, later))
        self._signal_all(kind, [p for p in pushes if p.delay <= 0])

    def _link(self, p: Push) -> Link:
        return (p.engine, self.tp_rank if p.rank < 0 else p.rank)

    def _start_connect(self, link: Link, *, evict: bool = False) -> str | None:
        """Start connecting ``link`` unless connected, connecting, in its reconnect backoff, without metadata or
        over a cap (MAX_LINKS_PER_PEER; MAX_LINKS, where ``evict`` — a put needs the link — may close the least
        recently used idle link for it). The connect runs on a thread of its own once fewer than MAX_CONNECTS run.
        Pusher thread; non-blocking. None while a connect is pending, else why none is (a cap: ``CAPPED`` first)."""
        if link in self.connecting:
            return None
        if link in self.peers:
            return "connected"
        until, why = self.broken.get(link, (0.0, ""))
        if time.monotonic() < until:
            return f"decode engine {link[0]} unreachable: {why}"
        meta = self.peer_meta.get(link[0], {}).get(link[1])
        if meta is None:
            return f"no kvtransport metadata for decode engine {link[0]} rank {link[1]}"
        capped = self._over_cap(link[0], evict)
        if capped is not None:
            key = "MAX_LINKS_PER_PEER" if "MAX_LINKS_PER_PEER" in capped else "MAX_LINKS"  # not per engine: bounded
            self._logs.log(logging.WARNING, key, "kvtransport: link to decode engine %s rank %d refused: %s", link[0],
                           link[1], capped)
            return capped
        self.connecting[link] = []
        self._to_connect.append((link, meta))
        self._connect_more()
        return None

    def _over_cap(self, engine: str, evict: bool) -> str | None:
        """Why one more link to ``engine`` is over a cap (None: it is not). O(links)."""
        if sum(1 for e, _ in chain(self.peers, self.connecting) if e == engine) >= MAX_LINKS_PER_PEER:
            return (f"{CAPPED}decode engine {engine} has {MAX_LINKS_PER_PEER} links already (MAX_LINKS_PER_PEER: a "
                    f"decode of more than {MAX_PEER_TP} ranks is not supported)")
        if len(self.peers) + len(self.connecting) >= MAX_LINKS and not (evict and self._evict_idle()):
            return (f"{CAPPED}this prefill worker holds {MAX_LINKS} links to decode workers, none idle (MAX_LINKS: "
                    "serve fewer decode engines per prefill, or run them like-for-like, one link each)")
        return None

    def _evict_idle(self) -> bool:
        """Close the least recently used link that no unreleased request put through. True if one was."""
        busy: set[Link] = set().union(*self.touched.values()) if self.touched else set()
        for link in self.peers:
            if link not in busy:
                peer = self.peers.pop(link)
                try:
                    self.cm.disconnect(peer)
                except KVTransportError:
                    pass
                self._logs.log(logging.INFO, "evicted", "kvtransport: closed the idle link to decode engine %s rank "
                               "%d (MAX_LINKS links held)", link[0], link[1])
                return True
        return False

    def _connect_more(self) -> None:
        """Start waiting connects while fewer than MAX_CONNECTS threads run. Pusher thread."""
        while self._to_connect and len(self._connect_threads) < MAX_CONNECTS:
            link, meta = self._to_connect.popleft()
            t = threading.Thread(target=self._connect, args=(link, meta), name=f"kvt-connect-{link[0][:16]}-{link[1]}",
                                 daemon=True)
            self._connect_threads[link] = t
            t.start()

    def _connect(self, link: Link, meta: bytes) -> None:
        """Connect thread: ``cm.connect``, the outcome handed to the pusher thread. A handshake the decode's worker
        broke off (it closed the connection, or did not answer in time: an overloaded host drops a hello that came
        late) is tried again, backing off from 0.1 to 1 s, while ``timeout`` lasts; a refusal is final."""
        outcome: Peer | KVTransportError
        deadline = time.monotonic() + self.timeout
        delay = 0.1
        try:
            if self.device is not None:
                import torch

                torch.cuda.set_device(self.device)
            while True:
                try:
                    outcome = self.cm.connect(meta, timeout=max(0.1, deadline - time.monotonic()))
                    break
                except (kvtransport.PeerDisconnected, kvtransport.TransferTimeout) as exc:
                    if time.monotonic() + delay >= deadline:
                        outcome = exc
                        break
                    log.warning("kvtransport: connect to decode engine %s rank %d broke off (%s); trying again",
                                link[0], link[1], exc)
                    time.sleep(delay)
                    delay = min(2 * delay, 1.0)
        except KVTransportError as exc:
            outcome = exc
        except Exception as exc:  # never leave the backlog waiting
            outcome = KVTransportError(f"connect to decode engine {link[0]} rank {link[1]} failed: "
                                       f"{type(exc).__name__}: {exc}")
        self.q.put(("connected", link, outcome))

    def _connected(self, link: Link, outcome: Peer | KVTransportError) -> None:
        """Pusher thread: a connect ended; replay (or fail) the destination's backlog in order, start the next."""
        thread = self._connect_threads.pop(link, None)
        if thread is not None:
            thread.join(timeout=1.0)  # it ends right after handing us the outcome: MAX_CONNECTS holds exactly
        self._connect_more()
        backlog = self.connecting.pop(link, [])
        if isinstance(outcome, KVTransportError):
            self._backoff(link, str(outcome))
            for p, _ in backlog:
                self._fail(p, outcome)
            return
        log.info("kvtransport: worker %d connected to decode engine %s rank %d via %s", self.tp_rank, link[0],
                 link[1], outcome.path)
        self.peers[link] = outcome
        for _, replay in backlog:
            replay()

    def _backoff(self, link: Link, why: str) -> None:
        """No new connect to ``link`` for RECONNECT_BACKOFF (at most MAX_BROKEN remembered)."""
        now = time.monotonic()
        self.broken.pop(link, None)
        self.broken[link] = (now + RECONNECT_BACKOFF, why)
        if len(self.broken) > MAX_BROKEN:
            for old in [k for k, (until, _) in self.broken.items() if until <= now]:
                del self.broken[old]
            while len(self.broken) > MAX_BROKEN:
                del self.broken[next(iter(self.broken))]

    def _peer(self, p: Push, replay: Callable[[], None]) -> Peer | None:
        """The link to ``p.engine``, or None when it is being connected: then ``replay`` waits in that
        destination's backlog. Raises KVTransportError (unreachable in backoff, no metadata, a cap, backlog full)."""
        link = self._link(p)
        peer = self.peers.get(link)
        if peer is not None:
            self.peers.move_to_end(link)
            return peer
        why = self._start_connect(link, evict=True)
        if why is not None:
            raise KVTransportError(why)
        backlog = self.connecting[link]
        if len(backlog) >= MAX_BACKLOG:
            raise KVTransportError(f"decode engine {p.engine}: {MAX_BACKLOG} puts wait for its connect")
        backlog.append((p, replay))
        return None

    def _refuse(self, p: Push, why: str) -> None:
        """``p`` goes to a decode engine whose geometry was refused: fail its sequence once (logged already)."""
        if p.seq in self.failed_seqs:
            return
        self._failed(p.seq, why)
        with self.lock:
            self.failures.append(SendFailure(p.base or p.seq, p.engine, why))

    def _failed(self, seq: str, reason: str) -> None:
        """Remember that ``seq`` failed (no more puts to it); at most 4,096 remembered."""
        self.failed_seqs[seq] = reason
        while len(self.failed_seqs) > 4096:
            self.failed_seqs.pop(next(iter(self.failed_seqs)))

    def _fail(self, p: Push, exc: BaseException) -> None:
        if p.seq in self.failed_seqs:
            return
        reason = f"{type(exc).__name__}: {exc}"
        self._failed(p.seq, reason)
        log.warning("kvtransport: push of %s to %s failed: %s", p.seq, p.engine, reason)
        with self.lock:
            self.failures.append(SendFailure(p.base or p.seq, p.engine, reason))
        if isinstance(exc, (kvtransport.PeerDisconnected, kvtransport.CommClosed)):
            peer = self.peers.pop(self._link(p), None)
            if peer is not None:
                try:
                    self.cm.disconnect(peer)
                except KVTransportError:
                    pass

    def _put(self, p: Push, layers: tuple[int, ...], *, signal_layers: bool = False) -> None:
        """``p`` into ``layers`` (one put for them all: one device launch on the CUDA IPC paths), then, with
        ``signal_layers``, each layer's signal."""
        if p.seq in self.failed_seqs:
            return
        try:
            self.touched[p.req_id].add(self._link(p))
            peer = self._peer(p, lambda: self._put(p, layers, signal_layers=signal_layers))
            if peer is None:
                return
            if p.runs is not None:
                if p.runs:
                    self.cm.put_runs(peer, p.seq, layers, p.runs)
            elif p.src:
                if len(layers) == 1:
                    self.cm.put_layer(peer, p.seq, layers[0], p.src, p.dst)
                else:
                    self.cm.put_layers(peer, p.seq, layers, p.src, p.dst)
            if signal_layers:
                for layer in layers:
                    self.cm.signal_layer(peer, p.seq, layer)
        except KVTransportError as exc:
            self._fail(p, exc)

    def _signal(self, p: Push, kind: str) -> None:
        """Signal ``p``'s sequence and count it as a ``kind`` ("whole" | "layerwise") transfer sent."""
        if p.seq in self.failed_seqs:
            return
        try:
            peer = self._peer(p, lambda: self._signal(p, kind))
            if peer is None:
                return
            self.cm.signal(peer, p.seq)
        except KVTransportError as exc:
            self._fail(p, exc)
            return
        trace.event("p.signal", p.seq, req=p.req_id, kind=kind)
        if kind == "whole":
            self.sent_whole += 1
        else:
            self.sent_layerwise += 1

    def _flush_releases(self) -> None:
        held = self._held_back() | {r for r in self.releasing if self.touched.get(r, set()) & self.connecting.keys()}
        reqs = [r for r in self.releasing if r not in held]
        self.releasing = [r for r in self.releasing if r in held]
        links: set[Link] = set().union(*(self.touched.pop(r, set()) for r in reqs)) if reqs else set()
        for link in links:
            peer = self.peers.get(link)
            if peer is None:
                continue
            try:
                self.cm.flush(peer, timeout=self.timeout)
            except KVTransportError as exc:
                log.warning("kvtransport: flush towards %s rank %d failed: %s", link[0], link[1], exc)
                self.peers.pop(link, None)
        for rid in reqs:
            self.planner.forget(rid)
        with self.lock:
            self.finished_sending.update(reqs)
