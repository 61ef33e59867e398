"""Start now, bind late: the worker's push planner (kvtransport_vllm.pushplan) against random prompts, chunkings,
block sizes, prefix hits and destinations that bind at any point of the forward (before it, between two layers,
between two chunks, after it) or twice (the decode's direct channel and the scheduler's plan).

Every run is checked against the ground truth of what the forward had computed when each put was issued: every
block (like-for-like) or token (unlike) of every layer lands exactly once, only after its layer computed it, the
signal comes once and after every put, and it says "whole" exactly when the destination came after the prompt.
Pure Python (no vLLM, no transport)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

plan_mod = pytest.importorskip("kvtransport_vllm.pushplan", reason="kvtransport-vllm is not installed")
from kvtransport_vllm.metadata import NULL_BLOCK, Bind, SourceStep  # noqa: E402

PushPlanner, PutOp, SignalOp = plan_mod.PushPlanner, plan_mod.PutOp, plan_mod.SignalOp


def chunks(prompt_len: int, start: int, sizes: list[int]) -> list[tuple[int, int]]:
    out, at, i = [], start, 0
    while at < prompt_len:
        n = sizes[i % len(sizes)]
        out.append((at, min(prompt_len, at + n)))
        at += n
        i += 1
    return out


class Run:
    """Drives a planner through one prefill request's steps with destinations bound at given event positions,
    checking every op against what the forward had computed at that moment."""

    def __init__(self, layers: int, bs: int, prompt_len: int, start: int, sizes: list[int], groups: int = 1,
                 unlike: dict[str, dict[str, Any]] | None = None, layerwise: bool = True) -> None:
        self.layers, self.bs, self.prompt_len = layers, bs, prompt_len
        self.group_of = [i % groups for i in range(layers)]
        self.unlike = unlike or {}
        self.planner = PushPlanner(self.group_of, bs, lambda e: self.unlike.get(e))
        nblk = -(-prompt_len // bs)
        # source blocks per group: distinct ids; group 1 (a sliding window) skips its first block (null)
        self.src_groups = [tuple(1000 * (g + 1) + b for b in range(nblk)) for g in range(groups)]
        if groups > 1:
            self.src_groups[1] = (NULL_BLOCK, *self.src_groups[1][1:])
        self.steps = chunks(prompt_len, start, sizes)
        self.start, self.layerwise = start, layerwise
        self.computed = [start] * layers  # tokens whose KV each layer has (ground truth)
        self.writes: dict[tuple[str, int, int], int] = {}  # (seq, layer, dst block or token) -> times written
        self.signals: dict[str, list[str]] = {}
        self.after_signal: list[str] = []
        self.complete = False
        self.bound: dict[str, Bind] = {}

    def events(self) -> list[tuple[Any, ...]]:
        ev: list[tuple[Any, ...]] = []
        for lo, hi in self.steps:
            ev.append(("step", lo, hi))
            ev += [("layer", i, hi) for i in range(self.layers)] if self.layerwise else []
            ev.append(("end", hi))
        return ev

    def apply(self, ops: list[Any]) -> None:
        for op in ops:
            p = op.push
            if isinstance(op, SignalOp):
                assert p.seq not in self.signals, f"{p.seq} signalled twice"
                self.signals[p.seq] = [op.kind]
                # the push that names the sequence: nothing to copy; for an unlike decode, the token where its
                # blocks start (the worker expands it into one part per destination rank)
                b = self.bound[p.seq]
                at = b.offset * self.unlike[b.engine]["block_size"] if b.engine in self.unlike else -1
                assert (p.req_id, p.engine, p.src, p.dst, p.start, p.stop) == ("preq", b.engine, (), (), at,
                                                                               at if at >= 0 else p.stop), p
                continue
            assert isinstance(op, PutOp) and op.layers and p.req_id == "preq" and p.engine == self.bound[p.seq].engine
            assert p.seq not in self.signals, f"a put to {p.seq} after its signal"
            g = p.group
            for layer in op.layers:
                assert self.group_of[layer] == g
                if p.start < 0:  # like-for-like: whole blocks, each complete in this layer (or the prompt's end)
                    for s, d in zip(p.src, p.dst, strict=True):
                        b = self.src_groups[g].index(s)
                        need = min((b + 1) * self.bs, self.prompt_len)
                        assert self.computed[layer] >= need, (layer, b, self.computed[layer], need)
                        key = (p.seq, layer, d)
                        self.writes[key] = self.writes.get(key, 0) + 1
                else:  # unlike: exact tokens, computed in this layer, into the decode's blocks that hold them
                    assert p.stop <= self.computed[layer] and p.start < p.stop
                    b, dbs = self.bound[p.seq], self.unlike[p.engine]["block_size"]
                    dst_blocks = b.blocks if g == 0 else b.groups[g - 1]
                    assert p.dst_first % dbs == 0 and p.src_first % self.bs == 0, p
                    assert p.dst_first <= p.start and p.src_first <= p.start, p
                    assert len(p.dst) == -(-(p.stop - p.dst_first) // dbs), p  # exactly the blocks that hold them
                    assert len(p.src) == -(-(p.stop - p.src_first) // self.bs), p
                    for t in range(p.start, p.stop):
                        assert p.dst[(t - p.dst_first) // dbs] == dst_blocks[t // dbs - b.offset], (p, t)
                        assert p.src[(t - p.src_first) // self.bs] == self.src_groups[g][t // self.bs], (p, t)
                        key = (p.seq, layer, t)
                        self.writes[key] = self.writes.get(key, 0) + 1

    def drive(self, binds: dict[int, list[Bind]]) -> None:
        """Run the events, binding ``binds[i]`` just before event ``i`` (``len(events)``: after the last)."""
        ev = self.events()
        self.bound = {b.seq: b for bs in binds.values() for b in bs}
        for i in range(len(ev) + 1):
            for b in binds.get(i, []):
                ops, _ = self.planner.bind(b)
                self.apply(ops)
            if i == len(ev):
                break
            e = ev[i]
            if e[0] == "step":
                src = SourceStep("preq", "X", self.prompt_len, tuple(self.src_groups), e[1], e[2],
                                 layerwise=self.layerwise)
                self.apply(self.planner.step([src]))
            elif e[0] == "layer":
                self.computed[e[1]] = e[2]
                self.apply(self.planner.layer(e[1]))
            else:
                if not self.layerwise:
                    self.computed = [e[1]] * self.layers
                self.apply(self.planner.step_end())


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 4), bs=st.sampled_from([1, 4, 16]), prompt_len=st.integers(1, 140),
       sizes=st.lists(st.integers(1, 70), min_size=1, max_size=4), groups=st.sampled_from([1, 2, 3]),
       data=st.data())
def test_like_for_like_every_block_of_every_layer_lands_exactly_once(layers: int, bs: int, prompt_len: int,
                                                                    sizes: list[int], groups: int,
                                                                    data: st.DataObject) -> None:
    groups = min(groups, layers)
    nblk = -(-prompt_len // bs)
    start = data.draw(st.integers(0, (prompt_len - 1) // bs), label="prefix blocks") * bs  # prefill cache hit
    run = Run(layers, bs, prompt_len, start, sizes, groups)
    n_events = len(run.events())
    dsts = []
    for k in range(data.draw(st.integers(1, 2), label="destinations")):
        offset = data.draw(st.integers(0, nblk - 1), label="decode prefix blocks")
        blocks = tuple(5000 * (k + 1) + i for i in range(nblk - offset))
        extra = tuple(tuple(30000 + 1000 * k + 200 * j + i for i in range(nblk - offset)) for j in range(groups - 1))
        dsts.append(Bind("X", "D", f"d{k}", blocks, offset, extra))
    binds: dict[int, list[Bind]] = {}
    phase_at = {}
    for d in dsts:
        at = data.draw(st.integers(0, n_events), label="bind at")
        binds.setdefault(at, []).append(d)
        phase_at[d.seq] = at
        again = data.draw(st.one_of(st.none(), st.integers(at, n_events)), label="bound again at")
        if again is not None:  # the plan's copy of a destination that came straight from the decode
            binds.setdefault(again, []).append(d)
    run.drive(binds)
    for d in dsts:
        assert run.signals.get(d.seq) == ["whole" if phase_at[d.seq] == n_events else "layerwise"], d.seq
        for layer in range(layers):
            g = run.group_of[layer]
            dg = d.blocks if g == 0 else d.groups[g - 1]
            for i, blk in enumerate(dg):
                src = run.src_groups[g][d.offset + i]
                want = 0 if src == NULL_BLOCK else 1
                assert run.writes.get((d.seq, layer, blk), 0) == want, (d.seq, layer, i, blk)
    assert sum(run.writes.values()) == sum(
        1 for d in dsts for layer in range(layers) for i in range(nblk - d.offset)
        if run.src_groups[run.group_of[layer]][d.offset + i] != NULL_BLOCK)


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 3), bs=st.sampled_from([2, 8]), dbs=st.sampled_from([3, 8, 16]),
       prompt_len=st.integers(1, 90), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=3), data=st.data())
def test_unlike_every_token_of_every_layer_lands_exactly_once(layers: int, bs: int, dbs: int, prompt_len: int,
                                                             sizes: list[int], data: st.DataObject) -> None:
    groups = min(data.draw(st.integers(1, 2), label="KV groups"), layers)
    run = Run(layers, bs, prompt_len, 0, sizes, groups,
              unlike={"U": {"tp_size": 2, "block_size": dbs, "kv_order": "HN"}})
    dblk = -(-prompt_len // dbs)
    offset = data.draw(st.integers(0, dblk - 1), label="decode prefix blocks")
    b = Bind("X", "U", "u", tuple(100 + i for i in range(dblk - offset)), offset,
             tuple(tuple(700 + i for i in range(dblk - offset)) for _ in range(groups - 1)))
    n_events = len(run.events())
    at = data.draw(st.integers(0, n_events), label="bind at")
    run.drive({at: [b]})
    assert run.signals == {"u": ["whole" if at == n_events else "layerwise"]}
    first = offset * dbs
    for layer in range(layers):
        got = sorted(t for (seq, ly, t), n in run.writes.items() if ly == layer and n == 1)
        assert got == list(range(first, prompt_len)), layer
    assert all(n == 1 for n in run.writes.values())


def test_a_destination_bound_mid_forward_gets_what_is_computed_in_one_put_per_range() -> None:
    """Chunk 2 of 2 is at layer 2 of 4 when the destination comes: one put per distinct range of what is computed
    (both chunks for the two layers done, the first chunk for the other two); then one put per remaining layer as
    the forward reaches it, each signalled; then the sequence's signal."""
    bs = 4
    run = Run(4, bs, 16, 0, [8])  # two chunks: tokens [0, 8), [8, 16)
    ev = run.events()  # step, 4 layers, end, step, 4 layers, end
    at = ev.index(("layer", 2, 16))
    ops_seen: list[Any] = []
    orig = run.apply

    def spy(ops: list[Any]) -> None:
        ops_seen.extend(ops)
        orig(ops)

    run.apply = spy  # type: ignore[method-assign]
    run.drive({at: [Bind("X", "D", "d", tuple(range(50, 54)), 0)]})
    shape = [(type(o).__name__, getattr(o, "layers", None), tuple(o.push.dst), getattr(o, "signal_layers", None))
             for o in ops_seen]
    assert shape == [
        ("PutOp", (0, 1), (50, 51, 52, 53), False),  # both chunks of the layers already computed
        ("PutOp", (2, 3), (50, 51), False),  # the first chunk of the others
        ("PutOp", (2,), (52, 53), True),
        ("PutOp", (3,), (52, 53), True),
        ("SignalOp", None, (), None),
    ]
    assert run.signals == {"d": ["layerwise"]}
    assert run.planner.counts["during"] == 1


