"""What a prefill's scheduler side does with each checked message of a decode (producer.py, ``_on_message``):
``dst`` (hybrid groups, an engine whose KV cache cannot take ours, groups that differ, another engine's request, a
transfer not registered yet, gone or unknown, a failed source, the fan-out completed, the first token owed) and
``cancel`` (of early destinations, counts refused to a non-holder or held for later, counts of a registered
transfer and of a sampling family). Exact fail messages, books and counters; no decode connects (what the prefill
sends is recorded)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import producer as producer_mod
from kvtransport_vllm import protocol as proto
from kvtransport_vllm.config import resolve_settings
from kvtransport_vllm.producer import Source
from kvtransport_vllm.scheduler import SchedulerSide

from .test_producer_orphans import plan_cancels
from .vllm_helpers import recorded_prefill_side

NOW = 100.0


@pytest.fixture
def made():
    sides: list[SchedulerSide] = []
    yield sides
    for s in sides:
        s.shutdown()


def prefill(made: list[SchedulerSide], num_groups: int = 1) -> SchedulerSide:
    """A prefill's scheduler side of ``num_groups`` KV cache groups; its sends are recorded in ``.sent``."""
    s = recorded_prefill_side(num_groups=num_groups)
    made.append(s)
    return s


def source(s: SchedulerSide, xfer: str = "x", *, mode: str = "push", fanout: int = 1, rid: str | None = None,
           **kw: Any) -> Source:
    """A registered prefill request for transfer ``xfer``."""
    src = Source(rid or f"req-{xfer}", xfer, mode, fanout, 40, **kw)
    s.prefill.sources[xfer] = src  # type: ignore[union-attr]
    s.prefill.src_by_req[src.req_id] = src  # type: ignore[union-attr]
    return src


def msg(s: SchedulerSide, engine: str, raw: dict[str, Any]) -> None:
    """``raw`` as the side channel hands it on (packed on the wire, checked), from decode ``engine``."""
    checked = proto.check_message(proto.parse_message(proto.encode_message(raw)[4:]))
    s.prefill.on_event(("msg", engine, checked), NOW)  # type: ignore[union-attr]


def dst(xfer: str, *seqs: str, mode: str = "push", groups: list[list[int]] | None = None) -> dict[str, Any]:
    out = [{"seq": q, "blocks": [1, 2], "offset": 0, **({"groups": groups} if groups else {})} for q in seqs]
    return {"type": "dst", "xfer": xfer, "mode": mode, "dsts": out}


def fails(s: SchedulerSide) -> list[tuple[str, list[str], str]]:
    return [(e, m["seqs"], m["reason"]) for e, m in s.sent if m["type"] == "fail"]  # type: ignore[attr-defined]


# ------------------------------------------------------------------ dst
def test_a_hybrid_prefill_takes_a_destination_with_its_other_groups_blocks(made) -> None:
    s = prefill(made, num_groups=2)
    src = source(s)
    msg(s, "A", dst("x", "s", groups=[[7, 8]]))
    assert fails(s) == [] and [(d.seq, list(d.blocks), [list(g) for g in d.extra]) for d in src.dsts] == [("s", [1, 2], [[7, 8]])]


def test_destinations_of_groups_that_differ_are_refused_one_by_one_and_the_rest_taken(made) -> None:
    s = prefill(made)
    src = source(s, fanout=2)
    msg(s, "A", {"type": "dst", "xfer": "x", "mode": "push",
                 "dsts": [{"seq": "two", "blocks": [1], "offset": 0, "groups": [[3]]},
                          {"seq": "one", "blocks": [2], "offset": 0}]})
    assert fails(s) == [("A", ["two"], "KV cache groups differ: decode 2, prefill 1 (run both with the same model "
                                       "and HMA setting)")]
    assert [d.seq for d in src.dsts] == ["one"]


def test_every_destination_of_an_engine_whose_cache_cannot_take_ours_is_refused_with_why(made) -> None:
    s = prefill(made)
    src = source(s, fanout=2)
    s.prefill.unmappable["U"] = "its KV cache layout cannot take ours: run both with the same TP size"
    msg(s, "U", dst("x", "s1", "s2"))
    why = "its KV cache layout cannot take ours: run both with the same TP size"
    assert fails(s) == [("U", ["s1"], why), ("U", ["s2"], why)] and src.dsts == [] and src.holders == set()


