"""Which KV a prefill worker puts into each destination, and when: start now, bind late.

A push-flow prefill request runs the moment the prefill scheduler takes it; its decode's destination blocks
(:class:`Bind`) reach the worker whenever they come: before the request's first layer, in the middle of a
forward, between two prefill chunks or after the prompt is computed. This module is the worker's bookkeeping of
both (pure: no I/O, no thread; the pusher thread calls it and carries out the :class:`PutOp` / :class:`SignalOp`
it returns):

* per source (a prefill request of this engine), what is computed: every layer up to ``done`` tokens, and during
  a step the layers already visited up to the step's ``stop``;
* per destination and layer, how far its KV was put (``pushed``, in prompt tokens).

When a destination binds, every layer already computed goes in one batched put per distinct range (at most two
per KV cache group: the layers of the current step and the others); then each newly computed layer goes as the
forward reaches it. Like-for-like destinations get whole blocks: a block is put once it is complete (or, at the
prompt's end, once the prompt is), so every block of every layer is written exactly once; unlike destinations
(other TP size, block size or head order) get exact token ranges, mapped by the worker (:mod:`kvtransport.reshard`).
The sequence's signal follows once every layer of it was put. With several KV cache groups, pairs where either
side holds vLLM's null block (a sliding window's skipped blocks) are left out.

Destinations that come before their prefill request (*orphans*: a decode sends them straight to the workers) wait
for a lease, within budgets per decode engine (destinations, destinations per transfer, block ids) and in all, shared
max-min fairly between engines (see MAX_ORPHAN_BLOCKS); one dropped here is not lost: the scheduler hands the same
destination to the workers with its plan once the prefill request is scheduled. A source's destinations are
bounded per engine too (MAX_DSTS_PER_ENGINE).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .metadata import NULL_BLOCK, Bind, Push, SourceStep

MAX_PENDING = 4096
"""Destinations one decode engine may hold whose prefill request the worker has not heard of yet (held for a lease):
a decode's early destinations for the prompts queued at this prefill."""
MAX_PENDING_PER_XFER = 64
"""Early destinations one decode engine may hold for one transfer (``n`` of a decode request; more come with the
scheduler's plan). Per engine, so that engines parking destinations on another's transfer id do not crowd that
engine's own out."""
MAX_DSTS_PER_ENGINE = 256
"""Destinations one decode engine may bind to one source (the decode requests a transfer serves: ``kvt_fanout``, at
most the scheduler's MAX_FANOUT, 256): each costs the source a push per layer range."""
ORPHAN_ENTRY_COST = 16
"""What an early destination costs besides its block ids, counted in block ids (one is ~36 bytes: a Python int in a
tuple; a destination's own objects take ~600 bytes)."""
MAX_ORPHAN_BLOCKS_PER_ENGINE = 1 << 19
"""Block ids (ORPHAN_ENTRY_COST more per destination) one decode engine's early destinations may hold: ~18 MiB,
e.g. 128 destinations of 64k-token prompts at 16-token blocks. Without it a decode parked +330 MiB here for 80 MiB
sent (issue 29); a destination over it is refused (the scheduler's plan brings it again)."""
MAX_ORPHAN_BLOCKS = 4 * MAX_ORPHAN_BLOCKS_PER_ENGINE
"""Block ids all engines' early destinations may hold together (~72 MiB). When a destination would go past it, the
engine holding the most gives up its oldest destinations for it, as long as it still holds more than the newcomer's
engine then will (max-min fair: k flooding engine ids keep another engine's share at 1/(k+1) of this at worst, and
never take from an engine holding less than they do). Before, four made-up engine ids filled every slot and a real
decode's early destination was refused."""

BEFORE, DURING, AFTER = "before", "during", "after"
"""When a destination bound, relative to its source's forward: before its first layer was computed, while the
prompt was being computed, after it was complete."""


@dataclass(frozen=True)
class PutOp:
    """Put ``push`` into layers ``layers`` (one put per layer set). ``signal_layers``: signal each of those layers
    after its put (the prompt's last chunk, put layer by layer as it is computed)."""

    push: Push
    layers: tuple[int, ...]
    signal_layers: bool = False


@dataclass(frozen=True)
class SignalOp:
    """Every layer of ``push.seq`` was put: signal the sequence (``kind``: "layerwise" when the destination was
    known while the prompt was computed, "whole" when it came after)."""

    push: Push
    kind: str


Op = PutOp | SignalOp