def test_early_destinations_wait_bounded_for_their_request_and_expire() -> None:
    p = PushPlanner([0], 4, lambda e: None)
    for i in range(plan_mod.MAX_PENDING):
        assert p.bind(Bind(f"x{i}", "D", "s", (1,), 0), now=1.0)[1] == "pending"
    assert p.bind(Bind("one-too-many", "D", "s", (1,), 0), now=1.0)[1].startswith("refused")
    assert p.bind(Bind("x0", "D", "s", (1,), 0), now=1.0)[1] == "duplicate"
    assert [b.xfer for b in p.expire(before=2.0)][:2] == ["x0", "x1"] and not p.pending
    ops = p.step([SourceStep("r", "x0", 4, ((9,),), 0, 4)])
    assert ops == []  # expired: nothing binds


def test_a_second_engine_claiming_a_bound_request_is_refused() -> None:
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8)])
    assert p.bind(Bind("x", "D", "s", (7, 8), 0))[1] == "before"
    ops, what = p.bind(Bind("x", "IMPOSTOR", "s", (3, 4), 0))
    assert ops == [] and what.startswith("refused") and "belongs to decode engine D" in what
    p.cancel("x", "s")
    assert p.layer(0) == [] and p.layer(1) == [] and p.step_end() == []  # cancelled: nothing more goes


