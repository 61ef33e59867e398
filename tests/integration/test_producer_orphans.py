"""Issue 29, "Orphans without a byte budget": destinations a decode sends before their prefill request exists
(orphans) wait on the prefill's scheduler side (producer.py). They were appended without a cap (+330 MiB held for
80 MiB sent), and four made-up engine ids filled MAX_ORPHANS (a count of 4,096), after which a real decode's early
destination was refused. Now they are held within the worker planner's budgets (pushplan: MAX_PENDING per engine,
MAX_ORPHAN_BLOCKS_PER_ENGINE block ids plus ORPHAN_ENTRY_COST per entry, 4x that in all, shared max-min fairly), and
one refused or given up is refused back to its decode ("fail") and dropped by the workers (a plan cancel).

Each test here failed on the committed producer.py (they use only what both versions have: ``orphans``, the fail
messages sent, the plans)."""

from __future__ import annotations

import gc
import time
import tracemalloc
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import protocol as proto
from kvtransport_vllm import pushplan
from kvtransport_vllm.metadata import StepPlan
from kvtransport_vllm.scheduler import SchedulerSide
from vllm.v1.request import RequestStatus

from .vllm_helpers import (
    empty_output,
    make_config,
    make_request,
    make_scheduler,
    plan_of,
    recorded_prefill_side,
    wait_until,
)

PER_ENGINE = pushplan.MAX_ORPHAN_BLOCKS_PER_ENGINE
ENTRY = pushplan.ORPHAN_ENTRY_COST
BIG = 65536  # block ids of one destination in the attack (a 1M-token prompt at 16-token blocks)
BYTES_PER_ID = 36  # a held block id: a distinct Python int (28 bytes) and its list slot (8)


@pytest.fixture
def side():
    """A prefill's scheduler side; what it sends to decodes is recorded in ``side.sent`` (no decode connects)."""
    s = recorded_prefill_side()
    yield s
    s.shutdown()


def dst(xfer: str, seq: str, blocks: list[int]) -> dict[str, Any]:
    """A dst message as the side channel's reader hands it on (packed on the wire, checked)."""
    msg = {"type": "dst", "xfer": xfer, "mode": "push", "dsts": [{"seq": seq, "blocks": blocks, "offset": 0}]}
    return proto.check_message(proto.parse_message(proto.encode_message(msg)[4:]))


def fails(s: SchedulerSide, engine: str | None = None) -> list[str]:
    return [seq for e, m in s.sent if m["type"] == "fail" and engine in (None, e) for seq in m["seqs"]]  # type: ignore[attr-defined]


def held(s: SchedulerSide) -> dict[str, int]:
    """Decode engine -> what its orphans cost (block ids plus ORPHAN_ENTRY_COST per destination)."""
    out: dict[str, int] = {}
    for _, dsts, _ in s.prefill.orphans.values():
        for d in dsts:
            out[d.engine] = out.get(d.engine, 0) + ENTRY + len(d.blocks) + sum(len(g) for g in d.extra)
    return out


def plan_cancels(s: SchedulerSide) -> list[tuple[str, str]]:
    """The cancels the next plan hands the workers (no request scheduled)."""
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                         scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]))
    plan = StepPlan()
    s.prefill.plan_step(so, plan, time.monotonic())  # type: ignore[union-attr]
    return plan.cancels


