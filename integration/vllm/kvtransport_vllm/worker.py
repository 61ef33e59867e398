"""Worker side of the connector (one per TP/PP worker process): owns the kvtransport CommManager.

Prefill role (start now, bind late): the step's plan names the prefill requests the forward computes;
``save_kv_layer`` hands each computed layer to a *pusher* thread (:mod:`.pusher`: the forward never waits on the
network, and copies overlap the next layers' compute), which puts it into every destination bound so far.
Destinations come with the plan (the scheduler forwards what it learnt) and, usually first, straight from the
decode over this worker's *destination channel* (a side-channel server of its own, named to decodes in the
prefill's welcome); one that binds late gets everything already computed in one batched put (:mod:`.pushplan`).
Releases come with the plan, and a released request is reported ``finished_sending`` once its puts were flushed.
Pushes for unlike peers are expanded into one push per destination rank this worker serves
(:mod:`kvtransport.reshard`), on the pusher thread.

Decode role: waits are never blocking: ``get_transfer_results`` polls the manager, reports landed sequences
as ``finished_recving`` and failed or timed-out ones as ``failed_recving`` too (vLLM's failure path).

A peer's data never raises here (``bind`` runs inside vLLM's model step): every peer-supplied geometry is checked
where it enters (:mod:`.geometry`: a decode's TP size, block size and head order against our model and a bound on
the work of mapping it; a prefill's ``senders`` against our model), and a peer that fails the check fails its own
requests, through the failure path: a refused decode's destinations become send failures (the scheduler tells that
decode), a request bound to malformed senders is reported failed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import kvtransport
from kvtransport import KVLayout, KVTransportError, LayoutError
from kvtransport.admission import RateLimitedLog
from kvtransport.coalesce import BlockRun, coalesce
from kvtransport.reshard import Shard, reshard_runs, senders_to

from . import trace
from .compat import block_dim
from .config import ConnectorSettings
from .geometry import (
    Geometry,
    base_seq,
    check_peer_geometry,
    check_senders,
    describe,
    part_seq,
    served_ranks,
    unit_layout,
)
from .metadata import NULL_BLOCK, FailureKind, Push, SendFailure, StepPlan
from .pusher import Pusher
from .sidechannel import SideChannelServer

log = logging.getLogger("vllm.kvtransport")


@dataclass
class TransferResults:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


class WorkerSide:
    """See the module docstring. Constructed by the connector for ``KVConnectorRole.WORKER``."""

    def __init__(self, *, settings: ConnectorSettings, engine_id: str, tp_rank: int = 0,
                 num_blocks: int | None = None, tp_size: int = 1, num_kv_heads: int | None = None,
                 cpu_attn: bool = False, layer_groups: dict[str, int] | None = None, block_size: int = 16) -> None:
        self.settings = settings
        self.block_size = block_size  # vLLM's (tokens per block)
        self.dst_channel: SideChannelServer | None = None
        self.num_blocks = num_blocks
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads  # the model's (None: this rank's heads times tp_size)
        self.cpu_attn = cpu_attn  # vLLM's CPU attention owns the block interiors (see geometry.py)
        self.layer_groups = dict(layer_groups or {})  # layer name -> KV cache group (hybrid models)
        self.geometry: Geometry | None = None  # None: block layout (like-for-like peers only)
        self.shard: Shard | None = None
        self.peer_geometry: dict[str, dict[str, Any]] = {}  # decode engine -> its checked geometry
        self._serve: dict[str, list[int]] = {}  # decode engine -> the ranks of it we send to
        self._logs = RateLimitedLog(log)
        self._parts: dict[str, dict[str, str]] = {}  # decode req -> its parts' sequence ids -> their sender
        self._landed: dict[str, set[str]] = {}  # decode req -> its parts landed so far
        trace.set_role(f"worker{tp_rank}")
        self.cm: kvtransport.CommManager | None = None
        self.layout: KVLayout | None = None
        self.layer_index: dict[str, int] = {}
        self.pusher: Pusher | None = None
        self._layers_done: set[int] = set()
        self._step_sources = False  # this step's forward computes prefill requests (their layers go to the pusher)
        self._step_layerwise = False  # ... and some of them are put layer by layer
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[float, float]] = {}  # decode req -> (start, deadline)
        # first-token flow: receives reported only once their first token is in their prompt (StepPlan.recv_hold)
        self._held: set[str] = set()
        self._landed_held: dict[str, tuple[float, float]] = {}  # landed, not yet released -> (start, deadline)
        self._recv_blocks: dict[str, list[int]] = {}  # decode req -> its destination blocks, until it ended
        self._early: dict[str, float] = {}  # sequences (parts) landed before we were told to wait for them
        self._done_recv: set[str] = set()
        self._failed_recv: set[str] = set()
        self._times: list[float] = []
        self._failures = 0
        self._lost = 0  # receives failed because their prefill went away
        self._reported: OrderedDict[str, None] = OrderedDict()  # receives already ended (landed/fenced): bounded
        self._last: dict[str, Any] = {}
        self._pending_send_failures: list[SendFailure] = []
        self._fences: queue.Queue[tuple[str, bool, list[str]] | None] = queue.Queue()
        self._fencer: threading.Thread | None = None

    # ---------------------------------------------------------------- set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe vLLM's per-layer views and open the transport (blocking, once). Raises KVTransportError."""
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        first = next(iter(kv_caches.values()))
        bdim = block_dim(tuple(first.shape), self.num_blocks)
        self.geometry = describe(kv_caches, bdim, self.cpu_attn)
        if self.geometry is not None:
            heads = self.num_kv_heads or self.geometry.heads * self.tp_size
            try:
                self.shard = self.geometry.shard(self.tp_size, self.tp_rank, heads)
                if len(self.shard.heads) != self.geometry.heads:
                    raise LayoutError(f"{self.geometry.heads} KV heads in the cache, {len(self.shard.heads)} expected")
            except LayoutError as exc:
                log.warning("kvtransport: worker %d keeps the block layout (like-for-like peers only): %s",
                            self.tp_rank, exc)
                self.geometry, self.shard = None, None
        if self.geometry is not None:
            self.layout = unit_layout(kv_caches, self.geometry)
        else:
            self.layout = KVLayout.from_tensors(kv_caches, block_dim=bdim)
        backend = None if self.settings.backend == "auto" else self.settings.backend
        opts = dict(self.settings.backend_options)
        opts.setdefault("timeout", self.settings.connect_timeout)
        self.cm = kvtransport.open(self.layout, backend=backend, ifname=self.settings.ifname, **opts)
        block_size = self.geometry.block_size if self.geometry is not None else self.block_size
        self.pusher = Pusher(self.cm, self.tp_rank, self.layout.num_layers, self.settings.connect_timeout,
                             cuda=self.layout.is_cuda,
                             group_of=[self.layer_groups.get(name, 0) for name in self.layer_index],
                             block_size=block_size, expand=self._expand_one,
                             unlike=lambda geo: self.geometry is not None and self._unlike(geo),
                             lease=self.settings.lease)
        # destinations straight from decodes (no engine loop on their way): into the pusher's queue
        self.dst_channel = SideChannelServer(self.settings.address, 0, self.engine_id, None, self.pusher.q,
                                             self.settings.connect_timeout, secret=self.settings.secret,
                                             name=f"kvt-dst-accept-{self.tp_rank}")
        self._fencer = threading.Thread(target=self._fence_loop, name="kvt-fence", daemon=True)
        self._fencer.start()
        log.info("kvtransport connector worker %d: backend %s, %d layers x %d blocks, %d plane(s)/layer, "
                 "%d KV cache group(s), geometry %s", self.tp_rank, self.cm.backend, self.layout.num_layers,
                 self.layout.num_blocks, len(self.layout.layers[0].planes), self.pusher.groups, self.geometry)

    def handshake(self) -> dict[str, Any]:
        """What the scheduler side needs from this worker (kvtransport metadata and compatibility fields)."""
        assert self.cm is not None and self.layout is not None
        g = self.geometry
        out = {"metadata": self.cm.metadata(), "backend": self.cm.backend, "instance": self.cm.instance,
               "layout_hash": self.layout.compat_hash(), "layer_names": list(self.layer_index),
               "kv_order": g.order if g is not None else None}
        if self.dst_channel is not None:
            out["dst_at"] = [self.dst_channel.host, self.dst_channel.port]
        return out

    # ---------------------------------------------------------------- per step
    def bind(self, plan: StepPlan) -> None:
        """Take this step's plan (before the forward, and in steps without one). Queues its whole pushes and
        releases, starts and ends receives. Non-blocking."""
        self._layers_done = set()
        self._step_sources = bool(plan.sources)
        self._step_layerwise = any(src.layerwise for src in plan.sources)
        refused = {e: why for e, raw in plan.peer_geometry.items() if (why := self._take_geometry(e, raw))}
        if self.pusher is not None:
            if plan.peers or refused:  # with their geometry: a destination straight from one of them may follow
                self.pusher.submit("peers", plan.peers, {e: self._dst_ranks(e) for e in plan.peers if e not in refused},
                                   {e: self.peer_geometry[e] for e in plan.peer_geometry if e not in refused}, refused)
            if plan.sources or plan.binds or plan.cancels or plan.dropped:
                self.pusher.submit("plan", plan.sources, plan.binds, plan.cancels, plan.dropped)
            # Releases name requests that finished in an earlier step (their puts and signals are queued
            # already), so they go now: a step without a forward (vLLM keeps stepping only to drain delayed
            # frees) binds its plan but never calls wait_for_save, and a release left for it would be lost
            # with the blocks it frees.
            for rid in plan.send_release:
                self.pusher.submit("release", rid)
            plan.send_release = []
        if self.cm is not None:
            now = time.monotonic()
            with self._lock:
                for rid, timeout in plan.recv_start.items():
                    self._waiting[rid] = (now, now + timeout)
                    self._recv_blocks[rid] = list(plan.recv_blocks.get(rid, ()))
                self._held |= plan.recv_hold - plan.recv_release
                for rid in plan.recv_release:
                    self._held.discard(rid)
                    landed = self._landed_held.pop(rid, None)
                    if landed is not None:
                        self._report_landed(rid, landed[0], now)
                for rid, senders in plan.recv_from.items():
                    self._expect(rid, senders)
                while len(self._recv_blocks) > 65536:  # ended receives are popped; bound what was never reported
                    self._recv_blocks.pop(next(iter(self._recv_blocks)))
                for rid in plan.recv_abort:
                    self._held.discard(rid)
                    if self._landed_held.pop(rid, None) is not None:  # landed already: nothing can come any more
                        self._done_recv.add(rid)
                        continue
                    early = [q for q in self._early if base_seq(q) == rid]
                    if self._waiting.pop(rid, None) is not None or (early and rid not in self._reported):
                        for q in early:
                            self._early.pop(q, None)
                        self._fence(rid, failed=False)
                for rid, reason in plan.recv_fail.items():
                    self._held.discard(rid)
                    if self._landed_held.pop(rid, None) is not None:  # its first token cannot come any more
                        log.warning("kvtransport: %s landed but will not be continued: %s", rid, reason)
                        self._failures += 1
                        self._failed_recv.add(rid)
                        continue
                    if self._waiting.pop(rid, None) is not None:
                        log.warning("kvtransport: KV for %s will not come: %s", rid, reason)
                        if plan.recv_fail_kind.get(rid) is FailureKind.PREFILL_LOST:
                            self._lost += 1
                        for q in [q for q in self._early if base_seq(q) == rid]:
                            self._early.pop(q, None)
                        self._fence(rid, failed=True)

    def _expect(self, rid: str, senders: dict[int, str]) -> None:
        """Bind decode request ``rid`` to the prefill workers that will push it (``senders``: the prefill's tp
        rank -> kvtransport instance id, every rank): this rank expects one part per prefill rank that holds
        some of its heads (:func:`kvtransport.reshard.senders_to`), and the core refuses any other peer's puts,
        signals and cancels for a part, and fails it at once if its worker goes away. Senders that do not fit
        (:func:`.geometry.check_senders`) fail ``rid`` (reported failed once fenced). Under ``_lock``;
        non-blocking; never raises on the prefill's data."""
        if self.cm is None or rid not in self._waiting or not senders:
            return
        try:
            check_senders(senders, self.shard.num_kv_heads if self.shard is not None else None)
            if self.shard is not None:
                ranks = senders_to(len(senders), self.shard)
                parts = {part_seq(rid, r, len(ranks)): senders[r] for r in ranks}
            else:
                parts = {rid: senders[self.tp_rank]} if self.tp_rank in senders else {}
        except LayoutError as exc:
            self._logs.log(logging.WARNING, "senders", "kvtransport: %s fails: its prefill's workers do not fit this "
                           "decode (%s); run the prefill at a TP size that splits the model's KV heads", rid, exc)
            del self._waiting[rid]
            self._fence(rid, failed=True)
            return
        if not parts:
            return
        self._parts[rid] = parts
        for seq, sender in parts.items():
            try:
                self.cm.expect(seq, sender=sender)
            except KVTransportError as exc:  # no slot for it now: its KV is still accepted from the first claimer
                log.warning("kvtransport: cannot bind %s to its prefill worker %s: %s", seq, sender, exc)
        self._maybe_finish(rid, time.monotonic())

    def _take_geometry(self, engine: str, raw: Any) -> str | None:
        """Check decode ``engine``'s geometry where it enters (the plan, inside the model step): keep it, with the
        ranks of it we send to, or forget it and return why it is refused (logged, rate-limited). Never raises;
        O(MAX_PEER_TP)."""
        try:
            geo = check_peer_geometry(raw)
            ranks = served_ranks(self.shard, geo) if self.shard is not None and self._unlike(geo) else [self.tp_rank]
        except LayoutError as exc:
            self.peer_geometry.pop(engine, None)
            self._serve.pop(engine, None)
            why = f"decode engine {engine} is refused: {exc}"
            self._logs.log(logging.ERROR, "geometry", "kvtransport: %s", why)
            return why
        self.peer_geometry[engine] = geo
        self._serve[engine] = ranks
        return None

    def _dst_ranks(self, engine: str) -> list[int]:
        """The ranks of decode ``engine`` this worker sends to (unlike peers: those it holds heads for; checked when
        its geometry came, :meth:`_take_geometry`)."""
        return self._serve.get(engine, [self.tp_rank])

    def _unlike(self, geo: dict[str, Any]) -> bool:
        """Whether a (checked) decode geometry differs from ours."""
        assert self.geometry is not None
        return (int(geo["tp_size"]) != self.tp_size or int(geo["block_size"]) != self.geometry.block_size
                or geo.get("kv_order") != self.geometry.order)

    def _peer_shard(self, geo: dict[str, Any], rank: int) -> Shard:
        assert self.shard is not None
        return Shard(int(geo["tp_size"]), rank, self.shard.num_kv_heads, int(geo["block_size"]), str(geo["kv_order"]),
                     self.shard.head_size)

    def _hybrid(self) -> bool:
        """Several KV cache groups: a sliding window's skipped blocks are vLLM's null block (never moved)."""
        return len(set(self.layer_groups.values())) > 1

    def _expand_one(self, p: Push, geo: dict[str, Any] | None = None) -> list[Push]:
        """``p`` as the pusher puts it: like-for-like block pairs as unit runs (unit layout), a token range for an
        unlike decode of geometry ``geo`` as one push per destination rank this worker serves, with its unit
        runs. Raises LayoutError (and ValueError/KeyError for what cannot be mapped). Pusher thread; reads only
        what is fixed once the caches are registered."""
        g = self.geometry
        if p.start < 0:
            if g is None or not p.src:
                return [p]
            upb = g.units_per_block
            runs = coalesce(list(p.src), list(p.dst))
            return [replace(p, runs=tuple(BlockRun(r.src * upb, r.dst * upb, r.count * upb) for r in runs))]
        if self.shard is None:
            raise LayoutError("this worker's cache layout only serves like-for-like peers")
        if geo is None:
            raise LayoutError(f"no geometry for decode engine {p.engine}")
        out = []
        for d in range(int(geo["tp_size"])):
            dst = self._peer_shard(geo, d)
            senders = senders_to(self.tp_size, dst)
            if self.tp_rank not in senders:
                continue
            runs = reshard_runs(self.shard, dst, p.src, p.dst, p.start, p.stop, src_first_token=p.src_first,
                                dst_first_token=p.dst_first,
                                skip_block=NULL_BLOCK if self._hybrid() else None) if p.src else []
            out.append(replace(p, seq=part_seq(p.seq, self.tp_rank, len(senders)), rank=d, runs=tuple(runs),
                               base=p.seq))
        return out

    def save_kv_layer(self, layer_name: str, kv_layer: Any) -> None:
        """The forward computed this layer (its kernels are enqueued): hand it to the pusher, which puts it into
        the destinations bound so far. Non-blocking."""
        if not self._step_layerwise or self.pusher is None:
            return
        idx = self.layer_index.get(layer_name)
        if idx is None or idx in self._layers_done:
            return
        event = self._forward_event() if getattr(kv_layer, "is_cuda", False) else None
        self._layers_done.add(idx)
        self.pusher.submit("layer", idx, event)

    def wait_for_save(self) -> None:
        """End of a step that ran a forward: layers the forward did not visit go now, then the step's end (the
        pusher puts what waited for it and signals complete prompts). Non-blocking. (vLLM does not call it in
        steps without a forward: nothing that such a step's plan carries waits here.)"""
        if not self._step_sources or self.pusher is None:
            return
        assert self.layout is not None
        if self._step_layerwise:
            missed = [idx for idx in range(self.layout.num_layers) if idx not in self._layers_done]
            event = self._forward_event() if missed else None
            for idx in missed:
                self.pusher.submit("layer", idx, event)
        self._layers_done = set(range(self.layout.num_layers))
        self.pusher.submit("step_end", self._forward_event())
        self._step_sources = self._step_layerwise = False

    def _forward_event(self) -> Any:
        """CUDA: an event recorded now on the forward thread's current stream (None on host memory)."""
        if self.layout is None or not self.layout.is_cuda:
            return None
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

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
                q = str(seq)
                rid = base_seq(q)
                if rid in self._reported:  # already ended (e.g. failed by the scheduler first): report once
                    continue
                if rid in self._waiting:
                    self._part_landed(rid, q, now)
                else:
                    self._early[q] = now
            for q in [q for q in self._early if base_seq(q) in self._waiting]:
                self._early.pop(q)
                self._part_landed(base_seq(q), q, now)
            for rid, (_, deadline) in list(self._waiting.items()):
                if now >= deadline:
                    log.warning("kvtransport: KV for %s did not land within %gs", rid, self.settings.transfer_timeout)
                    del self._waiting[rid]
                    self._fence(rid, failed=True)
            for rid, (_, deadline) in list(self._landed_held.items()):
                if now >= deadline:
                    log.warning("kvtransport: the first token of %s did not come within %gs", rid,
                                self.settings.transfer_timeout)
                    del self._landed_held[rid]
                    self._held.discard(rid)
                    self._failures += 1
                    self._failed_recv.add(rid)
            done, self._done_recv = self._done_recv, set()
            failed, self._failed_recv = self._failed_recv, set()
        return TransferResults(sending, done | failed, failed)

    def blocks_of(self, failed: set[str]) -> set[int]:
        """The destination blocks of receives reported failed (vLLM < 0.32 learns of a failed receive from
        them, ``get_block_ids_with_load_errors``). Forgets those requests' blocks."""
        out: set[int] = set()
        with self._lock:
            for rid in failed:
                out.update(self._recv_blocks.pop(rid, ()))
        return out

    def _part_landed(self, rid: str, seq: str, now: float) -> None:
        """Part ``seq`` of ``rid`` landed (or failed): ``rid`` ends once every part did. Under ``_lock``."""
        assert self.cm is not None
        try:
            self.cm.wait(seq, timeout=0)
        except KVTransportError as exc:
            log.warning("kvtransport: KV transfer for %s failed: %s", seq, exc)
            if isinstance(exc, kvtransport.PeerDisconnected):
                self._lost += 1
            self._waiting.pop(rid, None)
            self._fence(rid, failed=True)
            return
        self._landed.setdefault(rid, set()).add(seq)
        self._maybe_finish(rid, now)

    def _maybe_finish(self, rid: str, now: float) -> None:
        """Finish ``rid`` if it waits and all its parts landed (its own sequence when it has one sender; its
        parts once ``_expect`` knows them). Under ``_lock``."""
        landed = self._landed.get(rid, set())
        parts = self._parts.get(rid)
        if rid not in self._waiting or not landed or not (rid in landed or (parts and set(parts) <= landed)):
            return
        self._finish(rid, now)

    def _finish(self, rid: str, now: float) -> None:
        assert self.cm is not None
        start, deadline = self._waiting.pop(rid)
        seqs = self._landed.pop(rid, {rid})
        self._parts.pop(rid, None)
        try:
            for seq in seqs:
                self.cm.wait(seq, timeout=0)
            trace.event("d.landed", rid)
            if rid in self._held:  # first-token flow: reported once its first token is in its prompt
                self._landed_held[rid] = (start, deadline)
                self._ended(rid)
            else:
                self._report_landed(rid, start, now)
        except KVTransportError as exc:
            log.warning("kvtransport: KV transfer for %s failed: %s", rid, exc)
            if isinstance(exc, kvtransport.PeerDisconnected):
                self._lost += 1
            self._fence(rid, failed=True)
            return
        for seq in seqs:
            self.cm.release(seq)

    def _report_landed(self, rid: str, start: float, now: float) -> None:
        """``rid``'s KV landed and may be used: report it finished_recving. Under ``_lock``."""
        self._done_recv.add(rid)
        self._recv_blocks.pop(rid, None)
        self._ended(rid)
        self._times.append(now - start)
        trace.event("d.reported", rid)

    def _fence(self, rid: str, *, failed: bool) -> None:
        """Report ``rid`` only once no byte of it can land any more (the blocks may be reused right after):
        ``CommManager.abort`` tells every sender to stop and waits for their confirmation, off this thread."""
        if failed:
            self._failures += 1
        self._ended(rid)
        seqs = sorted(set(self._parts.pop(rid, {})) | self._landed.pop(rid, set()) | {rid})
        self._fences.put((rid, failed, seqs))

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
            rid, failed, seqs = item
            cm = self.cm
            if cm is None:
                return
            try:
                for seq in seqs:
                    cm.abort(seq, timeout=self.settings.connect_timeout)
            except kvtransport.TransferTimeout as exc:
                log.error("kvtransport: %s; retrying (its blocks stay held)", exc)
                time.sleep(1.0)
                self._fences.put(item)
                continue
            except KVTransportError as exc:  # closed: nothing can land any more
                log.info("kvtransport: abort of %s: %s", rid, exc)
            with self._lock:
                (self._failed_recv if failed else self._done_recv).add(rid)
                if not failed:  # an aborted receive is not a load error: its blocks are not reported
                    self._recv_blocks.pop(rid, None)

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
            counts = self.pusher.planner.counts
            now["dst_bound_before"], now["dst_bound_during"], now["dst_bound_after"] = (
                counts["before"], counts["during"], counts["after"])
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
        if self.dst_channel is not None:
            self.dst_channel.close()
        self._fences.put(None)
        if self.pusher is not None:
            self.pusher.close()
        if self.cm is not None:
            self.cm.close()
            self.cm = None
