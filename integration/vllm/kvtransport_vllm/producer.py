"""Prefill role of the scheduler side (``kv_producer``/``kv_both``): the transfers this engine serves.

It learns destination blocks from decode schedulers (side-channel ``dst`` messages, possibly before the prefill
request arrives: orphans, held within budgets, see MAX_ORPHANS), plans per step which blocks the workers put
(layer-wise while the prompt is computed, or whole right after the forward) and when a finished request's blocks
may be freed (leases, renewals, a decode's disconnect). The common part (:mod:`.scheduler`) owns the side channel,
the peers' hellos and geometry, and calls in here from vLLM's hooks; everything runs on the scheduler thread except
:meth:`Producer.answer_now` (the side channel's reader threads).
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtransport.admission import RateLimitedLog

from . import trace
from .metadata import MAX_FANOUT, Bind, SourceStep, StepPlan
from .pushplan import MAX_ORPHAN_BLOCKS, MAX_ORPHAN_BLOCKS_PER_ENGINE, MAX_PENDING, ORPHAN_ENTRY_COST
from .roles import RoleContext

if TYPE_CHECKING:
    from .sidechannel import SideChannelServer

log = logging.getLogger("vllm.kvtransport")

FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
# Orphans: destinations (and cancel counts) a decode sends for a prefill request that has not arrived yet. They are
# held for a lease within the worker planner's budgets (pushplan: the same decode sends the same destinations to the
# workers, which hold them alike), imported from there: per decode engine a count (MAX_ORPHANS_PER_ENGINE), a count
# per transfer (MAX_ORPHANS_PER_XFER) and block ids (MAX_ORPHAN_BLOCKS_PER_ENGINE, each entry ORPHAN_ENTRY_COST more),
# and in all MAX_ORPHAN_BLOCKS, shared max-min fairly: when it is full, the engine holding the most gives up its oldest
# entries for a newcomer, but only while it still holds more than the newcomer's engine then will. Before (issue 29)
# destinations were appended to an orphan without a cap (+330 MiB held for 80 MiB sent), and four made-up engine ids
# filled a count of 4,096, after which a real decode's early destination was refused.
#
# A destination refused or given up for a budget is *refused back to its decode* ("fail", as any refusal here): the
# decode sends a destination once and never again, so that decode request takes vLLM's failure path
# (kv_load_failure_policy: recomputed or failed), nothing else does. The workers are told to drop their early copy of
# it (a cancel in the next plan, see _take_orphan_cancels) so that nothing is put into blocks the decode gave up. A
# cancel count given up for a budget only delays: its prefill request waits for that destination until its lease.
MAX_ORPHANS_PER_ENGINE = MAX_PENDING
"""Entries (early destinations, plus one per transfer it sent a cancel count for) one decode engine may hold: the
worker's MAX_PENDING (4,096), a decode's early destinations for the prompts queued at this prefill."""
MAX_ORPHANS_PER_XFER = MAX_FANOUT
"""Early destinations one decode engine may hold for one transfer: the most decode requests a transfer serves
(kvt_fanout, MAX_FANOUT = 256). Not the worker's MAX_PENDING_PER_XFER (64): a worker drops an early destination at no
cost (the scheduler's plan brings it again), a refusal here fails a decode request. Per engine, so that engines
parking destinations on another's transfer id do not crowd that engine's own out."""
MAX_ORPHANS = MAX_ORPHAN_BLOCKS // ORPHAN_ENTRY_COST
"""Entries all decode engines' orphans can hold together (131,072): implied by MAX_ORPHAN_BLOCKS (each entry costs at
least ORPHAN_ENTRY_COST), not checked on its own. Was a count of 4,096 (1,024 per engine) that four made-up engine
ids filled (issue 29)."""
_CHILD = re.compile(r"^\d+_")


def _orphan_cost(d: Destination) -> int:
    """What early destination ``d`` costs: pushplan.orphan_cost (block ids of every KV cache group plus
    ORPHAN_ENTRY_COST), without building a Bind (it copies the block ids)."""
    return ORPHAN_ENTRY_COST + len(d.blocks) + sum(len(g) for g in d.extra)


def sampling_family(req_id: str) -> str | None:
    """The parent id of a parallel-sampling child (vLLM names children ``"{index}_{parent}"``), else None."""
    return _CHILD.sub("", req_id, count=1) if _CHILD.match(req_id) else None


def _siblings(req_id: str, other: str) -> bool:
    """Whether two request ids are children of one parallel-sampling request (they may share a transfer id)."""
    family = sampling_family(req_id)
    return family is not None and family == sampling_family(other)


@dataclass
class Destination:
    engine: str
    seq: str
    blocks: Sequence[int]  # as the message brought them: an array('I') off a packed frame (protocol.PACKED)
    offset: int
    extra: list[Sequence[int]] = field(default_factory=list)  # KV cache groups 1..: their blocks, aligned
    forwarded: bool = False  # handed to the workers in a plan (they put it, whenever it came to them first)
    cancelled: bool = False

    @property
    def settled(self) -> bool:
        """The workers have it (they put and signal it before any later release), or it was cancelled."""
        return self.forwarded or self.cancelled

    def bind(self, xfer: str) -> Bind:
        return Bind(xfer, self.engine, self.seq, tuple(self.blocks), self.offset, tuple(tuple(g) for g in self.extra))


@dataclass
class Source:
    """A prefill request whose KV goes to one or more decode requests."""

    req_id: str
    xfer: str
    mode: str  # "push" (our proxy, decode allocates first) or "pull" (NIXL-style params, decode asks after)
    fanout: int  # destinations expected (n of the decode request; pull mode: 1 unless the proxy said)
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    extra: list[list[int]] = field(default_factory=list)  # KV cache groups 1.. (hybrid models), aligned with blocks
    computed: int = 0
    dsts: list[Destination] = field(default_factory=list)
    msgs: int = 0
    cancels: int = 0
    complete: bool = False
    failed: str | None = None
    finished: bool = False  # request_finished was called
    delay_freed: bool = False  # we told vLLM to keep the blocks: a release must follow
    lease_until: float = 0.0  # a finished source not served by then is freed (renewals push it back)
    registered: float = field(default_factory=time.monotonic)
    holders: set[str] = field(default_factory=set)  # decode engines that asked for (renewed) this transfer
    debug_delay: bool = False
    discover: bool = False  # a proxy's one-token discovery request (no KV moves)
    sibling: bool = False  # a parallel-sampling child whose first sibling serves the shared transfer
    first_token: bool = False  # Splitwise order: the decode continues from the token this request samples
    first: int | None = None  # that token, once sampled
    first_told: set[str] = field(default_factory=set)  # decode engines it was sent to
    scheduled: bool = False  # a plan named it (its workers know it): destinations may be forwarded
    ready_sent: set[str] = field(default_factory=set)  # decode engines told "ready" for this transfer

    def destinations_known(self) -> bool:
        """Every expected destination arrived (or was cancelled)."""
        return len(self.dsts) + self.cancels >= self.fanout

    def served(self) -> bool:
        """No further destinations are expected, and the workers have every one that came (they put and signal
        it before they carry out a release that follows it)."""
        if self.mode == "pull":  # every decode child asks (children allocated in one step share a message)
            asked = len(self.dsts) if self.fanout > 1 else self.msgs
            return asked + self.cancels >= self.fanout and all(d.settled for d in self.dsts)
        done = sum(1 for d in self.dsts if d.settled) + self.cancels
        return done >= self.fanout and all(d.settled for d in self.dsts)


@dataclass
class _Share:
    """One decode engine's orphans, oldest first, and what they cost (see MAX_ORPHANS)."""

    held: OrderedDict[tuple[str, str | None], int] = field(default_factory=OrderedDict)
    """(xfer, seq) -> cost; seq None: the cancel count this engine sent for xfer (``cancels``)"""
    cost: int = 0
    per_xfer: dict[str, int] = field(default_factory=dict)
    """xfer -> early destinations held for it"""
    cancels: dict[str, int] = field(default_factory=dict)
    """xfer -> destinations this engine said will not come"""