# ------------------------------------------------------------------ (a) one engine: capped in block ids, memory bounded
def test_one_engines_100_big_destinations_are_capped_at_its_block_budget(side) -> None:
    """The issue's attack as the side channel delivers it (packed, distinct ids): one engine sends 100
    destinations of 65,536 block ids each for one transfer whose prefill request never came. 7 are held
    (7 x (65,536 + 16) = 458,864 <= 524,288; an 8th would be 524,416), the other 93 are refused back to it; the
    scheduler holds ~16 MiB, at most twice the budget's ~18 MiB (it held all 100: ~236 MiB)."""
    assert PER_ENGINE == 1 << 19 and ENTRY == 16
    blocks = list(range(1_000_000, 1_000_000 + BIG))
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        now = time.monotonic()
        for i in range(100):
            raw = proto.encode_message({"type": "dst", "xfer": "x", "mode": "push",
                                        "dsts": [{"seq": f"s{i}", "offset": 0, "blocks": blocks}]})[4:]
            side.prefill._on_message("FLOOD", proto.check_message(proto.parse_message(raw)), now)
            del raw
        gc.collect()
        cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (got,) = side.prefill.orphans.values()
    assert [d.seq for d in got[1]] == [f"s{i}" for i in range(7)]
    assert sum(len(d.blocks) for d in got[1]) == 7 * BIG == 458_752
    assert held(side) == {"FLOOD": 7 * (BIG + ENTRY)} and 7 * (BIG + ENTRY) <= PER_ENGINE < 8 * (BIG + ENTRY)
    assert fails(side, "FLOOD") == [f"s{i}" for i in range(7, 100)]
    budget_bytes = PER_ENGINE * BYTES_PER_ID
    assert cur - base <= 2 * budget_bytes, f"held {(cur - base) / 2**20:.1f} MiB"
    assert peak - base <= 2 * budget_bytes, f"peak {(peak - base) / 2**20:.1f} MiB"
    # what is left of its budget (524,288 - 458,864 = 65,424) takes one destination of 65,408 blocks exactly
    side.prefill._on_message("FLOOD", dst("y", "fits", list(range(65_408))), now)
    side.prefill._on_message("FLOOD", dst("y", "over", [1]), now)
    assert held(side) == {"FLOOD": PER_ENGINE}
    assert fails(side, "FLOOD")[-1] == "over" and "fits" not in fails(side)
    # the workers drop their early copies of what was refused (the decode sent them there too)
    assert sorted(plan_cancels(side)) == sorted([("x", f"s{i}") for i in range(7, 100)] + [("y", "over")])


def test_one_engine_is_capped_per_transfer_and_in_entries(side) -> None:
    """Small destinations: per engine at most MAX_PENDING (4,096) entries, per engine and transfer at most
    MAX_FANOUT (256, what a transfer can serve); cancel counts for transfers nobody registered cost an entry too
    (they were unbounded)."""
    now = time.monotonic()
    for j in range(300):
        side.prefill._on_message("A", dst("one", f"s{j}", [7]), now)
    assert len(side.prefill.orphans["one"][1]) == 256 and fails(side, "A") == [f"s{j}" for j in range(256, 300)]
    # another engine's destinations for the same transfer are its own (not crowded out by A's)
    side.prefill._on_message("B", dst("one", "b0", [8]), now)
    assert [d.seq for d in side.prefill.orphans["one"][1] if d.engine == "B"] == ["b0"] and not fails(side, "B")
    for i in range(4096):
        side.prefill._on_message("A", dst(f"t{i}", "s", [7]), now)
    assert sum(len(dsts) for _, dsts, _ in side.prefill.orphans.values()) == 4096 + 1  # A's 4,096, B's one
    for i in range(5000):  # count-cancels for transfers nobody registered: A holds no more entries than before
        side.prefill._on_message("A", {"type": "cancel", "xfer": f"c{i}", "mode": "push", "seqs": [], "count": 1}, now)
    assert not any(x.startswith("c") for x in side.prefill.orphans)
    side.prefill._on_message("C", {"type": "cancel", "xfer": "c0", "mode": "push", "seqs": [], "count": 1}, now)
    assert side.prefill.orphans["c0"][2] == 1  # another engine's cancel still counts