@dataclass
class _Dst:
    bind: Bind
    geo: dict[str, Any] | None  # the decode's geometry when it differs from ours (token ranges), else None
    pushed: list[int]  # per layer: prompt tokens put so far
    phase: str
    final_sent: bool = False
    cancelled: bool = False
    pushes: dict[tuple[int, int, int], Push | None] = field(default_factory=dict)  # (group, lo, hi) -> its push


@dataclass
class _Orphans:
    """One decode engine's early destinations, oldest first, and what they cost (see MAX_ORPHAN_BLOCKS)."""

    held: OrderedDict[tuple[str, str], tuple[float, int]] = field(default_factory=OrderedDict)
    """(xfer, seq) -> (since, cost)"""
    cost: int = 0
    per_xfer: dict[str, int] = field(default_factory=dict)
    """xfer -> destinations held for it"""


MAX_CANCELLED = 16384
"""Cancelled (transfer, request) pairs a worker remembers, so that a copy of the destination that comes after the
cancel is refused (a decode request's id is never reused after it finished). ~100 bytes each: ~1.6 MiB."""


def orphan_cost(b: Bind) -> int:
    """What early destination ``b`` costs (block ids of every KV cache group, plus ORPHAN_ENTRY_COST)."""
    return ORPHAN_ENTRY_COST + len(b.blocks) + sum(len(g) for g in b.groups)


@dataclass
class _Source:
    step: SourceStep
    done: int = 0  # prompt tokens computed in every layer
    running: tuple[int, int] | None = None  # the step being computed
    step_layers: set[int] = field(default_factory=set)  # layers of that step computed so far
    seen_layer: bool = False
    dsts: dict[str, _Dst] = field(default_factory=dict)  # decode request -> destination

    @property
    def complete(self) -> bool:
        return self.running is None and self.done >= self.step.prompt_len


