"""The prefill's scheduler side (producer.py) as its decodes' side-channel events drive it: renewals (``_renewed``,
``_send_ready``, ``_tell_first``), a decode's disconnect (``on_event`` "bye", ``_engine_gone``), refusals and cancels
(``send_fail``, ``_fail_dsts``, ``_cancel``, ``_foreign``, ``answer_now``, ``_take_orphan_cancels``) and the room an
early destination makes in the orphans' total budget (``_make_room``, its boundaries exactly, with the budgets
monkeypatched small). Exact messages, counters and books throughout; no decode connects (what the prefill sends
is recorded)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import producer as producer_mod
from kvtransport_vllm.producer import Destination, Source
from kvtransport_vllm.scheduler import SchedulerSide

from .test_producer_orphans import ENTRY, _books, plan_cancels
from .vllm_helpers import recorded_prefill_side

LOGGER = "vllm.kvtransport"
EVICTED = ("refused: destinations whose prefill request has not arrived fill MAX_ORPHAN_BLOCKS; decode engine {} "
           "holds the most and gave up its oldest")
NO_ROOM = ("refused: destinations whose prefill request has not arrived fill MAX_ORPHAN_BLOCKS, and decode engine {} "
           "holds its share")


@pytest.fixture
def side():
    """A prefill's scheduler side whose sends to decodes are recorded in ``side.sent``; a send to an engine in
    ``side.down`` fails (not connected)."""
    s = recorded_prefill_side()
    yield s
    s.shutdown()


def dest(engine: str, seq: str, blocks: int = 1, **kw: Any) -> Destination:
    """A destination of ``blocks`` block ids: as an orphan it costs ENTRY + blocks."""
    return Destination(engine, seq, list(range(blocks)), 0, **kw)


def source(s: SchedulerSide, xfer: str, *, holders: tuple[str, ...] = (), dsts: tuple[Destination, ...] = (),
           **kw: Any) -> Source:
    """A registered prefill request (push mode, one destination expected) for transfer ``xfer``."""
    src = Source(f"req-{xfer}", xfer, "push", 1, 40, holders=set(holders), dsts=list(dsts), **kw)
    s.prefill.sources[xfer] = src  # type: ignore[union-attr]
    s.prefill.src_by_req[src.req_id] = src  # type: ignore[union-attr]
    return src


def sent(s: SchedulerSide, mtype: str) -> list[tuple[str, dict[str, Any]]]:
    return sorted(((e, m) for e, m in s.sent if m["type"] == mtype), key=lambda em: em[0])  # type: ignore[attr-defined]


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


# ------------------------------------------------------------------ renewals: leases, holders, ready, first token
def test_a_renewal_extends_a_registered_transfers_lease_and_records_its_holder(side) -> None:
    """The lease runs one lease from the renewal, never shorter than it was; the renewing engine holds the
    transfer; nothing is held for a registered transfer (holds are for transfers not registered yet)."""
    p = side.prefill
    src = source(side, "x")
    p.on_event(("msg", "A", {"type": "renew", "xfers": ["x"]}), 100.0)
    assert src.lease_until == 100.0 + side.settings.lease == 130.0
    assert src.holders == {"A"} and p.holds == {}
    src.lease_until = 1000.0
    p._renewed("B", ["x"], 100.0)
    assert src.lease_until == 1000.0 and src.holders == {"A", "B"}
    assert side.sent == []  # neither scheduled nor complete, no first token: nothing to tell


@pytest.mark.parametrize(("scheduled", "complete", "ready"), [
    (False, False, False), (True, False, True), (False, True, True), (True, True, True)],
    ids=["waiting", "scheduled", "complete", "scheduled_and_complete"])
def test_a_renewal_tells_ready_once_the_request_runs_or_ran(side, scheduled: bool, complete: bool,
                                                            ready: bool) -> None:
    src = source(side, "x", scheduled=scheduled, complete=complete)
    side.prefill._renewed("A", ["x"], 1.0)
    side.prefill._renewed("A", ["x"], 2.0)  # told once
    assert side.sent == ([("A", {"type": "ready", "xfers": ["x"]})] if ready else [])
    assert src.ready_sent == ({"A"} if ready else set())


def test_a_renewal_tells_the_first_token_once_it_was_sampled(side) -> None:
    src = source(side, "x")
    side.prefill._renewed("A", ["x"], 1.0)
    assert side.sent == [] and side.counters["first_tokens_sent"] == 0
    src.first = 7
    side.prefill._renewed("A", ["x"], 2.0)
    side.prefill._renewed("A", ["x"], 3.0)
    assert side.sent == [("A", {"type": "first", "xfer": "x", "token": 7})]
    assert side.counters["first_tokens_sent"] == 1 and src.first_told == {"A"}


def test_a_renewal_of_an_unregistered_transfer_is_held_for_every_engine_but_not_for_a_gone_one(side) -> None:
    """Renewed before its prefill request arrived: held (expiry, engines), each renewal moving the expiry and
    adding its engine; a transfer this prefill already gave up is not held again."""
    p = side.prefill
    p.gone["old"] = "source released"
    p._renewed("A", ["h", "old"], 10.0)
    assert p.holds == {"h": (40.0, {"A"})}
    p._renewed("B", ["h"], 20.0)
    assert p.holds == {"h": (50.0, {"A", "B"})}


def test_holds_are_bounded_at_4096_forgetting_the_oldest(side) -> None:
    p = side.prefill
    p._renewed("A", [f"h{i}" for i in range(4096)], 1.0)
    assert len(p.holds) == 4096 and "h0" in p.holds
    p._renewed("A", ["h4096"], 1.0)
    assert len(p.holds) == 4096 and "h0" not in p.holds and "h1" in p.holds and "h4096" in p.holds


def test_the_holds_bound_forgets_the_least_recently_renewed_not_the_first_made(side) -> None:
    """A flood of new transfer ids must not push out a hold its decode renewed a moment ago."""
    p = side.prefill
    p._renewed("A", [f"h{i}" for i in range(4096)], 1.0)
    p._renewed("B", ["h0"], 2.0)
    p._renewed("C", ["new"], 2.0)
    assert len(p.holds) == 4096 and "h1" not in p.holds
    assert p.holds["h0"] == (2.0 + p.settings.lease, {"A", "B"}) and "new" in p.holds


def test_ready_goes_once_to_each_holder_and_again_to_one_that_was_not_reached(side) -> None:
    src = source(side, "x", holders=("A", "B"))
    side.down.add("B")
    side.prefill._send_ready(src)
    assert sent(side, "ready") == [("A", {"type": "ready", "xfers": ["x"]}), ("B", {"type": "ready", "xfers": ["x"]})]
    assert src.ready_sent == {"A"}
    side.sent.clear()
    side.down.clear()
    side.prefill._send_ready(src)
    assert side.sent == [("B", {"type": "ready", "xfers": ["x"]})] and src.ready_sent == {"A", "B"}
    side.sent.clear()
    side.prefill._send_ready(src)
    assert side.sent == []


def test_the_first_token_goes_to_holders_and_live_destinations_once_each(side) -> None:
    """Holders and engines of destinations not cancelled are told (not one whose destination was cancelled),
    each once, counted per engine reached; an engine not reached is told at the next chance."""
    src = source(side, "x", holders=("A",), dsts=(dest("B", "b1"), dest("C", "c1", cancelled=True)))
    side.prefill._tell_first(src)  # no token sampled yet
    assert side.sent == [] and side.counters["first_tokens_sent"] == 0
    src.first = 42
    side.down.add("B")
    side.prefill._tell_first(src)
    first = {"type": "first", "xfer": "x", "token": 42}
    assert sent(side, "first") == [("A", first), ("B", first)]
    assert src.first_told == {"A"} and side.counters["first_tokens_sent"] == 1
    side.sent.clear()
    side.down.clear()
    side.prefill._tell_first(src)
    side.prefill._tell_first(src)
    assert side.sent == [("B", first)]
    assert src.first_told == {"A", "B"} and side.counters["first_tokens_sent"] == 2


# ------------------------------------------------------------------ a decode's disconnect
def test_a_disconnected_decodes_requests_are_cancelled_and_only_those_it_alone_waited_for_fail(side, caplog) -> None:
    """Decode A's side channel ends ("bye"). Its destinations are cancelled (the workers told of those they
    have); a prefill request fails (counted once) when nobody holds it any more and no live destination is left;
    one that another engine holds or has a live destination for, one A never held, and one failed already
    are left as they were."""
    p = side.prefill
    lonely = source(side, "lonely")  # registered, nobody renewed it yet: not A's business
    a1, a2 = dest("A", "a1", forwarded=True), dest("A", "a2")
    x = source(side, "x", holders=("A",), dsts=(a1, a2))
    y = source(side, "y", holders=("A", "B"))
    b1 = dest("B", "b1", forwarded=True)
    z = source(side, "z", holders=("A",), dsts=(b1,))
    a3 = dest("A", "a3", forwarded=True)
    w = source(side, "w", dsts=(a3,))  # A sent a destination but does not hold (renew) it
    v = source(side, "v", holders=("A",), failed="prefill request req-v ended with FINISHED_ABORTED")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    p.on_event(("bye", "A", "side channel closed"), 5.0)
    assert {s.xfer: s.failed for s in (lonely, x, y, z, w, v)} == {
        "lonely": None, "x": "decode engine A disconnected (side channel closed)", "y": None, "z": None,
        "w": "decode engine A disconnected (side channel closed)",
        "v": "prefill request req-v ended with FINISHED_ABORTED"}
    assert side.counters["decode_disconnects"] == 2
    assert [(s.xfer, s.holders) for s in (lonely, x, y, z, w, v)] == [
        ("lonely", set()), ("x", set()), ("y", {"B"}), ("z", set()), ("w", set()), ("v", set())]
    assert (a1.cancelled, a2.cancelled, a3.cancelled, b1.cancelled) == (True, True, True, False)
    assert p._cancels == [("x", "a1"), ("w", "a3")]  # forwarded ones only: the workers never had a2
    assert side.sent == []  # nothing is told to a decode that is gone
    assert messages(caplog) == [
        "kvtransport: prefill request req-x (transfer x): decode engine A disconnected (side channel closed); "
        "freeing its blocks",
        "kvtransport: prefill request req-w (transfer w): decode engine A disconnected (side channel closed); "
        "freeing its blocks"]


def test_a_disconnected_decode_leaves_the_holds_it_shared_with_others(side) -> None:
    p = side.prefill
    p.holds.update({"h1": (9.0, {"A"}), "h2": (9.0, {"A", "B"}), "h3": (9.0, {"B"})})
    p.on_event(("bye", "A", "eof"), 1.0)
    assert p.holds == {"h2": (9.0, {"B"}), "h3": (9.0, {"B"})}


def test_a_disconnected_decodes_early_destinations_become_cancels_even_at_its_entry_cap(side, monkeypatch) -> None:
    """A at its entry cap (MAX_ORPHANS_PER_ENGINE monkeypatched to 2) with two early destinations for x: both turn
    into x's cancel count of 2 (forced: not refused for the cap), and the workers drop both early copies."""
    monkeypatch.setattr(producer_mod, "MAX_ORPHANS_PER_ENGINE", 2)
    p = side.prefill
    assert p._hold("A", "x", dest("A", "a1"), 0.0) is None and p._hold("A", "x", dest("A", "a2"), 0.0) is None
    dl = p.orphans["x"][0]
    p.on_event(("bye", "A", "eof"), 1.0)
    assert p.orphans == {"x": (dl, [], 2)} and p.orphans_refused == 0
    assert _books(side) == {"total": ENTRY, "engines": {"x": ["A"]},
                            "shares": {"A": (ENTRY, {("x", None): ENTRY}, {}, {"x": 2})}}
    assert plan_cancels(side) == [("x", "a1"), ("x", "a2")]