# ------------------------------------------------------------------ (c) no lock-out by count; fair give-way
def test_the_old_count_refusal_no_longer_locks_a_newcomer_out(side) -> None:
    """Four made-up engine ids with 1,024 small orphans each filled MAX_ORPHANS (4,096): every later early
    destination was refused. Now a newcomer is held, and when eight engines fill the block budget in all
    (MAX_ORPHAN_BLOCKS), the engine holding the most gives up its oldest for it; an engine holding less than a
    flooder loses nothing to it."""
    now = time.monotonic()
    for i in range(4):
        for j in range(1024):
            side.prefill._on_message(f"FAKE{i}", dst(f"a{i}-{j}", "s", [1]), now)
    assert not fails(side)
    side.prefill._on_message("NEW", dst("new-x", "n1", [5, 6]), now)
    assert [(d.engine, d.seq) for d in side.prefill.orphans["new-x"][1]] == [("NEW", "n1")] and not fails(side, "NEW")
    side.prefill._on_message("SMALL", dst("small-x", "m1", list(range(100))), now)
    big = list(range(1, BIG + 1))  # shared: the budgets count ids, the test need not hold 4M ints
    for i in range(8):
        for j in range(8):
            side.prefill._on_message(f"BIG{i}", dst(f"b{i}-{j}", "s", big), now)
    usage = held(side)
    assert sum(usage.values()) <= pushplan.MAX_ORPHAN_BLOCKS == 4 * PER_ENGINE
    assert max(usage.values()) <= PER_ENGINE
    assert usage["NEW"] == ENTRY + 2 and usage["SMALL"] == ENTRY + 100  # never given up for a bigger flooder
    assert all(usage[f"FAKE{i}"] == 1024 * (ENTRY + 1) for i in range(4))
    bigs = {f"BIG{i}": usage.get(f"BIG{i}", 0) for i in range(8)}
    assert max(bigs.values()) - min(bigs.values()) <= 2 * (BIG + ENTRY)  # they balance among themselves
    # a later newcomer with a destination bigger than what is left in all still gets in: an engine holding the
    # most (4 of them) gives up its oldest, refused back to it; nobody holding less than the newcomer loses any
    assert pushplan.MAX_ORPHAN_BLOCKS - sum(usage.values()) < BIG + ENTRY
    before = len(side.sent)  # type: ignore[attr-defined]
    side.prefill._on_message("LATE", dst("late-x", "l1", big), now)
    assert [d.seq for d in side.prefill.orphans["late-x"][1]] == ["l1"] and "l1" not in fails(side)
    given_up = [(e, m["seqs"]) for e, m in side.sent[before:] if m["type"] == "fail"]  # type: ignore[attr-defined]
    assert given_up and all(e in bigs and usage[e] > BIG + ENTRY for e, _ in given_up), given_up
    after = held(side)
    assert all(after[e] == usage[e] for e in usage if usage[e] <= BIG + ENTRY)
    assert sum(after.values()) <= pushplan.MAX_ORPHAN_BLOCKS


def test_a_refused_engine_cannot_cancel_another_engines_destination_at_the_workers(side) -> None:
    """Refusals become worker cancels naming (transfer, decode request) only: one for a destination that another
    engine holds here is left out of the plan."""
    now = time.monotonic()
    big = list(range(1, BIG + 1))
    for j in range(8):  # its 8th is over its budget
        side.prefill._on_message("X", dst(f"t{j}", "v", big), now)
    assert fails(side, "X") == ["v"]
    side.prefill._on_message("VICTIM", dst("t7", "v", [3]), now)  # the same (transfer, request) now held for VICTIM
    assert ("t7", "v") not in plan_cancels(side)
    assert [d.engine for d in side.prefill.orphans["t7"][1]] == ["VICTIM"]