def test_another_engines_request_is_refused_and_the_senders_own_taken(made) -> None:
    """B names A's request ``s`` and its own ``t``: ``s`` is refused to B (A keeps it), ``t`` is taken; A naming
    its own request again is not refused. A dst renews the transfer for its sender."""
    s = prefill(made)
    src = source(s, fanout=3)
    msg(s, "A", dst("x", "s"))
    msg(s, "B", dst("x", "s", "t"))
    assert fails(s) == [("B", ["s"], "request s of transfer x belongs to another decode engine")]
    assert [(d.engine, d.seq) for d in src.dsts] == [("A", "s"), ("B", "t")]
    assert src.holders == {"A", "B"} and src.lease_until == NOW + s.settings.lease
    msg(s, "A", dst("x", "s"))
    assert len(fails(s)) == 1


def test_a_destination_for_a_transfer_not_registered_waits_only_in_push_mode(made) -> None:
    s = prefill(made)
    msg(s, "A", dst("y", "s", mode="pull"))
    assert fails(s) == [("A", ["s"], "prefill cannot serve transfer y: unknown transfer (expired, or sent to the "
                                     "wrong prefill instance)")]
    assert s.prefill.orphans == {}
    msg(s, "A", dst("z", "s"))
    assert list(s.prefill.orphans) == ["z"] and len(fails(s)) == 1


def test_a_destination_for_a_transfer_gone_is_refused_with_why_it_went(made) -> None:
    s = prefill(made)
    s.prefill.gone["x"] = "source released"
    msg(s, "A", dst("x", "s1", "s2"))
    why = "prefill cannot serve transfer x: source released"
    assert fails(s) == [("A", ["s1"], why), ("A", ["s2"], why)] and s.prefill.orphans == {}


def test_a_destination_for_a_failed_source_is_refused_with_its_failure(made) -> None:
    s = prefill(made)
    source(s, failed="prefill request req-x ended with FINISHED_ABORTED")
    msg(s, "A", dst("x", "s1", "s2"))
    why = "prefill request req-x ended with FINISHED_ABORTED"
    assert fails(s) == [("A", ["s1"], why), ("A", ["s2"], why)]


def test_early_destinations_refused_for_a_budget_are_counted_told_and_logged_rate_limited(made, monkeypatch,
                                                                                         caplog) -> None:
    monkeypatch.setattr(producer_mod, "MAX_ORPHANS_PER_XFER", 1)
    s = prefill(made)
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        for q in ("s1", "s2", "s3"):
            msg(s, "A", dst("z", q))
    why = ("refused: decode engine A holds 1 destinations for transfer z, whose prefill request has not arrived "
           "(MAX_ORPHANS_PER_XFER)")
    assert fails(s) == [("A", ["s2"], why), ("A", ["s3"], why)] and s.prefill.orphans_refused == 2
    assert [r.getMessage() for r in caplog.records if "failed" in r.getMessage()] == [
        f"kvtransport: transfer to A ['s2'] failed: {why}"]  # the second within the interval is suppressed
    assert plan_cancels(s) == [("z", "s2"), ("z", "s3")]


def test_the_fanout_completed_is_traced_once_and_every_message_counted(made, monkeypatch) -> None:
    events: list[tuple[str, str, dict[str, Any]]] = []
    monkeypatch.setattr(producer_mod.trace, "event", lambda ev, key, **f: events.append((ev, key, f)))
    s = prefill(made)
    src = source(s, fanout=2)
    msg(s, "A", dst("x", "s1"))
    assert events == []
    msg(s, "A", dst("x", "s2"))
    assert events == [("p.dst", "x", {"req": "req-x"})]
    msg(s, "A", dst("x", "s3"))  # past the fan-out: already known
    assert events == [("p.dst", "x", {"req": "req-x"})] and src.msgs == 3


def test_a_new_destination_engine_gets_the_first_token_already_sampled(made) -> None:
    s = prefill(made)
    source(s, first_token=True, first=42)
    msg(s, "A", dst("x", "s"))
    assert [(e, m) for e, m in s.sent if m["type"] == "first"] == [("A", {"type": "first", "xfer": "x", "token": 42})]


def test_no_first_token_is_sent_before_it_is_sampled(made) -> None:
    s = prefill(made)
    source(s, first_token=True)
    msg(s, "A", dst("x", "s"))
    assert [m for _, m in s.sent if m["type"] == "first"] == []