def test_a_cancelled_destination_never_binds_again() -> None:
    """Issue 29's race: the scheduler refused an early destination and its cancel reached the worker before the
    decode's direct copy of it did. The copy is refused ("cancelled") and nothing is ever put into those blocks,
    also when its prefill request comes with a computed prefix; another request of the transfer is served."""
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.cancel("x", "gone")
    assert p.bind(Bind("x", "D", "gone", (7, 8), 0))[1] == "cancelled"
    assert p.bind(Bind("x", "D", "kept", (5, 6), 0))[1] == "pending"
    ops = p.step([SourceStep("r", "x", 8, ((1, 2),), 4, 8)])  # block 1 came from the prefix cache: due at once
    assert [(o.push.seq, o.push.dst) for o in ops] == [("kept", (5,))]
    assert p.bind(Bind("x", "D", "gone", (7, 8), 0))[1] == "cancelled"  # the plan's copy, later: the same
    ops = p.layer(0) + p.layer(1) + p.step_end()
    assert {o.push.seq for o in ops} == {"kept"} and p.counts["cancelled"] == 2


def test_a_cancel_before_its_step_drops_the_early_destination() -> None:
    """The pusher applies a plan's cancels before its step: an early destination held here and cancelled in the
    plan that also starts its request gets nothing, not even the computed prefix the step would put at once."""
    p = PushPlanner([0], 4, lambda e: None)
    assert p.bind(Bind("x", "D", "s", (7, 8), 0))[1] == "pending"
    p.cancel("x", "s")
    assert p.step([SourceStep("r", "x", 8, ((1, 2),), 4, 8)]) == [] and p.layer(0) == [] and p.step_end() == []


