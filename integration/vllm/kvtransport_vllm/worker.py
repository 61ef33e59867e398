"""Worker side of the connector (one per TP/PP worker process): owns the kvtransport CommManager.

Prefill role: ``save_kv_layer`` hands each computed layer's puts to a *pusher* thread (the forward never
waits on the network; on CUDA a recorded event orders the put after the layer's kernels), ``wait_for_save``
signals the sequences whose prompt completed, whole pushes and releases come with the step's plan, and a
released request is reported ``finished_sending`` once its puts were flushed. All CommManager sender calls
happen on the pusher thread (one thread per manager: the core's outbound links are not thread-safe).

Decode role: waits are never blocking: ``get_transfer_results`` polls the manager, reports landed sequences
as ``finished_recving`` and failed or timed-out ones as ``failed_recving`` too (vLLM's failure path).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

import kvtransport
from kvtransport import KVLayout, KVTransportError, Peer

from .config import ConnectorSettings
from .metadata import Push, SendFailure, StepPlan
from .scheduler import PREFILL_LOST

log = logging.getLogger("vllm.kvtransport")

RECONNECT_BACKOFF = 10.0


@dataclass
class TransferResults:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


class _Pusher:
    """The thread that issues every put/signal/flush of one worker (see module docstring)."""

    def __init__(self, cm: kvtransport.CommManager, tp_rank: int, num_layers: int, timeout: float) -> None:
        self.cm = cm
        self.tp_rank = tp_rank
        self.num_layers = num_layers
        self.timeout = timeout
        self.q: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self.lock = threading.Lock()
        self.peer_meta: dict[str, dict[int, bytes]] = {}
        self.peers: dict[str, Peer] = {}
        self.broken: dict[str, tuple[float, str]] = {}
        self.failed_seqs: dict[str, str] = {}
        self.touched: dict[str, set[str]] = defaultdict(set)  # prefill req -> engines it put to
        self.releasing: list[str] = []
        # test-only (debug_push_delay): final signals held back, (due, "layerwise" | "whole", pushes); the
        # thread keeps serving other requests meanwhile, and their prefill requests are released after them
        self.delayed: list[tuple[float, str, list[Push]]] = []
        self.finished_sending: set[str] = set()
        self.failures: list[SendFailure] = []
        self.sent_layerwise = 0
        self.sent_whole = 0
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
        while True:
            try:
                job = self.q.get(timeout=self._idle_timeout())
            except queue.Empty:
                self._housekeeping()
                continue
            if job is None:
                return
            try:
                self._do(job)
            except Exception:  # never let the pusher die: requests would hang
                log.exception("kvtransport pusher: job %s failed", job[0])
            if self.q.empty():
                self._housekeeping()

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
        except Exception:  # never let the pusher die
            log.exception("kvtransport pusher: housekeeping failed")

    def _signal_all(self, kind: str, pushes: list[Push]) -> None:
        for p in pushes:
            if self._signal(p):
                if kind == "whole":
                    self.sent_whole += 1
                else:
                    self.sent_layerwise += 1

    def _do(self, job: tuple[Any, ...]) -> None:
        kind = job[0]
        if kind == "peers":
            self.peer_meta.update(job[1])
        elif kind == "layer":
            _, layer, pushes, event = job
            if event is not None:
                event.synchronize()
            for p in pushes:
                self._put(p, layer, signal_layer=p.final)
        elif kind == "signal":
            self._signal_later("layerwise", list(job[1]))
        elif kind == "whole":
            whole: Push = job[1]
            self._put(whole, None)  # every layer in one call (one device launch on CUDA IPC paths)
            self._signal_later("whole", [whole])
        elif kind == "release":
            self.releasing.append(job[1])

    def _signal_later(self, kind: str, pushes: list[Push]) -> None:
        """Signal ``pushes`` now, or hold back those with a (test-only, ``debug_push_delay``) delay: the transfer
        stays open that long while the thread goes on serving the others."""
        now = time.monotonic()
        later = [p for p in pushes if p.delay > 0]
        if later:
            self.delayed.append((now + max(p.delay for p in later), kind, later))
        self._signal_all(kind, [p for p in pushes if p.delay <= 0])

    def _peer(self, engine: str) -> Peer:
        peer = self.peers.get(engine)
        if peer is not None:
            return peer
        until, why = self.broken.get(engine, (0.0, ""))
        if time.monotonic() < until:
            raise KVTransportError(f"decode engine {engine} unreachable: {why}")
        meta = self.peer_meta.get(engine, {}).get(self.tp_rank)
        if meta is None:
            raise KVTransportError(f"no kvtransport metadata for decode engine {engine} rank {self.tp_rank}")
        try:
            peer = self.cm.connect(meta, timeout=self.timeout)
        except KVTransportError as exc:
            self.broken[engine] = (time.monotonic() + RECONNECT_BACKOFF, str(exc))
            raise
        log.info("kvtransport: connected to decode engine %s rank %d via %s", engine, self.tp_rank, peer.path)
        self.peers[engine] = peer
        return peer

    def _fail(self, p: Push, exc: BaseException) -> None:
        if p.seq in self.failed_seqs:
            return
        reason = f"{type(exc).__name__}: {exc}"
        self.failed_seqs[p.seq] = reason
        while len(self.failed_seqs) > 4096:
            self.failed_seqs.pop(next(iter(self.failed_seqs)))
        log.warning("kvtransport: push of %s to %s failed: %s", p.seq, p.engine, reason)
        with self.lock:
            self.failures.append(SendFailure(p.seq, p.engine, reason))
        if isinstance(exc, (kvtransport.PeerDisconnected, kvtransport.CommClosed)):
            peer = self.peers.pop(p.engine, None)
            if peer is not None:
                try:
                    self.cm.disconnect(peer)
                except KVTransportError:
                    pass

    def _put(self, p: Push, layer: int | None, *, signal_layer: bool = False) -> None:
        """One layer of ``p`` (and its layer signal), or with ``layer`` None every layer in one call (a
        request whose KV is already computed: pull mode, or a whole-request push)."""
        if p.seq in self.failed_seqs:
            return
        try:
            peer = self._peer(p.engine)
            self.touched[p.req_id].add(p.engine)
            if p.src:
                if layer is None:
                    self.cm.put_layers(peer, p.seq, None, p.src, p.dst)
                else:
                    self.cm.put_layer(peer, p.seq, layer, p.src, p.dst)
            if signal_layer and layer is not None:
                self.cm.signal_layer(peer, p.seq, layer)
        except KVTransportError as exc:
            self._fail(p, exc)

    def _signal(self, p: Push) -> bool:
        if p.seq in self.failed_seqs:
            return False
        try:
            self.cm.signal(self._peer(p.engine), p.seq)
            return True
        except KVTransportError as exc:
            self._fail(p, exc)
            return False

    def _flush_releases(self) -> None:
        held = self._held_back()
        reqs = [r for r in self.releasing if r not in held]
        self.releasing = [r for r in self.releasing if r in held]
        engines = set().union(*(self.touched.pop(r, set()) for r in reqs)) if reqs else set()
        for eng in engines:
            peer = self.peers.get(eng)
            if peer is None:
                continue
            try:
                self.cm.flush(peer, timeout=self.timeout)
            except KVTransportError as exc:
                log.warning("kvtransport: flush towards %s failed: %s", eng, exc)
                self.peers.pop(eng, None)
        with self.lock:
            self.finished_sending.update(reqs)


class WorkerSide:
    """See the module docstring. Constructed by the connector for ``KVConnectorRole.WORKER``."""

    def __init__(self, *, settings: ConnectorSettings, engine_id: str, tp_rank: int = 0) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.cm: kvtransport.CommManager | None = None
        self.layout: KVLayout | None = None
        self.layer_index: dict[str, int] = {}
        self.pusher: _Pusher | None = None
        self._plan: StepPlan | None = None
        self._layers_done: set[int] = set()
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[float, float]] = {}  # decode req -> (start, deadline)
        self._early: dict[str, float] = {}  # landed before we were told to wait for them
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._times: list[float] = []
        self._failures = 0
        self._lost = 0  # receives failed because their prefill went away
        self._reported: OrderedDict[str, None] = OrderedDict()  # receives already ended (landed/fenced): bounded
        self._last: dict[str, Any] = {}
        self._pending_send_failures: list[SendFailure] = []
        self._fences: queue.Queue[tuple[str, bool] | None] = queue.Queue()
        self._fencer: threading.Thread | None = None

    # ---------------------------------------------------------------- set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe vLLM's per-layer views and open the transport (blocking, once). Raises KVTransportError."""
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.layout = KVLayout.from_tensors(kv_caches)
        backend = None if self.settings.backend == "auto" else self.settings.backend
        opts = dict(self.settings.backend_options)
        opts.setdefault("timeout", self.settings.connect_timeout)
        self.cm = kvtransport.open(self.layout, backend=backend, ifname=self.settings.ifname, **opts)
        self.pusher = _Pusher(self.cm, self.tp_rank, self.layout.num_layers, self.settings.connect_timeout)
        self._fencer = threading.Thread(target=self._fence_loop, name="kvt-fence", daemon=True)
        self._fencer.start()
        log.info("kvtransport connector worker %d: backend %s, %d layers x %d blocks, %d plane(s)/layer",
                 self.tp_rank, self.cm.backend, self.layout.num_layers, self.layout.num_blocks,
                 len(self.layout.layers[0].planes))

    def handshake(self) -> dict[str, Any]:
        """What the scheduler side needs from this worker (kvtransport metadata and compatibility fields)."""
        assert self.cm is not None and self.layout is not None
        return {"metadata": self.cm.metadata(), "backend": self.cm.backend,
                "layout_hash": self.layout.compat_hash(), "layer_names": list(self.layer_index)}

    # ---------------------------------------------------------------- per step
    def bind(self, plan: StepPlan) -> None:
        """Take this step's plan (before the forward). Non-blocking."""
        self._plan = plan
        self._layers_done = set()
        if self.pusher is not None:
            if plan.peers:
                self.pusher.submit("peers", plan.peers)
            for p in plan.whole_pushes:
                self.pusher.submit("whole", p)
        if self.cm is not None:
            now = time.monotonic()
            with self._lock:
                for rid, timeout in plan.recv_start.items():
                    self._waiting[rid] = (now, now + timeout)
                for rid in plan.recv_abort:
                    if self._waiting.pop(rid, None) is not None or (rid in self._early and rid not in self._reported):
                        self._early.pop(rid, None)
                        self._fence(rid, failed=False)
                for rid, reason in plan.recv_fail.items():
                    if self._waiting.pop(rid, None) is not None:
                        log.warning("kvtransport: KV for %s will not come: %s", rid, reason)
                        if reason.startswith(PREFILL_LOST):
                            self._lost += 1
                        self._early.pop(rid, None)
                        self._fence(rid, failed=True)

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """Queue this layer's puts (called right after the layer's attention). Non-blocking."""
        plan = self._plan
        if plan is None or not plan.layer_pushes or self.pusher is None:
            return
        idx = self.layer_index.get(layer_name)
        if idx is None or idx in self._layers_done:
            return
        event = None
        if getattr(kv_layer, "is_cuda", False):
            import torch

            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        self._layers_done.add(idx)
        self.pusher.submit("layer", idx, plan.layer_pushes, event)

    def wait_for_save(self) -> None:
        """End of the step: put layers the forward did not visit, signal completed prompts, queue releases."""
        plan = self._plan
        if plan is None or self.pusher is None:
            return
        if plan.layer_pushes:
            assert self.layout is not None
            for idx in range(self.layout.num_layers):
                if idx not in self._layers_done:
                    self.pusher.submit("layer", idx, plan.layer_pushes, None)
            self._layers_done = set(range(self.layout.num_layers))
            finals = [p for p in plan.layer_pushes if p.final]
            if finals:
                self.pusher.submit("signal", finals)
        for rid in plan.send_release:
            self.pusher.submit("release", rid)
        plan.send_release = []
        plan.layer_pushes = []

    def transfer_results(self) -> TransferResults:
        """Completions since the last call (non-blocking)."""
        sending: set[str] = set()
        if self.pusher is not None:
            sending, fails = self.pusher.take()
            self._pending_send_failures.extend(fails)
        if self.cm is None:
            return TransferResults(sending, set(), set())
        now = time.monotonic()
        with self._lock:
            for seq in self.cm.poll():
                rid = str(seq)
                if rid in self._reported:  # already ended (e.g. failed by the scheduler first): report once
                    continue
                if rid in self._waiting:
                    self._finish(rid, now)
                else:
                    self._early[rid] = now
            for rid in [r for r in self._early if r in self._waiting]:
                self._early.pop(rid)
                self._finish(rid, now)
            for rid, (_, deadline) in list(self._waiting.items()):
                if now >= deadline:
                    log.warning("kvtransport: KV for %s did not land within %gs", rid, self.settings.transfer_timeout)
                    del self._waiting[rid]
                    self._fence(rid, failed=True)
            done, self._done_recv = self._done_recv, set()
            failed, self._failed_recv = self._failed_recv, set()
        return TransferResults(sending, done | failed, failed)

    def _finish(self, rid: str, now: float) -> None:
        assert self.cm is not None
        start, _ = self._waiting.pop(rid)
        try:
            self.cm.wait(rid, timeout=0)
            self._done_recv.add(rid)
            self._ended(rid)
            self._times.append(now - start)
        except KVTransportError as exc:
            log.warning("kvtransport: KV transfer for %s failed: %s", rid, exc)
            if isinstance(exc, kvtransport.PeerDisconnected):
                self._lost += 1
            self._fence(rid, failed=True)
            return
        self.cm.release(rid)

    def _fence(self, rid: str, *, failed: bool) -> None:
        """Report ``rid`` only once no byte of it can land any more (the blocks may be reused right after):
        ``CommManager.abort`` tells every sender to stop and waits for their confirmation, off this thread."""
        if failed:
            self._failures += 1
        self._ended(rid)
        self._fences.put((rid, failed))

    def _ended(self, rid: str) -> None:
        """Remember that ``rid`` was (or is being) reported, so that a late poll result does not report it again."""
        self._reported[rid] = None
        while len(self._reported) > 4096:
            self._reported.popitem(last=False)

    def _fence_loop(self) -> None:
        while True:
            item = self._fences.get()
            if item is None:
                return
            rid, failed = item
            cm = self.cm
            if cm is None:
                return
            try:
                abort = getattr(cm, "abort", None)
                if abort is not None:
                    abort(rid, timeout=self.settings.connect_timeout)
                else:  # older core: no fence, release only
                    cm.release(rid)
            except kvtransport.TransferTimeout as exc:
                log.error("kvtransport: %s; retrying (its blocks stay held)", exc)
                time.sleep(1.0)
                self._fences.put(item)
                continue
            except KVTransportError as exc:  # closed: nothing can land any more
                log.info("kvtransport: abort of %s: %s", rid, exc)
            with self._lock:
                (self._failed_recv if failed else self._done_recv).add(rid)

    def take_send_failures(self) -> list[SendFailure]:
        """Pushes that failed since the last call (the scheduler tells their decode engines)."""
        out, self._pending_send_failures = self._pending_send_failures, []
        return out

    def stats_delta(self) -> dict[str, Any]:
        """Counters since the last call (bytes, puts, transfers, times, failures, backend, paths)."""
        if self.cm is None:
            return {}
        s = self.cm.stats()
        now = {k: int(s.get(k, 0)) for k in ("bytes_sent", "bytes_received", "puts", "puts_received", "failures")}
        if self.pusher is not None:
            now["transfers_layerwise"] = self.pusher.sent_layerwise
            now["transfers_whole"] = self.pusher.sent_whole
        out: dict[str, Any] = {k: v - int(self._last.get(k, 0)) for k, v in now.items()}
        self._last = now
        out["transfers_sent"] = out.get("transfers_layerwise", 0) + out.get("transfers_whole", 0)
        times, self._times = self._times, []
        out["transfers_received"] = len(times)
        out["transfer_times"] = [round(t, 6) for t in times]
        out["transfer_failures"], self._failures = self._failures, 0
        out["prefill_disconnects"], self._lost = self._lost, 0
        out["backend"] = [self.cm.backend]
        out["paths"] = list(s.get("paths", []))
        return out

    def shutdown(self) -> None:
        self._fences.put(None)
        if self.pusher is not None:
            self.pusher.close()
        if self.cm is not None:
            self.cm.close()
            self.cm = None