def test_an_event_of_another_kind_is_ignored(side) -> None:
    src = source(side, "x", holders=("A",))
    side.prefill.on_event(("hello", "A", {}), 1.0)
    assert src.holders == {"A"} and src.failed is None and side.sent == []


# ------------------------------------------------------------------ refusals, cancels
def test_failing_a_requests_destinations_tells_each_live_one_and_cancels_it(side) -> None:
    """``_fail_dsts``: each destination not cancelled yet is refused back to its decode with the reason and
    cancelled (the workers told of one they have); one cancelled already is not told again."""
    a1, b1, c1 = dest("A", "a1", forwarded=True), dest("B", "b1"), dest("C", "c1", cancelled=True, forwarded=True)
    src = source(side, "x", dsts=(a1, b1, c1))
    side.prefill._fail_dsts(src, "prefill request req-x ended with FINISHED_ABORTED")
    why = "prefill request req-x ended with FINISHED_ABORTED"
    assert side.sent == [("A", {"type": "fail", "seqs": ["a1"], "reason": why}),
                         ("B", {"type": "fail", "seqs": ["b1"], "reason": why})]
    assert (a1.cancelled, b1.cancelled, c1.cancelled) == (True, True, True)
    assert side.prefill._cancels == [("x", "a1")]


def test_a_cancel_reaches_the_workers_once_and_only_for_a_destination_they_have(side) -> None:
    p = side.prefill
    fwd, new = dest("A", "f", forwarded=True), dest("A", "n")
    src = source(side, "x", dsts=(fwd, new))
    p._cancel(src, new)
    assert new.cancelled and p._cancels == []
    p._cancel(src, fwd)
    p._cancel(src, fwd)
    assert fwd.cancelled and p._cancels == [("x", "f")]