def test_the_pusher_applies_a_plans_cancels_first() -> None:
    from kvtransport_vllm.pusher import Pusher

    calls: list[str] = []

    class Recorder:
        def cancel(self, xfer: str, seq: str) -> None:
            calls.append(f"cancel {seq}")

        def step(self, sources: Any, now: float) -> list[Any]:
            calls.append("step")
            return []

        def bind(self, b: Bind, now: float) -> tuple[list[Any], str]:
            calls.append(f"bind {b.seq}")
            return [], "cancelled"

        def forget(self, rid: str) -> None:
            calls.append(f"forget {rid}")

    pusher = Pusher.__new__(Pusher)  # only the plan's dispatch is under test
    pusher.planner = Recorder()  # type: ignore[assignment]
    pusher._run_ops = lambda ops: None  # type: ignore[method-assign]
    pusher._do(("plan", [SourceStep("r", "x", 8, ((1, 2),), 0, 8)], [Bind("x", "D", "b", (3,), 0)],
                [("x", "c")], ["old"]))
    assert calls == ["cancel c", "step", "bind b", "forget old"]


def test_cancelled_pairs_are_remembered_within_a_bound() -> None:
    p = PushPlanner([0], 4, lambda e: None)
    for i in range(plan_mod.MAX_CANCELLED + 5):
        p.cancel("x", f"s{i}")
    assert len(p.cancelled) == plan_mod.MAX_CANCELLED
    assert p.bind(Bind("x", "D", "s4", (1,), 0))[1] == "pending"  # the oldest were forgotten
    assert p.bind(Bind("x", "D", "s5", (1,), 0))[1] == "cancelled"


def test_a_destination_cancelled_in_the_middle_of_a_push_gets_nothing_more_and_no_signal() -> None:
    """Issue 32: the decode gives a request up while its layers are being pushed: the layers already put stay
    put, no later layer goes, and no signal is ever sent (the decode would otherwise count a landing)."""
    p = PushPlanner([0, 0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8)])
    assert p.bind(Bind("x", "D", "s", (7, 8), 0))[1] == "before"
    first = p.layer(0)
    assert [(o.layers, o.push.dst) for o in first] == [((0,), (7, 8))]
    p.cancel("x", "s")
    assert p.layer(1) == [] and p.layer(2) == [] and p.step_end() == []