# ------------------------------------------------------------------ (b) real schedulers: the real decode gets in
@pytest.mark.timeout(120)
def test_flooding_engine_ids_cannot_keep_a_real_decodes_early_destination_out(tiny_model: str) -> None:
    """Two real vLLM schedulers (prefill and decode) over the real side channel. Four made-up engine ids fill the
    old MAX_ORPHANS, eight fill the block budget in all; the real decode's early destination (sent when it
    allocates, before the prefill request exists) is held anyway, more flooders after it do not take it away,
    and it binds when its prefill request arrives."""
    p = make_scheduler(make_config(tiny_model, role="kv_producer"))
    d = make_scheduler(make_config(tiny_model, role="kv_consumer"), num_blocks=1000)
    try:
        pc, dc = p.get_kv_connector()._sched, d.get_kv_connector()._sched
        now = time.monotonic()
        for i in range(4):
            for j in range(1024):
                pc.prefill._on_message(f"FAKE{i}", dst(f"a{i}-{j}", "s", [1]), now)
        big = list(range(1, BIG + 1))
        for i in range(8):
            for j in range(8):
                pc.prefill._on_message(f"BIG{i}", dst(f"b{i}-{j}", "s", big), now)
        # the real decode admits its request first (push flow): its destination reaches the prefill early
        addr = {"remote_host": pc.host, "remote_port": pc.port, "remote_engine_id": pc.engine_id}
        prompt = list(range(10, 50))  # 40 tokens: 3 blocks
        dreq = make_request(prompt, params={"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": "real",
                                            **addr})
        d.add_request(dreq)
        so = d.schedule()
        assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        d.update_from_output(so, empty_output())
        dst_blocks = list(d.kv_cache_manager.get_block_ids(dreq.request_id)[0])

        def arrived() -> bool:  # held, or refused (the decode learns it from its own inbox)
            pc._drain_inbox(time.monotonic())
            dc._drain_inbox(time.monotonic())
            return "real" in pc.prefill.orphans or "real" in pc.prefill.gone or bool(dc.decode._recv_fail)
        wait_until(arrived)
        assert not dc.decode._recv_fail, dc.decode._recv_fail  # the prefill did not refuse it
        assert [(x.engine, x.seq) for x in pc.prefill.orphans["real"][1]] == [(dc.engine_id, dreq.request_id)]
        for i in range(8, 12):  # more flooders: they cannot take it away (it holds less than any of them)
            for j in range(8):
                pc.prefill._on_message(f"BIG{i}", dst(f"b{i}-{j}", "s", big), time.monotonic())
        assert [x.engine for x in pc.prefill.orphans["real"][1]] == [dc.engine_id]
        # the prefill request arrives: the destination binds in its first plan, into the decode's blocks
        preq = make_request(prompt, params={"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": "real",
                                            "kvt_fanout": 1}, max_tokens=1)
        p.add_request(preq)
        so = p.schedule()
        plan = plan_of(so)
        assert [s.xfer for s in plan.sources] == ["real"]
        (b,) = [b for b in plan.binds if b.xfer == "real"]
        assert (b.engine, b.seq, list(b.blocks)) == (dc.engine_id, dreq.request_id, dst_blocks[:3])
        assert ("real", dreq.request_id) not in plan.cancels
        so = d.schedule()  # the decode was not told to give up
        assert dreq.request_id not in plan_of(so).recv_fail and not dc.decode._recv_fail
    finally:
        p.shutdown()
        d.shutdown()


# ------------------------------------------------------------------ the budgets' books, exactly (issue 32)
def _books(s: SchedulerSide) -> dict[str, Any]:
    p = s.prefill  # type: ignore[union-attr]
    return {"total": p.orphan_total, "engines": {x: sorted(e) for x, e in p._orphan_engines.items()},
            "shares": {e: (sh.cost, dict(sh.held), dict(sh.per_xfer), dict(sh.cancels)) for e, sh in p._shares.items()}}


def test_holding_and_releasing_early_destinations_keeps_every_book_exact(side) -> None:
    """Early destinations and cancels of two engines for two transfers, held, then released one by one (a
    cancel, a transfer's arrival): each engine's cost, entries, per-transfer count and cancel count, the total,
    and which engines hold what of a transfer, exactly, down to nothing."""
    from kvtransport_vllm.producer import Destination

    p = side.prefill
    now = time.monotonic()
    a1, a2 = Destination("A", "a1", [1, 2, 3], 0), Destination("A", "a2", [4], 0, [[5]])
    b1 = Destination("B", "b1", [6, 7], 0)
    assert p._hold("A", "x", a1, now) is None and p._hold("A", "x", a2, now) is None
    assert p._hold("B", "x", b1, now) is None and p._hold("A", "x", a1, now) is None  # a repeat: held once
    p._hold_cancels("A", "x", 2, now)
    p._hold_cancels("B", "y", 1, now)
    assert _books(side) == {
        "total": 3 * ENTRY + 3 + 2 + 2 + 2 * ENTRY,
        "engines": {"x": ["A", "B"], "y": ["B"]},
        "shares": {"A": (2 * ENTRY + 3 + 2 + ENTRY, {("x", "a1"): ENTRY + 3, ("x", "a2"): ENTRY + 2,
                                                    ("x", None): ENTRY}, {"x": 2}, {"x": 2}),
                   "B": (ENTRY + 2 + ENTRY, {("x", "b1"): ENTRY + 2, ("y", None): ENTRY}, {"x": 1}, {"y": 1})}}
    assert side.prefill.orphans["x"][1:] == ([a1, a2, b1], 2) and side.prefill.orphans["y"][1:] == ([], 1)
    p._unhold("A", "x", "a2")  # A cancels one of its destinations: x still has A's other one and its cancels
    assert _books(side)["shares"]["A"] == (ENTRY + 3 + ENTRY, {("x", "a1"): ENTRY + 3, ("x", None): ENTRY},
                                           {"x": 1}, {"x": 2})
    assert _books(side)["engines"] == {"x": ["A", "B"], "y": ["B"]} and side.prefill.orphans["x"][1:] == ([a1, b1], 2)
    p._unhold("B", "y", None)  # B's cancel count for y goes: y is empty, B still holds x
    assert "y" not in side.prefill.orphans and _books(side)["engines"] == {"x": ["A", "B"]}
    assert _books(side)["shares"]["B"] == (ENTRY + 2, {("x", "b1"): ENTRY + 2}, {"x": 1}, {})
    assert p._pop_orphan("x")[1:] == ([a1, b1], 2)  # the prefill request arrived: every book of x goes
    assert _books(side) == {"total": 0, "engines": {}, "shares": {}}