def test_a_failure_is_sent_and_logged_and_one_not_delivered_is_logged_too(side, caplog) -> None:
    """``send_fail`` without ``quiet``: every failure logged, and a decode not reached logged as such."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    p = side.prefill
    side.down.add("D")
    p.send_fail("A", ["s1"], "why")
    p.send_fail("A", ["s2", "s3"], "why not")
    p.send_fail("D", ["s4"], "gone")
    p.server = None
    try:
        p.send_fail("A", ["s5"], "no server")
    finally:
        p.server = side.server
    assert side.sent == [("A", {"type": "fail", "seqs": ["s1"], "reason": "why"}),
                         ("A", {"type": "fail", "seqs": ["s2", "s3"], "reason": "why not"}),
                         ("D", {"type": "fail", "seqs": ["s4"], "reason": "gone"})]
    assert messages(caplog) == [
        "kvtransport: transfer to A ['s1'] failed: why",
        "kvtransport: transfer to A ['s2', 's3'] failed: why not",
        "kvtransport: transfer to D ['s4'] failed: gone",
        "kvtransport: cannot tell decode engine D (not connected)",
        "kvtransport: transfer to A ['s5'] failed: no server",
        "kvtransport: cannot tell decode engine A (not connected)"]


def test_quiet_failures_are_logged_once_per_key_and_so_are_the_undelivered(side, caplog) -> None:
    """``send_fail(quiet=key)``: refusals a flooding decode causes are logged rate-limited per key (the first at
    once, the rest of that key within the interval not), as are the ones that could not be delivered (their own
    key); each is still sent."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    p = side.prefill
    side.down.add("D")
    for seq, key in (("s1", "k1"), ("s2", "k1"), ("s3", "k2")):
        p.send_fail("D", [seq], f"why {seq}", quiet=key)
    assert [m["seqs"] for _, m in side.sent] == [["s1"], ["s2"], ["s3"]]
    assert messages(caplog) == [
        "kvtransport: transfer to D ['s1'] failed: why s1",
        "kvtransport: cannot tell decode engine D (not connected)",
        "kvtransport: transfer to D ['s3'] failed: why s3",
        "kvtransport: cannot tell decode engine D (not connected)"]
    caplog.clear()
    p.send_fail("A", ["s4"], "why s4", quiet="k3")  # delivered: no "cannot tell"
    assert messages(caplog) == ["kvtransport: transfer to A ['s4'] failed: why s4"]