def test_the_decodes_null_block_is_never_written() -> None:
    """Issue 32: a hybrid decode whose sliding-window group points some blocks at vLLM's null block (0): the
    prefill puts nothing there (the null block is shared by every request), and the rest lands as planned."""
    p = PushPlanner([0, 1], 4, lambda e: None)  # layer 0: full attention, layer 1: the sliding window group
    p.step([SourceStep("r", "x", 12, ((1, 2, 3), (NULL_BLOCK, 5, 6)), 0, 12)])
    ops, phase = p.bind(Bind("x", "D", "s", (21, 22, 23), 0, ((NULL_BLOCK, NULL_BLOCK, 33),)))
    assert phase == "before" and ops == []
    ops = p.layer(0) + p.layer(1) + p.step_end()
    puts = {(o.push.group, o.layers): o.push.dst for o in ops if isinstance(o, PutOp)}
    assert puts == {(0, (0,)): (21, 22, 23), (1, (1,)): (33,)}, puts
    assert all(NULL_BLOCK not in o.push.dst for o in ops if isinstance(o, PutOp))
    assert [o.kind for o in ops if isinstance(o, SignalOp)] == ["layerwise"]


def test_a_decode_with_fewer_kv_groups_than_the_prefill_is_refused() -> None:
    """Issue 32: a decode that sends one group's blocks to a prefill with two (another HMA setting): refused,
    nothing put."""
    p = PushPlanner([0, 1], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2), (3, 4)), 0, 8)])
    ops, what = p.bind(Bind("x", "D", "s", (7, 8), 0))
    assert ops == [] and what.startswith("refused: KV cache groups differ: decode 1, prefill 2"), what
    assert p.layer(0) == [] and p.layer(1) == [] and p.step_end() == []


def test_a_source_given_up_after_its_puts_started_puts_and_signals_nothing_more() -> None:
    """Issue 32: the prefill request fails (or is released) in the middle of its forward, after layer 0 was put:
    its blocks may be reused at once, so nothing more is read from them: no later layer, no signal (its decode
    takes the failure path), and a destination that comes for it now is held, not bound to the dead source."""
    p = PushPlanner([0, 0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8)])
    p.bind(Bind("x", "D", "s", (7, 8), 0))
    assert [o.layers for o in p.layer(0)] == [(0,)]
    p.forget("r")
    assert p.layer(1) == [] and p.layer(2) == [] and p.step_end() == []
    assert p.bind(Bind("x", "D", "t", (9,), 0))[1] == "pending"


def test_pull_mode_puts_only_once_the_prompt_is_computed() -> None:
    run = Run(3, 4, 10, 0, [4], layerwise=False)
    ev = run.events()
    run.drive({1: [Bind("X", "D", "d", (20, 21, 22), 0)]})
    assert run.signals == {"d": ["layerwise"]} and len(ev) == 6
    assert sorted(k[2] for k in run.writes) == [20, 20, 20, 21, 21, 21, 22, 22, 22]


def test_the_layers_of_a_step_share_one_push_object() -> None:
    """Every layer of a range gets the same Push object (the pusher expands it once, and the CUDA IPC launcher,
    which caches a put's device table by the identity of its runs, uploads it once per step, not per layer)."""
    run = Run(4, 4, 32, 0, [16])
    seen: list[Any] = []
    orig = run.apply

    def spy(ops: list[Any]) -> None:
        seen.extend(o for o in ops if isinstance(o, PutOp))
        orig(ops)

    run.apply = spy  # type: ignore[method-assign]
    run.drive({0: [Bind("X", "D", "d", tuple(range(60, 68)), 0)]})
    by_step = [seen[:4], seen[4:]]
    assert [len(s) for s in by_step] == [4, 4]
    for ops in by_step:
        assert all(o.push is ops[0].push for o in ops)
    assert by_step[0][0].push is not by_step[1][0].push


def test_the_pusher_host_cost_benchmark_runs(load_script: Callable[[str], ModuleType]) -> None:
    """benchmarks/pusher_host_cost.py: planning a layer and mapping its push once per step costs less than doing
    the mapping again for every layer (what the pusher did before)."""
    pytest.importorskip("torch")
    mod = load_script("benchmarks/pusher_host_cost.py")
    out = mod.measure(3)
    assert out["per_step_us"] < out["per_layer_us"] and (out["layers"], out["blocks"]) == (32, 128), out