def test_releasing_what_is_not_held_changes_nothing(side) -> None:
    from kvtransport_vllm.producer import Destination

    p = side.prefill
    assert p._hold("A", "x", Destination("A", "a1", [1], 0), time.monotonic()) is None
    before = _books(side)
    assert p._release("A", ("x", "nope")) == 0 and p._release("C", ("x", "a1")) == 0
    assert p._release("A", ("z", None)) == 0
    assert _books(side) == before


def test_an_orphan_stays_while_any_destination_or_cancel_is_held_and_goes_with_the_last(side) -> None:
    """``_unhold`` step by step: a cancel count given back while destinations stay, one taken again, the
    destinations going one by one (the transfer stays one engine's once the other's last entry went), the last
    cancel count: the orphan and every book go with it, not before."""
    from kvtransport_vllm.producer import Destination

    p = side.prefill
    now = time.monotonic()
    a1, b1 = Destination("A", "a1", [1], 0), Destination("B", "b1", [2], 0)
    assert p._hold("A", "x", a1, now) is None
    p._hold_cancels("A", "x", 1, now)
    assert p._hold("B", "x", b1, now) is None
    dl = side.prefill.orphans["x"][0]
    assert dl == now + side.settings.lease
    p._unhold("A", "x", None)
    assert side.prefill.orphans["x"] == (dl, [a1, b1], 0)
    p._hold_cancels("A", "x", 1, now)
    p._hold_cancels("A", "x", 1, now)  # a second cancel of the same engine adds to its count, not an entry
    assert _books(side)["shares"]["A"] == (2 * ENTRY + 1, {("x", "a1"): ENTRY + 1, ("x", None): ENTRY}, {"x": 1},
                                           {"x": 2})
    p._unhold("A", "x", "a1")
    assert side.prefill.orphans["x"] == (dl, [b1], 2)
    p._unhold("B", "x", "b1")
    assert side.prefill.orphans["x"] == (dl, [], 2) and _books(side)["engines"] == {"x": ["A"]}
    p._unhold("A", "x", None)
    assert "x" not in side.prefill.orphans and _books(side) == {"total": 0, "engines": {}, "shares": {}}


def test_a_gone_decodes_destinations_become_its_cancels_without_a_budget_check(side) -> None:
    """A decode engine whose side channel ended: each early destination of it turns into one cancel of its
    transfer (one entry, ORPHAN_ENTRY_COST, even with the engine's entries at their cap); another engine's stay."""
    from kvtransport_vllm.producer import Destination

    p = side.prefill
    now = time.monotonic()
    a1, a2, b1 = Destination("A", "a1", [1, 2], 0), Destination("A", "a2", [3], 0), Destination("B", "b1", [4], 0)
    for engine, d in (("A", a1), ("A", a2), ("B", b1)):
        assert p._hold(engine, "x", d, now) is None
    p._engine_gone("A", "side channel closed")
    assert _books(side) == {"total": ENTRY + (ENTRY + 1), "engines": {"x": ["A", "B"]},
                            "shares": {"A": (ENTRY, {("x", None): ENTRY}, {}, {"x": 2}),
                                       "B": (ENTRY + 1, {("x", "b1"): ENTRY + 1}, {"x": 1}, {})}}
    assert side.prefill.orphans["x"][1:] == ([b1], 2)