def test_naming_another_engines_request_is_refused_and_counted(side, caplog) -> None:
    """``_foreign``: of the requests named, those another engine registered for the transfer (in its prefill
    request or its orphan), counted; one's own and unknown ones are not."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    p = side.prefill
    source(side, "x", dsts=(dest("A", "a1"), dest("B", "b1"), dest("C", "c1")))
    assert p._hold("B", "y", dest("B", "b2"), 0.0) is None and p._hold("A", "y", dest("A", "a2"), 0.0) is None
    assert p._foreign("A", "x", ["a1", "c1", "b1", "zz"]) == {"b1", "c1"}
    assert p._foreign("A", "y", ["a2", "b2"]) == {"b2"}
    assert p._foreign("A", "x", ["a1", "zz"]) == set() and p._foreign("A", "nothing", ["a1"]) == set()
    assert p.foreign_refused == 3
    assert messages(caplog) == [
        "kvtransport: decode engine A named requests ['b1', 'c1'] of transfer x that another engine owns; refused",
        "kvtransport: decode engine A named requests ['b2'] of transfer y that another engine owns; refused"]


def test_a_destination_for_a_freed_transfer_is_refused_at_once_by_the_reader(side, caplog) -> None:
    """``answer_now`` (the side channel's reader thread): a dst for a transfer in ``gone`` and not registered again
    is answered with a fail naming its requests; anything else goes to the inbox (None)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    p = side.prefill
    p.gone.update({"x": "source released", "back": "source released"})
    source(side, "back")
    dsts = [{"seq": "s1", "blocks": [1], "offset": 0}, "junk", {"seq": "s2", "blocks": [2], "offset": 0}]
    assert p.answer_now("D", {"type": "dst", "xfer": "x", "dsts": dsts}) == {
        "type": "fail", "seqs": ["s1", "s2"], "reason": "prefill cannot serve transfer x: source released"}
    assert messages(caplog) == ["kvtransport: transfer ['s1', 's2'] to D failed: prefill cannot serve transfer x: "
                                "source released"]
    assert p.answer_now("D", {"type": "dst", "xfer": "x"}) is None  # no destinations named
    assert p.answer_now("D", {"type": "dst", "xfer": "x", "dsts": ["junk"]}) is None
    assert p.answer_now("D", {"type": "dst", "xfer": "back", "dsts": dsts}) is None  # registered again
    assert p.answer_now("D", {"type": "dst", "xfer": "new", "dsts": dsts}) is None  # not freed
    assert p.answer_now("D", {"type": "cancel", "xfer": "x", "dsts": dsts}) is None
    assert len(caplog.records) == 1


def test_the_workers_drop_refused_orphans_unless_someone_holds_that_request_now(side) -> None:
    """``_take_orphan_cancels``: each (transfer, request) once, left out while a live destination of that
    request is known here (in its prefill request or an orphan); a cancelled one does not count."""
    p = side.prefill
    source(side, "x", dsts=(dest("V", "v"), dest("V", "c", cancelled=True)))
    assert p._hold("V", "y", dest("V", "u"), 0.0) is None
    p._orphan_cancels = [("x", "v", "X"), ("x", "w", "X"), ("x", "c", "X"), ("x", "w", "Y"), ("y", "u", "X"),
                         ("y", "t", "X"), ("z", "q", "X")]
    assert p._take_orphan_cancels() == [("x", "w"), ("x", "c"), ("y", "t"), ("z", "q")]
    assert p._orphan_cancels == [] and p._take_orphan_cancels() == []


# ------------------------------------------------------------------ making room in MAX_ORPHAN_BLOCKS
def hold_all(side: SchedulerSide, *entries: tuple[str, str, Destination]) -> None:
    for engine, xfer, d in entries:
        assert side.prefill._hold(engine, xfer, d, 0.0) is None  # type: ignore[union-attr]


@pytest.mark.parametrize(("need", "evicted"), [(0, []), (1, ["a1"]), (17, ["a1"]), (18, ["a1", "a2"]), (35, None)],
                         ids=["need0", "need1", "need17_one_entry_exactly", "need18", "need35_more_than_above_after"])
def test_the_oldest_entries_go_exactly_until_the_newcomer_fits(side, monkeypatch, need: int,
                                                               evicted: list[str] | None) -> None:
    """A holds three early destinations of ENTRY + 1 (51 in all); newcomer N's of ENTRY + 1 (it will hold 17)
    needs ``need`` more than MAX_ORPHAN_BLOCKS has left. A gives up its oldest, one by one, until ``need`` is met
    (none at 0, one at exactly its cost, two at one more), but only while it holds more than 17: at 35 it could
    give 34 and N is refused (None), A keeping everything."""
    p = side.prefill
    hold_all(side, ("A", "x", dest("A", "a1")), ("A", "x", dest("A", "a2")), ("A", "x", dest("A", "a3")))
    monkeypatch.setattr(producer_mod, "MAX_ORPHAN_BLOCKS", 3 * (ENTRY + 1) + (ENTRY + 1) - need)
    before = _books(side)
    why = p._hold("N", "n", dest("N", "n1"), 0.0)
    if evicted is None:
        assert why == NO_ROOM.format("N")
        assert _books(side) == before and p.orphans_evicted == 0 and side.sent == []
        assert plan_cancels(side) == []
        return
    assert why is None and p.orphans_evicted == len(evicted)
    assert side.sent == [("A", {"type": "fail", "seqs": [s], "reason": EVICTED.format("A")}) for s in evicted]
    assert [d.seq for d in p.orphans["x"][1]] == [s for s in ("a1", "a2", "a3") if s not in evicted]
    assert p.orphan_total == (3 - len(evicted)) * (ENTRY + 1) + ENTRY + 1 <= producer_mod.MAX_ORPHAN_BLOCKS
    assert plan_cancels(side) == [("x", s) for s in evicted]


def test_the_engine_holding_the_most_gives_up_first(side, monkeypatch) -> None:
    """Z (registered first, 30) and A (40) both hold more than the newcomer will: A, holding the most, gives up
    its oldest; Z keeps its own."""
    p = side.prefill
    hold_all(side, ("Z", "z", dest("Z", "z1", 14)), ("A", "a", dest("A", "a1", 24)))
    monkeypatch.setattr(producer_mod, "MAX_ORPHAN_BLOCKS", 40 + 30 + (ENTRY + 1) - 1)
    assert p._hold("N", "n", dest("N", "n1"), 0.0) is None
    assert side.sent == [("A", {"type": "fail", "seqs": ["a1"], "reason": EVICTED.format("A")})]
    assert p.orphans_evicted == 1 and "a" not in p.orphans and [d.seq for d in p.orphans["z"][1]] == ["z1"]


def test_room_is_made_from_the_next_engine_when_the_first_is_down_to_the_newcomers_share(side, monkeypatch,
                                                                                         caplog) -> None:
    """A (35: a1 of 18, a2 of 17) and Z (34) hold more than newcomer N will (17); N needs 19. A gives up a1 and
    is down to 17, one short: Z gives up its oldest too. Two evictions, both refused back to their decodes in that
    order; the second refusal's log line is rate-limited (one decode's flood must not flood the log)."""
    p = side.prefill
    hold_all(side, ("A", "x", dest("A", "a1", 2)), ("A", "x", dest("A", "a2")), ("Z", "y", dest("Z", "z1")),
             ("Z", "y", dest("Z", "z2")))
    monkeypatch.setattr(producer_mod, "MAX_ORPHAN_BLOCKS", 35 + 34 + (ENTRY + 1) - 19)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert p._hold("N", "n", dest("N", "n1"), 0.0) is None
    assert side.sent == [("A", {"type": "fail", "seqs": ["a1"], "reason": EVICTED.format("A")}),
                         ("Z", {"type": "fail", "seqs": ["z1"], "reason": EVICTED.format("Z")})]
    assert p.orphans_evicted == 2
    assert [d.seq for d in p.orphans["x"][1]] == ["a2"] and [d.seq for d in p.orphans["y"][1]] == ["z2"]
    assert messages(caplog) == [f"kvtransport: transfer to A ['a1'] failed: {EVICTED.format('A')}"]
    assert plan_cancels(side) == [("x", "a1"), ("y", "z1")]


def test_an_evicted_cancel_count_is_logged_with_its_count_and_leaves_the_books(side, monkeypatch, caplog) -> None:
    """A's oldest entry is its cancel count of 3 for x (ENTRY): given up for newcomer N, it is logged with its
    count and both engines, leaves every book (x's orphan goes: nothing else of it was held), and is refused to
    nobody (a cancel only delays its prefill request)."""
    p = side.prefill
    p._hold_cancels("A", "x", 3, 0.0)
    hold_all(side, ("A", "y", dest("A", "a1")))
    monkeypatch.setattr(producer_mod, "MAX_ORPHAN_BLOCKS", ENTRY + (ENTRY + 1) + (ENTRY + 1) - ENTRY)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert p._hold("N", "n", dest("N", "n1"), 0.0) is None
    assert messages(caplog) == ["kvtransport: cancel of 3 destination(s) of transfer x from decode engine A given up "
                                "for decode engine N (MAX_ORPHAN_BLOCKS)"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert p.orphans_evicted == 1 and side.sent == [] and "x" not in p.orphans
    assert _books(side) == {"total": 2 * (ENTRY + 1), "engines": {"y": ["A"], "n": ["N"]},
                            "shares": {"A": (ENTRY + 1, {("y", "a1"): ENTRY + 1}, {"y": 1}, {}),
                                       "N": (ENTRY + 1, {("n", "n1"): ENTRY + 1}, {"n": 1}, {})}}
    assert plan_cancels(side) == []