def test_early_destinations_budgets_are_kept_exactly_and_the_largest_holder_gives_way(monkeypatch) -> None:
    """The early-destination budgets (module docstring of pushplan), with small limits: what each engine holds is
    counted exactly through holds, evictions, cancels and binds; a newcomer is made room for by the engine holding
    the most (its oldest first, only down to the newcomer's share); a per-engine or global budget it cannot fit
    refuses it and drops nothing; a cancelled or bound destination frees its share at once."""
    monkeypatch.setattr(plan_mod, "MAX_ORPHAN_BLOCKS", 100)
    monkeypatch.setattr(plan_mod, "MAX_ORPHAN_BLOCKS_PER_ENGINE", 60)
    monkeypatch.setattr(plan_mod, "MAX_PENDING_PER_XFER", 2)
    p = PushPlanner([0], 4, lambda e: None)
    entry = plan_mod.ORPHAN_ENTRY_COST  # 16: a destination of n blocks costs 16 + n

    def hold(xfer: str, engine: str, blocks: int, seq: str = "s") -> str:
        return p.bind(Bind(xfer, engine, seq, tuple(range(1, blocks + 1)), 0), now=1.0)[1]

    assert entry == 16
    assert [hold(x, "A", 4) for x in ("a1", "a2", "a3")] == ["pending"] * 3  # A: 60, its whole share
    assert hold("b1", "B", 4) == "pending"
    assert (p.orphan_usage("A"), p.orphan_usage("B"), p.orphan_total) == (60, 20, 80)
    assert hold("c1", "C", 14) == "pending"  # 30 more than the 100 allow: A, the largest, drops its oldest (a1)
    assert p.counts["evicted"] == 1 and "a1" not in p.pending and {"a2", "a3", "b1", "c1"} <= set(p.pending)
    assert (p.orphan_usage("A"), p.orphan_usage("C"), p.orphan_total) == (40, 30, 90)
    assert hold("b2", "B", 54).startswith("refused: decode engine B holds too many")  # 20 + 70 > 60
    assert hold("d1", "D", 44).startswith("refused: destinations whose prefill request has not arrived fill")
    assert (p.orphan_total, p.counts["evicted"]) == (90, 1)  # a refusal drops nothing
    assert hold("g1", "G", 24).startswith("refused: destinations")  # 40: A holds exactly that much, no more
    assert (p.orphan_total, p.counts["evicted"]) == (90, 1)
    p.cancel("a2", "s")  # the decode gave it up: its share is free at once
    assert (p.orphan_usage("A"), p.orphan_total) == (20, 70) and "a2" not in p.pending
    p.cancel("a3", "s")
    assert p.orphan_usage("A") == 0 and "A" not in p._orphans and p.orphan_total == 50
    assert [hold("x", "E", 1, s) for s in ("e1", "e2", "e3")] == ["pending", "pending",
                                                                   "refused: too many destinations for one transfer"]
    p.cancel("x", "e1")
    assert hold("x", "E", 1, "e4") == "pending"  # one of the two per-transfer places came free
    assert p.orphan_usage("E") == 2 * (entry + 1)
    p.step([SourceStep("r", "b1", 4, ((9,),), 0, 4)])  # b1's request comes: bound, out of the budgets
    assert list(p.sources["b1"].dsts) == ["s"] and "b1" not in p.pending
    assert p.orphan_usage("B") == 0 and "B" not in p._orphans and p.orphan_total == 30 + 2 * (entry + 1)


def test_a_cancel_refreshes_what_is_remembered(monkeypatch) -> None:
    """The cancelled pairs are kept in the order they were last cancelled: cancelling one again keeps it past
    newer ones."""
    monkeypatch.setattr(plan_mod, "MAX_CANCELLED", 3)
    p = PushPlanner([0], 4, lambda e: None)
    for s in ("s0", "s1", "s2"):
        p.cancel("x", s)
    p.cancel("x", "s0")  # again: now the newest
    p.cancel("x", "s3")  # one too many: s1, the oldest, goes
    assert list(p.cancelled) == [("x", "s2"), ("x", "s0"), ("x", "s3")]
    assert p.bind(Bind("x", "D", "s1", (1,), 0))[1] == "pending"
    assert p.bind(Bind("x", "D", "s0", (1,), 0))[1] == "cancelled"