def block_groups(block_ids: Any) -> list[list[int]]:
    """A finished request's blocks per KV cache group: vLLM hands one list (one group) or, to an HMA
    connector, one list per group."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return [list(g) for g in block_ids]
    return [list(block_ids or [])]


class Producer:
    """The prefill's transfers (see the module docstring). Made by the scheduler side with what it shares
    (``ctx``), the geometry verdicts it keeps (``unmappable``: decode engine -> why its KV cache cannot take
    ours, updated in place as hellos come) and this engine's place among its data-parallel siblings
    (``dp_route``: index, count). The side-channel server comes with :meth:`attach` (it needs
    :meth:`answer_now` first)."""

    def __init__(self, ctx: RoleContext, *, unmappable: dict[str, str], dp_route: tuple[int, int] = (0, 1)) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.num_groups = ctx.num_groups
        self.counters = ctx.counters  # shared with the common part (it reports and resets them)
        self.unmappable = unmappable
        self.dp_index, self.dp_count = dp_route
        self.server: SideChannelServer | None = None
        self.sources: dict[str, Source] = {}
        self.src_by_req: dict[str, Source] = {}
        self.orphans: dict[str, tuple[float, list[Destination], int]] = {}  # xfer -> (lease end, dsts, cancels)
        self.orphan_total = 0  # what every engine's orphans cost together (block ids, see MAX_ORPHANS)
        self._shares: dict[str, _Share] = {}  # decode engine -> its orphans
        self._orphan_engines: dict[str, set[str]] = {}  # xfer -> engines holding an orphan entry of it
        self._orphan_cancels: list[tuple[str, str, str]] = []  # (xfer, seq, engine): orphans the workers drop
        self.orphans_refused = 0  # orphan destinations refused for a budget (log and tests)
        self.orphans_evicted = 0  # orphan entries given up for a newcomer (log and tests)
        self._logs = RateLimitedLog(log)  # a flooding decode must not flood the log
        self.gone: dict[str, str] = {}  # xfer -> why it can no longer be served (bounded)
        # pull flow with n>1 (vLLM's toy proxy forwards the same n to both sides): the prefill computes n
        # children, only one child's params reach the decode, and each of the decode's n children pulls that
        # one. Per family: live sources, and how many pulls (or cancels) arrived. The family is served once
        # as many arrived as it has children; then every sibling goes (see _family_served).
        self.family_size: dict[str, int] = {}
        self.family_asked: dict[str, int] = {}
        self.holds: dict[str, tuple[float, set[str]]] = {}  # xfer -> (expiry, engines): renewed before registered
        self.foreign_refused = 0  # dst / cancel naming another decode engine's request (log and tests)
        self._releases: list[str] = []
        self._cancels: list[tuple[str, str]] = []  # (xfer, seq) destinations the workers must stop putting to
        self._dropped: list[str] = []  # prefill requests given up: the workers forget them

    def attach(self, server: SideChannelServer) -> None:
        """The side-channel server the scheduler side started for this engine (its ``dst``/``renew``/``bye``
        come through the inbox; ``ready``, ``first`` and failures go out through it)."""
        self.server = server

    @property
    def port(self) -> int:
        """The side channel's port (0 before :meth:`attach`)."""
        return self.server.port if self.server is not None else 0

    def discovery_params(self) -> dict[str, Any]:
        """What a proxy needs to address this prefill engine's side channel, and to route a prefill leg to it
        under data parallelism: the ``X-data-parallel-rank`` value that reaches it (``kvt_dp_rank``) among
        ``kvt_dp_size`` engines behind this API server."""
        return {"kvt_host": self.settings.address, "kvt_port": self.port, "kvt_engine_id": self.ctx.engine_id,
                "kvt_mode": self.settings.mode, "kvt_dp_rank": self.dp_index, "kvt_dp_size": self.dp_count}

    # ------------------------------------------------------------------ vLLM hooks (prefill requests)
    def _send_ready(self, src: Source) -> None:
        """Tell each decode engine holding ``src``'s transfer (and not told yet) that it may allocate now."""
        if self.server is None:
            return
        for engine in src.holders - src.ready_sent:
            if self.server.send(engine, {"type": "ready", "xfers": [src.xfer]}):
                src.ready_sent.add(engine)

    def request_finished(self, request: Any, block_ids: list[int] | tuple[list[int], ...],
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) until the workers pushed them; returns NIXL-compatible ``kv_transfer_params``
        for the decode side."""
        rid = request.request_id
        if self.ctx.params(request).discover:
            self._drop_source(rid)
            return False, self.discovery_params()
        src = self.src_by_req.get(rid)
        if src is None:
            src = self.register_source(request)
        if src.sibling:  # its first sibling serves the transfer
            self._drop_source(rid)
            return False, None
        src.finished = True
        if src.failed is not None:  # given up while computed (its decode went away)
            if src.scheduled:  # its workers may have put from its blocks: released once those puts are flushed
                src.delay_freed = True
                return True, None
            self._drop_source(rid)
            return False, None
        if not src.dsts and self._family_served(src):
            self._drop_source(rid)  # its siblings took every pull: nobody will ask for this one
            return False, None
        status = getattr(request.status, "name", str(request.status))
        trace.event("p.finished", src.xfer, req=rid)
        groups = block_groups(block_ids)
        block_ids = groups[0]
        if status in FINISHED_OK and block_ids:
            if src.first_token and src.first is None and request.num_output_tokens > 0:
                src.first = int(request.output_token_ids[0])
                self._tell_first(src)
            src.complete = True
            src.blocks = list(block_ids)
            src.extra = groups[1:]
            src.computed = max(src.computed, min(request.num_computed_tokens, src.prompt_len))
            src.lease_until = max(src.lease_until, time.monotonic() + self.settings.lease)
            src.delay_freed = True
            out = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(block_ids), "remote_engine_id": self.ctx.engine_id,
                "remote_request_id": src.xfer, "remote_host": self.settings.address, "remote_port": self.port,
                "tp_size": self.ctx.tp_size, "remote_num_tokens": src.prompt_len,
                "kvt_connector": "kvtransport",
            }
            if src.mode == "push":
                out["kvt_xfer"] = src.xfer
            return True, out
        src.failed = f"prefill request {rid} ended with {status}"
        self._fail_dsts(src, src.failed)
        if src.scheduled:
            src.delay_freed = True
            return True, None
        self._drop_source(rid)
        return False, None

    def has_pending_work(self) -> bool:
        """True while destinations wait for their prefill request, or releases or cancels are queued."""
        return bool(self.orphans or self._releases or self._cancels or self._dropped or self._orphan_cancels)

    # ------------------------------------------------------------------ per step
    def plan_step(self, scheduler_output: Any, plan: StepPlan, now: float) -> None:
        """This step's sources (what the forward computes), the destinations the workers do not have yet,
        cancels and releases. The workers carry them out in this order: a destination is put and signalled before
        a release that follows it."""
        self._plan_scheduled(scheduler_output, plan)
        self._plan_completed(plan, now)
        plan.cancels, self._cancels = self._cancels + self._take_orphan_cancels(), []
        plan.dropped, self._dropped = self._dropped, []
        plan.send_release, self._releases = self._releases, []

    def on_event(self, ev: tuple[Any, ...], now: float) -> None:
        """A side-channel event of a decode engine: a checked message (``msg``) or its channel's end (``bye``)."""
        if ev[0] == "msg":
            self._on_message(ev[1], ev[2], now)
        elif ev[0] == "bye":
            self._engine_gone(str(ev[1]), str(ev[2]))

    def expire(self, now: float) -> None:
        """After the inbox was drained: fail destinations waiting for a prefill request that never came; forget
        expired holds."""
        for xfer in [x for x, (dl, _, _) in self.orphans.items() if dl <= now]:
            _, dsts, _ = self._pop_orphan(xfer)
            for d in dsts:
                self._orphan_cancels.append((xfer, d.seq, d.engine))
                self.send_fail(d.engine, [d.seq], f"no prefill request for transfer {xfer} arrived within "
                                                   f"{self.settings.lease:g}s")
        for xfer in [x for x, (dl, _) in self.holds.items() if dl <= now]:
            del self.holds[xfer]

    # ------------------------------------------------------------------ internals
    def transfer_taken(self, request: Any) -> str | None:
        """Why new prefill request ``request`` cannot have the transfer id its params name: another live request of
        this engine holds it and is not a child of the same parallel-sampling request (one id would hand one
        prompt's KV, or its first token, to the other's decode). None when the id is free, or ``request`` is
        registered already. Scheduler thread; O(1); never raises."""
        rid = request.request_id
        if rid in self.src_by_req:
            return None
        params = self.ctx.params(request)
        if params.discover:
            return None
        xfer = params.xfer if params.xfer is not None else rid
        live = self.sources.get(xfer)
        if live is None or live.req_id == rid:
            return None
        if params.xfer is not None and _siblings(rid, live.req_id):
            return None
        return (f"kv_transfer_params refused: transfer id {xfer[:64]!r} is in use by another live prefill request of "
                "this engine; give each request its own (kvt_xfer or transfer_id: only the children of one "
                "parallel-sampling request share one)")

    def register_source(self, request: Any) -> Source:
        rid = request.request_id
        src = self.src_by_req.get(rid)
        if src is not None:
            return src
        params = self.ctx.params(request)  # checked (the scheduler side refused a request with bad ones)
        push = params.xfer is not None
        xfer = params.xfer if params.xfer is not None else rid
        src = Source(rid, xfer, "push" if push else "pull", params.fanout, int(request.num_prompt_tokens),
                      debug_delay=params.debug_delay and self.settings.debug_push_delay > 0,
                      discover=params.discover, first_token=push and params.first_token)
        trace.event("p.new", xfer, req=rid)
        self.src_by_req[rid] = src
        first = self.sources.get(xfer) if push else None
        if first is not None and first is not src and _siblings(rid, first.req_id):
            # a sibling of a parallel-sampling family that shares one transfer id (a router that sends the
            # client's n to the prefill, Mooncake-style): the prompt's KV is the same, so the first child serves
            # every decode child and this one holds nothing
            first.fanout += 1
            src.sibling = True
            return src
        fam = self._family(src)
        if fam is not None:
            self.family_size[fam] = self.family_size.get(fam, 0) + 1
        if not params.discover:
            self.sources[xfer] = src
            hold = self.holds.pop(xfer, None)
            if hold is not None:
                src.holders |= hold[1]
            orphan = self._pop_orphan(xfer) if xfer in self.orphans else None
            if orphan is not None:
                _, dsts, cancels = orphan
                src.dsts.extend(dsts)
                src.msgs += 1 if dsts else 0
                src.cancels += cancels
                if dsts:
                    trace.event("p.dst", xfer, req=rid, wait=0.0)
        return src

    @staticmethod
    def _family(src: Source) -> str | None:
        """The sampling family whose pulls ``src`` shares (pull mode, n unknown: see family_size)."""
        return sampling_family(src.req_id) if src.mode == "pull" and src.fanout == 1 else None

    def _family_served(self, src: Source) -> bool:
        """Every child of ``src``'s family has asked (or cancelled): no further pull will come."""
        fam = self._family(src)
        return fam is not None and self.family_asked.get(fam, 0) >= self.family_size.get(fam, 1)

    def _family_asks(self, src: Source, count: int) -> None:
        fam = self._family(src)
        if fam is not None and count:
            self.family_asked[fam] = self.family_asked.get(fam, 0) + count

    def _drop_source(self, rid: str) -> None:
        """Forget prefill request ``rid``; its workers forget it too (with its release, or told here)."""
        src = self.src_by_req.pop(rid, None)
        if src is not None and src.scheduled and not src.delay_freed and rid not in self._dropped:
            self._dropped.append(rid)
        fam = self._family(src) if src is not None else None
        if fam is not None:
            left = self.family_size.get(fam, 1) - 1
            if left > 0:
                self.family_size[fam] = left
            else:  # the family's last source: forget it
                self.family_size.pop(fam, None)
                self.family_asked.pop(fam, None)
        if src is not None and self.sources.get(src.xfer) is src:
            del self.sources[src.xfer]
            self.gone[src.xfer] = src.failed or "source released"
            while len(self.gone) > 4096:
                self.gone.pop(next(iter(self.gone)))

    def answer_now(self, engine: str, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Side-channel reader thread: a destination for a transfer this prefill already freed is refused at
        once — an idle engine would only see it at its next step (minutes, or the decode's timeout). Reads
        ``gone``/``sources`` only (a freed transfer never comes back); everything else goes to the inbox."""
        if msg.get("type") != "dst":
            return None
        xfer = str(msg.get("xfer"))
        why = self.gone.get(xfer)  # the side channel starts after this object is complete: both exist
        if why is None or xfer in self.sources:
            return None
        seqs = [str(d.get("seq")) for d in msg.get("dsts", []) if isinstance(d, dict)]
        if not seqs:
            return None
        log.warning("kvtransport: transfer %s to %s failed: prefill cannot serve transfer %s: %s", seqs,
                    engine, xfer, why)
        return {"type": "fail", "seqs": seqs, "reason": f"prefill cannot serve transfer {xfer}: {why}"}

    def _foreign(self, engine: str, xfer: str, seqs: list[str]) -> set[str]:
        """Of ``seqs``, those another decode engine registered for ``xfer``: ``engine`` may not act on them."""
        src = self.sources.get(xfer)
        known = (src.dsts if src is not None else []) + (self.orphans[xfer][1] if xfer in self.orphans else [])
        theirs = {d.seq for d in known if d.engine != engine} & set(seqs)
        if theirs:
            self.foreign_refused += len(theirs)
            log.warning("kvtransport: decode engine %s named requests %s of transfer %s that another engine "
                        "owns; refused", engine, sorted(theirs)[:8], xfer)
        return theirs

    def _on_message(self, engine: str, msg: dict[str, Any], now: float) -> None:
        """A checked (``protocol.check_message``) message from decode ``engine``. Ownership: a decode request
        (``seq``) belongs to the engine that first sent its destination; another engine's dst or cancel naming
        it is refused, and a count-cancel needs the sender to hold the transfer (when anyone holds it)."""
        mtype = msg.get("type")
        xfer = str(msg.get("xfer"))
        src = self.sources.get(xfer)
        if mtype == "renew":
            self._renewed(engine, [str(x) for x in msg.get("xfers", [])], now)
            return
        if mtype == "dst":
            dsts = [Destination(engine, d["seq"], d["blocks"], d["offset"], extra=list(d.get("groups", [])))
                    for d in msg.get("dsts", [])]
            if engine in self.unmappable:
                for d in dsts:
                    self.send_fail(engine, [d.seq], self.unmappable[engine])
                return
            for d in [d for d in dsts if len(d.extra) != self.num_groups - 1]:
                self.send_fail(engine, [d.seq], f"KV cache groups differ: decode {len(d.extra) + 1}, prefill "
                                                 f"{self.num_groups} (run both with the same model and HMA setting)")
            dsts = [d for d in dsts if len(d.extra) == self.num_groups - 1]
            if not dsts:
                return
            foreign = self._foreign(engine, xfer, [d.seq for d in dsts])
            for seq in sorted(foreign):
                self.send_fail(engine, [seq], f"request {seq} of transfer {xfer} belongs to another decode engine")
            dsts = [d for d in dsts if d.seq not in foreign]
            if not dsts and foreign:
                return
            self._renewed(engine, [xfer], now)
            if src is None:
                if msg.get("mode") == "push" and xfer not in self.gone:
                    for d in dsts:
                        why = self._hold(engine, xfer, d, now)
                        if why is not None:
                            self.orphans_refused += 1
                            self._orphan_cancels.append((xfer, d.seq, engine))
                            self.send_fail(engine, [d.seq], why, quiet="orphan refused")
                else:
                    why = self.gone.get(xfer, "unknown transfer (expired, or sent to the wrong prefill instance)")
                    for d in dsts:
                        self.send_fail(engine, [d.seq], f"prefill cannot serve transfer {xfer}: {why}")
                return
            if src.failed is not None:
                for d in dsts:
                    self.send_fail(engine, [d.seq], src.failed)
                return
            known = src.destinations_known()
            src.dsts.extend(dsts)
            src.msgs += 1
            self._family_asks(src, len(dsts))
            if not known and src.destinations_known():
                trace.event("p.dst", src.xfer, req=src.req_id)
            if src.first is not None:
                self._tell_first(src)
        elif mtype == "cancel":
            seqs = {str(s) for s in msg.get("seqs", [])}
            seqs -= self._foreign(engine, xfer, sorted(seqs))
            count = int(msg.get("count", 0))
            holders = src.holders if src is not None else self.holds.get(xfer, (0.0, set()))[1]
            if count and holders and engine not in holders:
                self.foreign_refused += 1
                log.warning("kvtransport: decode engine %s cancelled transfer %s that only %s hold; refused",
                            engine, xfer, sorted(holders)[:4])
                count = 0
            if src is None:
                for d in [d for d in self.orphans.get(xfer, (0.0, [], 0))[1] if d.seq in seqs]:
                    self._unhold(d.engine, xfer, d.seq)
                    self._orphan_cancels.append((xfer, d.seq, d.engine))  # its workers may hold it too
                if count and (xfer in self.orphans or (msg.get("mode") == "push" and xfer not in self.gone)):
                    self._hold_cancels(engine, xfer, count, now)
                return
            for d in src.dsts:
                if d.seq in seqs:
                    self._cancel(src, d)
            src.cancels += count
            self._family_asks(src, count)
        else:
            log.warning("kvtransport side channel: ignoring message type %r from %s", mtype, engine)

    # ------------------------------------------------------------------ orphans (see MAX_ORPHANS)
    def _admit(self, engine: str, key: tuple[str, str | None], cost: int) -> str | None:
        """Make room for orphan entry ``key`` of ``engine`` costing ``cost`` and account for it; None, or why it
        is refused (then nothing changed). O(1), plus O(engines + entries given up) when the total is full."""
        share = self._shares.get(engine) or _Share()
        if len(share.held) >= MAX_ORPHANS_PER_ENGINE:
            return (f"refused: decode engine {engine} holds {MAX_ORPHANS_PER_ENGINE} destinations whose prefill "
                    "request has not arrived (MAX_ORPHANS_PER_ENGINE)")
        if key[1] is not None and share.per_xfer.get(key[0], 0) >= MAX_ORPHANS_PER_XFER:
            return (f"refused: decode engine {engine} holds {MAX_ORPHANS_PER_XFER} destinations for transfer {key[0]}, "
                    "whose prefill request has not arrived (MAX_ORPHANS_PER_XFER)")
        if share.cost + cost > MAX_ORPHAN_BLOCKS_PER_ENGINE:
            return (f"refused: decode engine {engine} holds too many block ids in destinations whose prefill request "
                    "has not arrived (MAX_ORPHAN_BLOCKS_PER_ENGINE)")
        if not self._make_room(engine, share.cost + cost, cost):
            return (f"refused: destinations whose prefill request has not arrived fill MAX_ORPHAN_BLOCKS, and decode "
                    f"engine {engine} holds its share")
        self._shares[engine] = share
        share.held[key] = cost
        share.cost += cost
        self.orphan_total += cost
        self._orphan_engines.setdefault(key[0], set()).add(engine)
        return None

    def _hold(self, engine: str, xfer: str, d: Destination, now: float) -> str | None:
        """Hold early destination ``d`` of ``engine`` for ``xfer`` within the budgets; None (held, or the same
        destination is held already) or why it is refused."""
        share = self._shares.get(engine)
        if share is not None and (xfer, d.seq) in share.held:
            return None  # a repeat: the first one stays (a decode sends each destination once)
        why = self._admit(engine, (xfer, d.seq), _orphan_cost(d))
        if why is not None:
            return why
        share = self._shares[engine]
        share.per_xfer[xfer] = share.per_xfer.get(xfer, 0) + 1
        self.orphans.setdefault(xfer, (now + self.settings.lease, [], 0))[1].append(d)
        return None

    def _hold_cancels(self, engine: str, xfer: str, count: int, now: float, *, force: bool = False) -> None:
        """``count`` more destinations of ``xfer`` that ``engine`` says will not come (one entry per engine and
        transfer: ORPHAN_ENTRY_COST). ``force``: it replaces a costlier entry of the same engine (no budget check).
        Refused for a budget: dropped (the prefill request then waits for them until its lease)."""
        share = self._shares.get(engine)
        if share is None or xfer not in share.cancels:
            if force:
                share = self._shares.setdefault(engine, _Share())
                share.held[(xfer, None)] = ORPHAN_ENTRY_COST
                share.cost += ORPHAN_ENTRY_COST
                self.orphan_total += ORPHAN_ENTRY_COST
                self._orphan_engines.setdefault(xfer, set()).add(engine)
            else:
                why = self._admit(engine, (xfer, None), ORPHAN_ENTRY_COST)
                if why is not None:
                    self.orphans_refused += 1
                    self._logs.log(logging.WARNING, "orphan cancel refused", "kvtransport: cancel of %d destination(s) "
                                   "of transfer %s from decode engine %s dropped: %s", count, xfer, engine, why)
                    return
                share = self._shares[engine]
        share.cancels[xfer] = share.cancels.get(xfer, 0) + count
        dl, dsts, cancels = self.orphans.get(xfer, (now + self.settings.lease, [], 0))
        self.orphans[xfer] = (dl, dsts, cancels + count)

    def _make_room(self, engine: str, after: int, cost: int) -> bool:
        """Make room for ``cost`` more in all (MAX_ORPHAN_BLOCKS) for ``engine``, which will then hold ``after``:
        the engine holding the most gives up its oldest entries while it holds more than ``after``, then the next.
        False when that is not enough; then nothing is given up."""
        need = self.orphan_total + cost - MAX_ORPHAN_BLOCKS
        if need <= 0:
            return True
        victims: list[tuple[str, tuple[str, str | None]]] = []
        over = sorted((e for e, s in self._shares.items() if e != engine and s.cost > after),
                      key=lambda e: self._shares[e].cost, reverse=True)
        for e in over:  # the order of "the one holding the most": each gives up until it holds no more than after
            left = self._shares[e].cost
            for key, c in self._shares[e].held.items():
                if left <= after or need <= 0:
                    break
                victims.append((e, key))
                left -= c
                need -= c
            if need <= 0:
                break
        if need > 0:
            return False
        for e, (xfer, seq) in victims:
            self.orphans_evicted += 1
            if seq is None:
                n = self._shares[e].cancels.get(xfer, 0)
                self._unhold(e, xfer, None)
                self._logs.log(logging.WARNING, "orphan cancel evicted", "kvtransport: cancel of %d destination(s) of "
                               "transfer %s from decode engine %s given up for decode engine %s (MAX_ORPHAN_BLOCKS)",
                               n, xfer, e, engine)
            else:
                self._unhold(e, xfer, seq)
                self._orphan_cancels.append((xfer, seq, e))
                self.send_fail(e, [seq], f"refused: destinations whose prefill request has not arrived fill "
                                         f"MAX_ORPHAN_BLOCKS; decode engine {e} holds the most and gave up its oldest",
                               quiet="orphan evicted")
        return True

    def _release(self, engine: str, key: tuple[str, str | None]) -> int:
        """Take orphan entry ``key`` of ``engine`` out of the budgets; returns its cancel count (seq None)."""
        share = self._shares.get(engine)
        cost = share.held.pop(key, None) if share is not None else None
        if share is None or cost is None:
            return 0
        xfer, seq = key
        share.cost -= cost
        self.orphan_total -= cost
        count = 0
        if seq is None:
            count = share.cancels.pop(xfer, 0)
        else:
            left = share.per_xfer.pop(xfer, 1) - 1
            if left:
                share.per_xfer[xfer] = left
        if xfer not in share.per_xfer and xfer not in share.cancels:
            engines = self._orphan_engines.get(xfer)
            if engines is not None:
                engines.discard(engine)
                if not engines:
                    del self._orphan_engines[xfer]
        if not share.held:
            del self._shares[engine]
        return count

    def _unhold(self, engine: str, xfer: str, seq: str | None) -> None:
        """Forget orphan entry ``seq`` of ``engine`` for ``xfer`` (seq None: its cancel count); an orphan left
        with nothing goes."""
        count = self._release(engine, (xfer, seq))
        entry = self.orphans.get(xfer)
        if entry is None:
            return
        dl, dsts, cancels = entry
        if seq is not None:
            dsts = [d for d in dsts if not (d.seq == seq and d.engine == engine)]
        if dsts or cancels - count > 0:
            self.orphans[xfer] = (dl, dsts, cancels - count)
        else:
            del self.orphans[xfer]
            self._orphan_engines.pop(xfer, None)

    def _pop_orphan(self, xfer: str) -> tuple[float, list[Destination], int]:
        """Take ``xfer``'s orphan out (its prefill request arrived, or its lease ended) and out of the budgets."""
        entry = self.orphans.pop(xfer)
        for d in entry[1]:
            self._release(d.engine, (xfer, d.seq))
        for engine in list(self._orphan_engines.get(xfer, ())):
            self._release(engine, (xfer, None))
        self._orphan_engines.pop(xfer, None)
        return entry

    def _take_orphan_cancels(self) -> list[tuple[str, str]]:
        """Orphans refused, given up, cancelled or expired here that the workers may hold too (the decode sends
        its destinations straight to them as well, and they bind theirs when the prefill request is scheduled):
        they drop them. A cancel names (xfer, seq) only, so one for a destination someone holds here now (another
        engine's, sent since) is left out: an engine cannot cancel another's destination by being refused."""
        out: list[tuple[str, str]] = []
        for xfer, seq, _ in self._orphan_cancels:
            src = self.sources.get(xfer)
            known = (src.dsts if src is not None else []) + self.orphans.get(xfer, (0.0, [], 0))[1]
            if not any(d.seq == seq and not d.cancelled for d in known) and (xfer, seq) not in out:
                out.append((xfer, seq))
        self._orphan_cancels = []
        return out

    def _tell_first(self, src: Source) -> None:
        """Send ``src``'s first token to every decode engine that holds or receives its transfer (not told yet)."""
        if self.server is None or src.first is None:
            return
        for engine in (src.holders | {d.engine for d in src.dsts if not d.cancelled}) - src.first_told:
            if self.server.send(engine, {"type": "first", "xfer": src.xfer, "token": src.first}):
                src.first_told.add(engine)
                self.counters["first_tokens_sent"] += 1
                trace.event("p.first_sent", src.xfer, engine=engine)

    def _plan_scheduled(self, so: Any, plan: StepPlan) -> None:
        """The sources this step computes (their blocks so far and the prompt tokens it adds), for the workers."""
        for nd in so.scheduled_new_reqs:
            src = self.src_by_req.get(nd.req_id)
            if src is not None:
                src.blocks = list(nd.block_ids[0]) if nd.block_ids else []
                src.extra = [list(g) for g in nd.block_ids[1:]] if nd.block_ids else []
                self._advance(src, nd.num_computed_tokens, so.num_scheduled_tokens.get(nd.req_id, 0), plan)
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            src = self.src_by_req.get(rid)
            if src is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:  # preempted, recomputed into new blocks (what was put stays put: same KV)
                src.blocks = list(new_ids[0]) if new_ids else []
                src.extra = [list(g) for g in new_ids[1:]] if new_ids else []
            elif new_ids:
                src.blocks.extend(new_ids[0])
                for g, more in enumerate(new_ids[1:]):
                    while len(src.extra) <= g:
                        src.extra.append([])
                    src.extra[g].extend(more)
            self._advance(src, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0), plan)

    def _advance(self, src: Source, before: int, scheduled: int, plan: StepPlan) -> None:
        """``src`` computes prompt tokens ``[before, before + scheduled)`` in this step: tell the workers (they put
        its layers into the destinations bound so far as the forward computes them), and the decodes holding it
        that it runs (they may allocate now)."""
        if before >= src.prompt_len or scheduled <= 0 or src.failed is not None or src.discover or src.sibling:
            return
        after = min(before + scheduled, src.prompt_len)
        src.computed = after
        if not src.scheduled:
            src.scheduled = True
            self._send_ready(src)
        if after >= src.prompt_len:
            trace.event("p.scheduled", src.xfer, req=src.req_id)
        plan.sources.append(SourceStep(
            src.req_id, src.xfer, src.prompt_len, (tuple(src.blocks), *(tuple(g) for g in src.extra)), before, after,
            layerwise=self.settings.mode == "push" and src.mode == "push",
            delay=self.settings.debug_push_delay if src.debug_delay else 0.0))

    def _plan_completed(self, plan: StepPlan, now: float) -> None:
        """Hand the workers the destinations they do not have yet (of sources they know), and release the sources
        that are served (after those destinations: the workers put and signal them first), failed, or whose lease
        expired."""
        for src in list(self.src_by_req.values()):
            if (src.scheduled or src.complete) and src.failed is None:
                for d in src.dsts:
                    if not d.settled:
                        plan.binds.append(d.bind(src.xfer))
                        d.forwarded = True
            if not src.finished:
                continue
            if self._family(src) is not None:  # a family's pulls may go to any one of its sources
                done = src.failed is not None or (self._family_served(src) and all(d.settled for d in src.dsts))
            else:
                done = src.failed is not None or src.served()
            if not done and now >= src.lease_until:
                log.warning("kvtransport: prefill request %s (transfer %s): lease expired (%d destination(s) still "
                            "missing, no word from a decode for %gs); freeing its blocks", src.req_id, src.xfer,
                            max(0, src.fanout - len(src.dsts) - src.cancels), self.settings.lease)
                self.counters["lease_expirations"] += 1
                done = True
            if done:
                if src.failed is not None and src.scheduled:  # no further puts from it (then flushed, released)
                    self._dropped.append(src.req_id)
                if src.delay_freed:
                    self._releases.append(src.req_id)
                self._drop_source(src.req_id)

    def _renewed(self, engine: str, xfers: list[str], now: float) -> None:
        """``engine`` still wants these transfers: extend their leases and remember it as their holder."""
        until = now + self.settings.lease
        for xfer in xfers:
            src = self.sources.get(xfer)
            if src is not None:
                src.holders.add(engine)
                src.lease_until = max(src.lease_until, until)
                if src.scheduled or src.complete:  # it runs (or ran): this decode may allocate
                    self._send_ready(src)
                if src.first is not None:
                    self._tell_first(src)
            elif xfer not in self.gone:  # re-inserted: the bound below drops the least recently renewed
                _, engines = self.holds.pop(xfer, (until, set()))
                self.holds[xfer] = (until, engines | {engine})
        while len(self.holds) > 4096:
            self.holds.pop(next(iter(self.holds)))

    def _engine_gone(self, engine: str, reason: str) -> None:
        """A decode engine's side channel ended: give up what only it was waiting for (no lease wait)."""
        share = self._shares.get(engine)
        for xfer, seq in list(share.held) if share is not None else []:
            if seq is not None:  # its early destinations will not come: counted as cancelled (one entry, cheaper)
                self._hold_cancels(engine, xfer, 1, 0.0, force=True)
                self._unhold(engine, xfer, seq)
                self._orphan_cancels.append((xfer, seq, engine))
        for xfer, (_, engines) in list(self.holds.items()):
            engines.discard(engine)
            if not engines:
                del self.holds[xfer]
        for src in list(self.src_by_req.values()):
            mine = [d for d in src.dsts if d.engine == engine]
            if engine not in src.holders and not mine:
                continue
            src.holders.discard(engine)
            for d in mine:
                self._cancel(src, d)
            if src.failed is None and not src.holders and not any(not d.cancelled for d in src.dsts):
                src.failed = f"decode engine {engine} disconnected ({reason})"
                self.counters["decode_disconnects"] += 1
                log.warning("kvtransport: prefill request %s (transfer %s): %s; freeing its blocks",
                            src.req_id, src.xfer, src.failed)

    def _fail_dsts(self, src: Source, reason: str) -> None:
        for d in src.dsts:
            if not d.cancelled:
                self.send_fail(d.engine, [d.seq], reason)
                self._cancel(src, d)

    def _cancel(self, src: Source, d: Destination) -> None:
        """No more puts to ``d`` (told to the workers when they have it)."""
        if not d.cancelled and d.forwarded:
            self._cancels.append((src.xfer, d.seq))
        d.cancelled = True

    def send_fail(self, engine: str, seqs: list[str], reason: str, *, quiet: str | None = None) -> None:
        """Tell decode ``engine`` that ``seqs`` will get no KV from here. ``quiet``: log it rate-limited under that
        key (refusals a flooding decode causes)."""
        if quiet is None:
            log.warning("kvtransport: transfer to %s %s failed: %s", engine, seqs, reason)
        else:
            self._logs.log(logging.WARNING, quiet, "kvtransport: transfer to %s %s failed: %s", engine, seqs, reason)
        if self.server is None or not self.server.send(engine, {"type": "fail", "seqs": seqs, "reason": reason}):
            if quiet is None:
                log.warning("kvtransport: cannot tell decode engine %s (not connected)", engine)
            else:
                self._logs.log(logging.WARNING, quiet + " untold", "kvtransport: cannot tell decode engine %s (not "
                               "connected)", engine)