# ------------------------------------------------------------------ cancel
def test_a_count_cancel_for_a_transfer_held_by_another_engine_is_refused(made) -> None:
    """A renewed transfer ``y`` before its prefill request came: only A holds it, so B's count-cancel is refused
    (counted) and nothing is held for it."""
    s = prefill(made)
    s.prefill.on_event(("msg", "A", {"type": "renew", "xfers": ["y"]}), NOW)
    msg(s, "B", {"type": "cancel", "xfer": "y", "mode": "push", "count": 1})
    assert s.prefill.foreign_refused == 1 and s.prefill.orphans == {}
    msg(s, "A", {"type": "cancel", "xfer": "y", "mode": "push", "count": 1})
    assert s.prefill.orphans["y"][1:] == ([], 1)


def test_cancelling_an_early_destination_forgets_it_and_tells_the_workers(made) -> None:
    s = prefill(made)
    msg(s, "A", dst("z", "s1", "s2"))
    msg(s, "A", {"type": "cancel", "xfer": "z", "mode": "push", "seqs": ["s1"]})
    assert [d.seq for d in s.prefill.orphans["z"][1]] == ["s2"]
    assert plan_cancels(s) == [("z", "s1")]
    msg(s, "A", {"type": "cancel", "xfer": "z", "mode": "push", "seqs": ["s2"]})
    assert s.prefill.orphans == {} and plan_cancels(s) == [("z", "s2")]


@pytest.mark.parametrize(("xfer", "mode", "count", "gone"), [("u", "push", 0, False), ("u", "pull", 1, False),
                                                            ("g", "push", 1, True)],
                         ids=["no_count", "pull_unknown", "push_gone"])
def test_a_cancel_that_cannot_be_for_a_coming_request_holds_nothing(made, xfer: str, mode: str, count: int,
                                                                    gone: bool) -> None:
    s = prefill(made)
    if gone:
        s.prefill.gone[xfer] = "source released"
    msg(s, "A", {"type": "cancel", "xfer": xfer, "mode": mode, "count": count, "seqs": ["q"]})
    assert s.prefill.orphans == {} and s.prefill._shares == {}


def test_a_count_cancel_for_a_push_transfer_not_registered_yet_is_held(made) -> None:
    s = prefill(made)
    msg(s, "A", {"type": "cancel", "xfer": "u", "mode": "push", "count": 2})
    assert s.prefill.orphans["u"][1:] == ([], 2)


def test_cancels_of_a_registered_transfer_add_up_and_a_forwarded_destination_is_stopped(made) -> None:
    s = prefill(made)
    src = source(s, fanout=4)
    msg(s, "A", dst("x", "s"))
    src.dsts[0].forwarded = True  # the workers have it
    msg(s, "A", {"type": "cancel", "xfer": "x", "mode": "push", "seqs": ["s"], "count": 1})
    msg(s, "A", {"type": "cancel", "xfer": "x", "mode": "push", "count": 1})
    assert src.cancels == 2 and src.dsts[0].cancelled
    assert plan_cancels(s) == [("x", "s")]


def test_a_count_cancel_counts_as_asked_for_a_pull_sampling_family(made) -> None:
    s = prefill(made)
    source(s, "0_fam", mode="pull", rid="0_fam")
    msg(s, "A", {"type": "cancel", "xfer": "0_fam", "mode": "pull", "count": 1})
    assert s.prefill.family_asked == {"fam": 1}


def test_a_producer_before_its_side_channel_is_attached_tells_no_one_and_raises_nothing(caplog) -> None:
    """The scheduler side attaches the side channel right after making its roles: until then a producer has no
    port (0 in its discovery params) and what it would send (ready, first token, fail) goes nowhere, logged."""
    from kvtransport_vllm.roles import RoleContext

    ctx = RoleContext(settings=resolve_settings({}, env={}), engine_id="P", tp_size=1, num_groups=1,
                      counters={"first_tokens_sent": 0}, params=lambda request: None)
    p = producer_mod.Producer(ctx, unmappable={})
    assert p.server is None and p.port == 0 and p.discovery_params()["kvt_port"] == 0
    src = Source("req-x", "x", "push", 1, 40, holders={"D"})
    src.first = 7
    p._send_ready(src)
    p._tell_first(src)
    assert (src.ready_sent, src.first_told, ctx.counters["first_tokens_sent"]) == (set(), set(), 0)
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        p.send_fail("D", ["s"], "its prefill failed")
    assert [r.getMessage() for r in caplog.records] == [
        "kvtransport: transfer to D ['s'] failed: its prefill failed",
        "kvtransport: cannot tell decode engine D (not connected)"]