def test_the_largest_holder_gives_up_only_down_to_the_newcomers_share(monkeypatch) -> None:
    """A holds 60, B 40 (the whole 100); C asks for 40: A drops its oldest (down to 40, C's share) and no more;
    then A and B hold no more than C would: C is refused, and the one A dropped stays dropped."""
    monkeypatch.setattr(plan_mod, "MAX_ORPHAN_BLOCKS", 100)
    monkeypatch.setattr(plan_mod, "MAX_ORPHAN_BLOCKS_PER_ENGINE", 60)
    p = PushPlanner([0], 4, lambda e: None)
    for xfer, engine in (("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("b2", "B")):
        assert p.bind(Bind(xfer, engine, "s", (1, 2, 3, 4), 0), now=1.0)[1] == "pending"  # 20 each
    assert p.bind(Bind("c1", "C", "s", tuple(range(1, 25)), 0), now=1.0)[1].startswith("refused: destinations")
    assert (p.orphan_usage("A"), p.orphan_usage("B"), p.orphan_total, p.counts["evicted"]) == (40, 40, 80, 1)
    assert set(p.pending) == {"a2", "a3", "b1", "b2"}
    hybrid = PushPlanner([0, 1], 4, lambda e: None)  # a destination's block ids of every KV cache group count
    assert hybrid.bind(Bind("h", "H", "s", (1, 2), 0, ((3, 4, 5),)), now=1.0)[1] == "pending"
    assert hybrid.orphan_usage("H") == plan_mod.ORPHAN_ENTRY_COST + 2 + 3


def test_room_is_made_to_the_exact_budget_and_every_eviction_counted(monkeypatch) -> None:
    """A holds 80 of the 100; C's 40 fits once A gave up exactly one (the total then is 100, not over it); D's 40
    would need A below D's share: A gives up one more and D is still refused. Two evictions counted."""
    monkeypatch.setattr(plan_mod, "MAX_ORPHAN_BLOCKS", 100)
    monkeypatch.setattr(plan_mod, "MAX_ORPHAN_BLOCKS_PER_ENGINE", 100)
    p = PushPlanner([0], 4, lambda e: None)
    for xfer in ("a1", "a2", "a3", "a4"):
        assert p.bind(Bind(xfer, "A", "s", (1, 2, 3, 4), 0), now=1.0)[1] == "pending"  # 20 each
    blocks = tuple(range(1, 25))  # 16 + 24 = 40
    assert p.bind(Bind("c1", "C", "s", blocks, 0), now=1.0)[1] == "pending"
    assert (p.orphan_usage("A"), p.orphan_total, p.counts["evicted"]) == (60, 100, 1)
    assert p.bind(Bind("d1", "D", "s", blocks, 0), now=1.0)[1].startswith("refused: destinations")
    assert (p.orphan_usage("A"), p.orphan_usage("C"), p.orphan_total, p.counts["evicted"]) == (40, 40, 80, 2)
    assert set(p.pending) == {"a3", "a4", "c1"}


def test_a_whole_push_source_beside_a_layerwise_one_holds_back_only_itself() -> None:
    """One step computes a source that is put only once complete (pull mode) before a layer-wise one: each layer
    still puts the layer-wise source's KV at once; the other's goes at the step's end, whole."""
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.step([SourceStep("rw", "w", 8, ((1, 2),), 0, 8, layerwise=False), SourceStep("rl", "l", 8, ((3, 4),), 0, 8)])
    assert p.bind(Bind("w", "D", "sw", (11, 12)))[0] == [] and p.bind(Bind("l", "D", "sl", (13, 14)))[0] == []
    assert [(o.push.seq, o.push.dst, o.layers) for o in p.layer(0) if isinstance(o, PutOp)] == [("sl", (13, 14), (0,))]
    assert [(o.push.seq, o.layers) for o in p.layer(1) if isinstance(o, PutOp)] == [("sl", (1,))]
    assert [(o.push.seq, o.push.dst, o.layers) for o in p.step_end() if isinstance(o, PutOp)] == [
        ("sw", (11, 12), (0, 1))]


def test_refusals_and_duplicates_are_counted_exactly() -> None:
    """The planner's counts (the worker's metrics): one duplicate, one destination claimed by another engine,
    one with the wrong number of KV cache groups, one past MAX_DSTS_PER_ENGINE."""
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8)])
    assert p.bind(Bind("x", "D", "s", (7, 8)))[1] == "before"
    assert p.bind(Bind("x", "D", "s", (7, 8)))[1] == "duplicate"
    assert p.bind(Bind("x", "D", "t", (5, 6), 0, ((9,),)))[1].startswith("refused: KV cache groups differ")
    assert p.bind(Bind("x", "E", "s", (5, 6)))[1].startswith("refused")  # (after another: counted on, not reset)
    for i in range(plan_mod.MAX_DSTS_PER_ENGINE):
        p.bind(Bind("x", "F", f"f{i}", (20 + i,)))
    assert p.bind(Bind("x", "F", "one-more", (99,)))[1].startswith("refused: decode engine F")
    assert (p.counts["refused"], p.counts["duplicate"], p.counts["before"]) == (3, 1, 1 + plan_mod.MAX_DSTS_PER_ENGINE)