class PushPlanner:
    """The worker's pushes (see the module docstring). ``group_of``: layer -> KV cache group; ``block_size``: this
    worker's; ``unlike(engine)``: decode ``engine``'s geometry when it differs from ours (None: like-for-like).
    Not thread-safe: one thread (the pusher) calls it."""

    def __init__(self, group_of: list[int], block_size: int,
                 unlike: Callable[[str], dict[str, Any] | None]) -> None:
        self.group_of = list(group_of)
        self.num_layers = len(group_of)
        self.block_size = block_size
        self.hybrid = len(set(group_of)) > 1
        self.unlike = unlike
        self.sources: dict[str, _Source] = {}  # xfer -> source
        self.by_req: dict[str, str] = {}  # prefill request -> xfer
        self.active: list[_Source] = []  # sources of the step being computed
        # xfer -> (decode engine, seq) -> (since, early destination)
        self.pending: OrderedDict[str, dict[tuple[str, str], tuple[float, Bind]]] = OrderedDict()
        self._orphans: dict[str, _Orphans] = {}  # decode engine -> its early destinations
        self.orphan_total = 0  # what every engine's early destinations cost together
        self.counts: dict[str, int] = {BEFORE: 0, DURING: 0, AFTER: 0, "refused": 0, "duplicate": 0, "evicted": 0,
                                       "cancelled": 0}
        # (xfer, seq) cancelled here (the decode gave the request up, or its early destination was refused): a copy
        # of its destination that comes later (the decode's direct channel races the scheduler's plan) never binds
        self.cancelled: OrderedDict[tuple[str, str], None] = OrderedDict()

    # ------------------------------------------------------------------ events (pusher thread, in order)
    def step(self, steps: Iterable[SourceStep], now: float = 0.0) -> list[Op]:
        """A step starts computing these sources (the plan, before the forward). Destinations that came early
        bind now."""
        ops: list[Op] = []
        self.active = []
        for st in steps:
            src = self.sources.get(st.xfer)
            if src is None:
                src = self.sources[st.xfer] = _Source(st)
                self.by_req[st.req_id] = st.xfer
            src.step = st
            for d in src.dsts.values():  # the pushes of a range are shared by the layers of one step only (a
                d.pushes.clear()  # resumed request's blocks are new)
            src.done = min(st.start, st.prompt_len)  # the scheduler's count: a prefix-cache hit is computed
            src.running = (src.done, min(st.stop, st.prompt_len))
            src.step_layers = set()
            self.active.append(src)
            for b in self._unhold_xfer(st.xfer):
                ops += self.bind(b, now)[0]
        return ops

    def layer(self, idx: int) -> list[Op]:
        """The forward reached layer ``idx`` (its KV for this step's tokens is enqueued): put it."""
        ops: list[Op] = []
        for src in self.active:
            if src.running is None:
                continue
            src.step_layers.add(idx)
            src.seen_layer = True
            if not src.step.layerwise:
                continue
            for d in src.dsts.values():
                if not (d.final_sent or d.cancelled):
                    ops += self._catch_up(src, d, (idx,), single=True)
        return ops

    def step_end(self) -> list[Op]:
        """The step's forward is done (every layer enqueued): what waited for it goes (sources that put only
        once complete, layers the forward did not visit), and complete sources are signalled."""
        ops: list[Op] = []
        for src in self.active:
            if src.running is not None:
                src.done = src.running[1]
                src.running = None
                src.step_layers = set()
            for d in src.dsts.values():
                if not (d.final_sent or d.cancelled) and (src.step.layerwise or src.complete):
                    ops += self._catch_up(src, d, range(self.num_layers))
        self.active = []
        return ops

    def bind(self, b: Bind, now: float = 0.0) -> tuple[list[Op], str]:
        """A destination arrived (from the scheduler's plan or straight from the decode). Returns the puts and
        signal it makes due now, and what happened: ``before`` / ``during`` / ``after`` (its source's forward),
        ``duplicate`` (bound already), ``pending`` (its source is not known here yet), ``cancelled`` (it was, here:
        nothing is ever put into blocks its decode gave up) or ``refused: why``."""
        if (b.xfer, b.seq) in self.cancelled:
            self.counts["cancelled"] += 1
            return [], "cancelled"
        src = self.sources.get(b.xfer)
        if src is None:
            return [], self._hold(b, now)
        old = src.dsts.get(b.seq)
        if old is not None:
            if old.bind.engine != b.engine:
                self.counts["refused"] += 1
                return [], f"refused: request {b.seq} of transfer {b.xfer} belongs to decode engine {old.bind.engine}"
            self.counts["duplicate"] += 1
            return [], "duplicate"
        if sum(1 for d in src.dsts.values() if d.bind.engine == b.engine) >= MAX_DSTS_PER_ENGINE:
            self.counts["refused"] += 1
            return [], f"refused: decode engine {b.engine} has {MAX_DSTS_PER_ENGINE} destinations for this transfer"
        groups = len(src.step.groups)
        if len(b.groups) != groups - 1:
            self.counts["refused"] += 1
            return [], (f"refused: KV cache groups differ: decode {len(b.groups) + 1}, prefill {groups} (run both "
                        "with the same model and HMA setting)")
        geo = self.unlike(b.engine)
        first = b.offset * (int(geo["block_size"]) if geo is not None else self.block_size)
        phase = AFTER if src.complete else DURING if src.seen_layer else BEFORE
        d = _Dst(b, geo, [first] * self.num_layers, phase)
        src.dsts[b.seq] = d
        self.counts[phase] += 1
        ops: list[Op] = []
        if src.step.layerwise or src.complete:
            ops = self._catch_up(src, d, range(self.num_layers))
        return ops, phase

    def cancel(self, xfer: str, seq: str) -> None:
        """No more puts to ``seq`` (the decode cancelled it, or another engine owns it), now or from a copy of its
        destination that comes later (remembered: the last MAX_CANCELLED)."""
        self.cancelled[(xfer, seq)] = None
        self.cancelled.move_to_end((xfer, seq))
        while len(self.cancelled) > MAX_CANCELLED:
            self.cancelled.popitem(last=False)
        src = self.sources.get(xfer)
        if src is not None and seq in src.dsts:
            src.dsts[seq].cancelled = True
        for engine, s in [k for k in self.pending.get(xfer, {}) if k[1] == seq]:
            self._unhold(engine, xfer, s)

    def forget(self, req_id: str) -> None:
        """The prefill request was released or failed: forget it (no more puts from its blocks)."""
        xfer = self.by_req.pop(req_id, None)
        if xfer is not None:
            src = self.sources.pop(xfer, None)
            if src is not None and src in self.active:
                self.active.remove(src)
            self._unhold_xfer(xfer)

    def expire(self, before: float) -> list[Bind]:
        """Drop destinations that waited since before ``before`` for a prefill request that never came here (oldest
        first per engine: O(expired + engines))."""
        out: list[tuple[float, Bind]] = []
        for engine, o in list(self._orphans.items()):
            while o.held:
                (xfer, seq), (since, _) = next(iter(o.held.items()))
                if since >= before:
                    break
                out.append((since, self.pending[xfer][(engine, seq)][1]))
                self._unhold(engine, xfer, seq)
        return [b for _, b in sorted(out, key=lambda x: x[0])]

    def orphan_usage(self, engine: str) -> int:
        """What decode ``engine``'s early destinations cost now (block ids plus ORPHAN_ENTRY_COST each)."""
        o = self._orphans.get(engine)
        return o.cost if o is not None else 0

    # ------------------------------------------------------------------ early destinations (orphans)
    def _hold(self, b: Bind, now: float) -> str:
        """Hold early destination ``b`` within the budgets (module docstring): ``pending``, ``duplicate`` or
        ``refused: why``. O(1), plus O(engines) per engine that gives up destinations for it."""
        key = (b.engine, b.seq)
        if key in self.pending.get(b.xfer, {}):
            return "duplicate"
        o = self._orphans.get(b.engine) or _Orphans()
        cost = orphan_cost(b)
        if len(o.held) >= MAX_PENDING:
            return "refused: too many destinations wait for their prefill request"
        if o.per_xfer.get(b.xfer, 0) >= MAX_PENDING_PER_XFER:
            return "refused: too many destinations for one transfer"
        if o.cost + cost > MAX_ORPHAN_BLOCKS_PER_ENGINE:
            return (f"refused: decode engine {b.engine} holds too many block ids in destinations whose prefill request "
                    "has not arrived (MAX_ORPHAN_BLOCKS_PER_ENGINE)")
        if not self._make_room(b.engine, o.cost + cost, cost):
            return (f"refused: destinations whose prefill request has not arrived fill MAX_ORPHAN_BLOCKS, and decode "
                    f"engine {b.engine} holds its share")
        self._orphans[b.engine] = o
        self.pending.setdefault(b.xfer, {})[key] = (now, b)
        o.held[(b.xfer, b.seq)] = (now, cost)
        o.cost += cost
        o.per_xfer[b.xfer] = o.per_xfer.get(b.xfer, 0) + 1
        self.orphan_total += cost
        return "pending"

    def _make_room(self, engine: str, after: int, cost: int) -> bool:
        """Make room for ``cost`` more in all (MAX_ORPHAN_BLOCKS) for ``engine``, which will then hold ``after``:
        the engine holding the most gives up its oldest destinations while it holds more than ``after``. False
        when that is not enough (nothing dropped then beyond what was over the newcomer's share)."""
        while self.orphan_total + cost > MAX_ORPHAN_BLOCKS:
            top = max((e for e in self._orphans if e != engine), key=lambda e: self._orphans[e].cost, default=None)
            if top is None or self._orphans[top].cost <= after:
                return False
            o = self._orphans[top]
            while o.held and o.cost > after and self.orphan_total + cost > MAX_ORPHAN_BLOCKS:
                xfer, seq = next(iter(o.held))
                self._unhold(top, xfer, seq)
                self.counts["evicted"] += 1
        return True

    def _unhold(self, engine: str, xfer: str, seq: str) -> None:
        """Forget early destination ``seq`` of ``xfer`` from ``engine`` (and what it cost)."""
        held = self.pending.get(xfer)
        if held is not None:
            held.pop((engine, seq), None)
            if not held:
                del self.pending[xfer]
        o = self._orphans.get(engine)
        entry = o.held.pop((xfer, seq), None) if o is not None else None
        if o is None or entry is None:
            return
        o.cost -= entry[1]
        self.orphan_total -= entry[1]
        left = o.per_xfer.pop(xfer) - 1
        if left:
            o.per_xfer[xfer] = left
        if not o.held:
            del self._orphans[engine]

    def _unhold_xfer(self, xfer: str) -> list[Bind]:
        """Take every early destination of ``xfer`` out of the budgets, in arrival order."""
        held = self.pending.get(xfer, {})
        out = [b for _, b in held.values()]
        for engine, seq in list(held):
            self._unhold(engine, xfer, seq)
        return out

    # ------------------------------------------------------------------ planning
    def _available(self, src: _Source, layer: int) -> int:
        """Prompt tokens whose KV of ``layer`` is enqueued."""
        if src.running is not None and layer in src.step_layers:
            return src.running[1]
        return src.done

    def _target(self, src: _Source, d: _Dst, layer: int) -> int:
        """How far ``layer`` of ``d`` may be put now: whole blocks (like-for-like), or exact tokens (unlike), and
        never beyond what the destination holds or the source has blocks for."""
        avail = self._available(src, layer)
        plen = src.step.prompt_len
        bs = self.block_size
        b = d.bind
        if d.geo is None:
            cap = min(plen, (b.offset + len(b.blocks)) * bs, len(src.step.groups[0]) * bs)
            reach = plen if avail >= plen else avail // bs * bs
        else:
            dbs = int(d.geo["block_size"])
            cap = min(plen, (b.offset + len(b.blocks)) * dbs, len(src.step.groups[0]) * bs)
            reach = avail
        return max(min(reach, cap), d.pushed[layer])

    def _end(self, src: _Source, d: _Dst) -> int:
        """What ``d`` receives in all: the prompt, cut to what the destination (and the source) hold."""
        b = d.bind
        bs = int(d.geo["block_size"]) if d.geo is not None else self.block_size
        return max(min(src.step.prompt_len, (b.offset + len(b.blocks)) * bs, len(src.step.groups[0]) * self.block_size),
                   b.offset * bs)

    def _catch_up(self, src: _Source, d: _Dst, layers: Iterable[int], single: bool = False) -> list[Op]:
        """Put ``layers`` of ``d`` up to their targets (layers with the same group and range in one put); then
        the signal, once every layer reached the end and the source is complete (or its last layer was put)."""
        by_range: dict[tuple[int, int, int], list[int]] = {}
        for layer in layers:
            lo, hi = d.pushed[layer], self._target(src, d, layer)
            if hi > lo:
                by_range.setdefault((self.group_of[layer], lo, hi), []).append(layer)
        ops: list[Op] = []
        end = self._end(src, d)
        for (group, lo, hi), ls in by_range.items():
            key = (group, lo, hi)
            if key not in d.pushes:  # one object for every layer of a range: its runs are computed (and the
                d.pushes[key] = self._push(src, d, group, lo, hi)  # device copy's table uploaded) once
            push = d.pushes[key]
            if push is not None:
                ops.append(PutOp(push, tuple(ls), signal_layers=single and hi >= end))
            for layer in ls:
                d.pushed[layer] = hi
        if not d.final_sent and all(p >= end for p in d.pushed) and (
                src.complete or (src.running is not None and src.running[1] >= src.step.prompt_len)):
            d.final_sent = True
            kind = "whole" if d.phase == AFTER else "layerwise"
            ops.append(SignalOp(self._signal_push(src, d), kind))
        return ops

    def _push(self, src: _Source, d: _Dst, group: int, lo: int, hi: int) -> Push | None:
        """Prompt tokens ``[lo, hi)`` of KV cache group ``group`` into ``d`` (None: nothing to move there)."""
        st, b = src.step, d.bind
        sg = st.groups[group]
        dg = b.blocks if group == 0 else b.groups[group - 1]
        bs = self.block_size
        if d.geo is None:  # whole blocks [lo/bs, ceil(hi/bs)); destination block i - offset
            s_lo, s_hi = lo // bs, -(-hi // bs)
            pairs = list(zip(sg[s_lo:s_hi], dg[s_lo - b.offset:s_hi - b.offset], strict=False))
            if self.hybrid:
                pairs = [(x, y) for x, y in pairs if x != NULL_BLOCK and y != NULL_BLOCK]
            if not pairs:
                return None
            return Push(st.req_id, b.seq, b.engine, tuple(x for x, _ in pairs), tuple(y for _, y in pairs),
                        group=group)
        dbs = int(d.geo["block_size"])
        first = b.offset * dbs
        s_lo, s_hi = lo // bs, -(-hi // bs)
        d_lo, d_hi = (lo - first) // dbs, -(-(hi - first) // dbs)
        return Push(st.req_id, b.seq, b.engine, tuple(sg[s_lo:s_hi]), tuple(dg[d_lo:d_hi]), start=lo, stop=hi,
                    src_first=s_lo * bs, dst_first=first + d_lo * dbs, group=group)

    def _signal_push(self, src: _Source, d: _Dst) -> Push:
        """The push that names ``d``'s sequence for its signal (unlike peers: a token range the worker expands into
        one part per destination rank)."""
        b = d.bind
        if d.geo is None:
            return Push(src.step.req_id, b.seq, b.engine, (), (), src.step.delay)
        lo = b.offset * int(d.geo["block_size"])
        return Push(src.step.req_id, b.seq, b.engine, (), (), src.step.delay, start=lo, stop=lo)