def test_a_cancel_over_the_budget_is_dropped_and_counted_once(side, monkeypatch) -> None:
    from kvtransport_vllm import producer as producer_mod
    from kvtransport_vllm.producer import Destination

    monkeypatch.setattr(producer_mod, "MAX_ORPHANS_PER_ENGINE", 1)
    p = side.prefill
    assert p._hold("A", "x", Destination("A", "a1", [1], 0), time.monotonic()) is None
    before, refused = _books(side), p.orphans_refused
    p._hold_cancels("A", "z", 1, time.monotonic())
    p._hold_cancels("A", "z2", 1, time.monotonic())
    assert p.orphans_refused == refused + 2 and _books(side) == before and "z" not in side.prefill.orphans


def test_an_orphan_made_by_a_cancel_alone_keeps_its_lease_and_its_last_count(side) -> None:
    """A cancel for a transfer nobody else named makes its orphan, which lives one lease from now; with one
    destination of another engine beside it, the orphan stays on that one count when the destination goes."""
    from kvtransport_vllm.producer import Destination

    p = side.prefill
    now = time.monotonic()
    p._hold_cancels("A", "x", 1, now)
    assert side.prefill.orphans["x"] == (now + side.settings.lease, [], 1)
    assert p._hold("B", "x", Destination("B", "b1", [2], 0), now) is None
    p._unhold("B", "x", "b1")
    assert side.prefill.orphans["x"] == (now + side.settings.lease, [], 1)


def test_room_is_made_only_from_an_engine_that_would_hold_more_than_the_newcomer(side, monkeypatch) -> None:
    """MAX_ORPHAN_BLOCKS full: a newcomer's destination is admitted only at the cost of an engine holding more
    than the newcomer will hold after it. A holds exactly that much (2E+2, B's share after its second
    destination): it keeps everything and B is refused; holding one block more, A gives up its oldest entry,
    one eviction, and B is admitted."""
    from kvtransport_vllm import producer as producer_mod
    from kvtransport_vllm.producer import Destination

    p = side.prefill
    now = time.monotonic()
    a1 = Destination("A", "a1", list(range(ENTRY + 2)), 0)  # costs 2E+2
    b1, b2 = Destination("B", "b1", [1], 0), Destination("B", "b2", [2], 0)  # E+1 each
    monkeypatch.setattr(producer_mod, "MAX_ORPHAN_BLOCKS", (2 * ENTRY + 2) + (ENTRY + 1))
    assert p._hold("A", "x", a1, now) is None and p._hold("B", "y", b1, now) is None
    before = _books(side)
    assert "fill MAX_ORPHAN_BLOCKS" in str(p._hold("B", "z", b2, now))
    assert _books(side) == before and p.orphans_evicted == 0

    a2 = Destination("A", "a2", list(range(ENTRY + 3)), 0)  # 2E+3: more than B's 2E+2
    p._unhold("A", "x", "a1")
    monkeypatch.setattr(producer_mod, "MAX_ORPHAN_BLOCKS", (2 * ENTRY + 3) + (ENTRY + 1))
    assert p._hold("A", "x", a2, now) is None
    assert p._hold("B", "z", b2, now) is None
    assert p.orphans_evicted == 1 and _books(side)["total"] == 2 * (ENTRY + 1)
    assert side.prefill.orphans["z"][1] == [b2] and "x" not in side.prefill.orphans


def test_push_work_is_pending_while_an_orphan_is_held_or_the_inbox_has_events(side) -> None:
    """vLLM keeps stepping an idle prefill while ``has_pending_push_work`` says so: exactly while a destination
    waits for its prefill request (an orphan) or the side channel's inbox holds an event not yet read."""
    assert side.has_pending_push_work() is False
    side.inbox.put(("msg", "D", {}))
    assert side.has_pending_push_work() is True  # an event not yet read
    side.inbox.get_nowait()
    assert side.has_pending_push_work() is False
    side.prefill._on_message("D", dst("x", "s1", [1, 2]), time.monotonic())
    assert list(side.prefill.orphans) == ["x"] and side.inbox.empty()
    assert side.has_pending_push_work() is True  # an orphan, the inbox empty