@pytest.mark.parametrize("dbs", [4, 8])
def test_a_destination_shorter_than_the_prompt_gets_only_what_fits(dbs: int) -> None:
    """A decode (like-for-like, dbs 4, or unlike, dbs 8) names fewer blocks than the prompt needs past its
    offset: nothing is put beyond them, in blocks or in tokens, and once they are full it is signalled (its
    request ends there; it does not wait out its timeout for KV it has no room for)."""
    geo = None if dbs == 4 else {"tp_size": 2, "block_size": dbs, "kv_order": "HN"}
    p = PushPlanner([0], 4, lambda e: geo)
    p.step([SourceStep("r", "x", 24, ((1, 2, 3, 4, 5, 6),), 0, 24)])
    p.bind(Bind("x", "D", "s", (70,), 1))  # block 1 of the decode: tokens [dbs, 2 dbs) of 24
    ops = p.layer(0) + p.step_end()
    assert [o.push.seq for o in ops if isinstance(o, SignalOp)] == ["s"]
    puts = [o.push for o in ops if isinstance(o, PutOp)]
    if geo is None:
        assert [(q.src, q.dst) for q in puts] == [((2,), (70,))]
    else:
        assert [(q.start, q.stop, q.dst) for q in puts] == [(8, 16, (70,))]


def test_expire_drops_only_destinations_older_than_the_cutoff_oldest_first_over_engines() -> None:
    """A destination that arrived exactly at the cutoff stays; the rest of its engine's are newer and stay too;
    another engine's older ones still go."""
    p = PushPlanner([0], 4, lambda e: None)
    for xfer, engine, now in (("a0", "A", 1.0), ("a1", "A", 2.0), ("a2", "A", 3.0), ("b0", "B", 1.5)):
        assert p.bind(Bind(xfer, engine, "s", (1,), 0), now=now)[1] == "pending"
    assert [(b.xfer, b.engine) for b in p.expire(before=2.0)] == [("a0", "A"), ("b0", "B")]
    assert sorted(p.pending) == ["a1", "a2"]
    assert p.orphan_usage("A") == 2 * plan_mod.orphan_cost(Bind("a1", "A", "s", (1,), 0)) and p.orphan_usage("B") == 0
    assert p.expire(before=2.0) == []


def test_forgetting_a_request_this_planner_never_saw_changes_nothing() -> None:
    p = PushPlanner([0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 4, ((9,),), 0, 4)])
    p.forget("never-seen")
    p.forget("r")
    p.forget("r")  # twice: a release after a failure
    assert p.sources == {} and p.by_req == {}


def test_a_whole_push_source_puts_into_every_destination_at_its_steps_end() -> None:
    """A source that puts once (not layer-wise) with two destinations bound before its forward: both get every
    layer at the step's end, then their signals."""
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8, layerwise=False)])
    assert p.bind(Bind("x", "D", "s", (7, 8), 0))[1] == "before"
    assert p.bind(Bind("x", "E", "t", (5, 6), 0))[1] == "before"
    assert p.layer(0) == [] and p.layer(1) == []
    ops = p.step_end()
    assert [(type(o).__name__, o.push.seq, getattr(o, "layers", None), tuple(o.push.dst)) for o in ops] == [
        ("PutOp", "s", (0, 1), (7, 8)), ("SignalOp", "s", None, ()),
        ("PutOp", "t", (0, 1), (5, 6)), ("SignalOp", "t", None, ())]


def test_the_signal_goes_with_the_last_layer_of_the_step_that_completes_the_prompt() -> None:
    """Not at the step's end: the decode may start as soon as the last layer is put."""
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8)])
    p.bind(Bind("x", "D", "s", (7, 8), 0))
    assert [type(o).__name__ for o in p.layer(0)] == ["PutOp"]
    assert [type(o).__name__ for o in p.layer(1)] == ["PutOp", "SignalOp"]
    assert p.step_end() == []


def test_every_kv_group_refusal_is_counted() -> None:
    p = PushPlanner([0, 0], 4, lambda e: None)
    p.step([SourceStep("r", "x", 8, ((1, 2),), 0, 8)])
    for seq in ("s", "t"):
        assert p.bind(Bind("x", "D", seq, (5, 6), 0, ((9,),)))[1].startswith("refused: KV cache groups differ")
    assert p.counts["refused"] == 2 and p.sources["x"].dsts == {}
