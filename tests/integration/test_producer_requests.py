"""The prefill's requests on its scheduler side (producer.py): how a prefill request is registered (early
destinations, cancels and holds attach to it; a parallel-sampling sibling shares its first sibling's transfer),
what each step plans for it (its blocks per KV cache group, the prompt tokens it computes, the destinations the
workers do not have yet), what ``request_finished`` answers vLLM in every case (kept blocks and NIXL-compatible
params, a discovery answer, or blocks freed at once) and when its blocks are released (served, failed, lease
expired). Exact values throughout; no decode connects (what the prefill sends is recorded)."""

from __future__ import annotations

import logging
import time
from array import array
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import trace
from kvtransport_vllm.metadata import Bind, SourceStep, StepPlan
from kvtransport_vllm.producer import Destination, Source, sampling_family
from kvtransport_vllm.scheduler import SchedulerSide
from vllm.v1.request import RequestStatus

from .test_scheduler_side import request as plain_request
from .vllm_helpers import make_request, recorded_prefill_side

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]

LEASE = 30.0  # the default lease (resolve_settings)


@pytest.fixture
def make_side():
    """Makes prefill scheduler sides (settings from ``kv_connector_extra_config`` ``extra`` alone); what each
    sends to decodes is recorded in ``side.sent``."""
    made: list[SchedulerSide] = []

    def make(extra: dict[str, Any] | None = None, **kw: Any) -> SchedulerSide:
        s = recorded_prefill_side(extra, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()


@pytest.fixture
def side(make_side):
    return make_side()


@pytest.fixture
def events(monkeypatch) -> list[tuple[str, str, dict[str, Any]]]:
    """The trace events recorded from now on: (event, key, fields)."""
    got: list[tuple[str, str, dict[str, Any]]] = []
    monkeypatch.setattr(trace, "event", lambda ev, key, **fields: got.append((ev, key, fields)))
    return got


def prefill(rid: str, *, xfer: str | None = None, prompt: int = 40, **flags: Any) -> Any:
    """A real vLLM prefill request (``do_remote_decode``) of ``prompt`` tokens; ``xfer``: the push flow's
    transfer id (None: the pull flow); ``flags``: ``kvt_<name>`` params."""
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if xfer is not None:
        params["kvt_xfer"] = xfer
    params.update({f"kvt_{k}": v for k, v in flags.items()})
    return make_request(list(range(10, 10 + prompt)), params=params, rid=rid)


def finished(req: Any, status: str = "FINISHED_LENGTH_CAPPED", *, computed: int | None = None,
             outputs: tuple[int, ...] = (7,)) -> Any:
    req.status = RequestStatus[status]
    req.num_computed_tokens = req.num_prompt_tokens if computed is None else computed
    for t in outputs:
        req.append_output_token_ids(t)
    return req


def dst_msg(xfer: str, *seqs: str, mode: str = "push", blocks: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """A checked ``dst`` message naming decode requests ``seqs`` of ``xfer`` (one KV cache group)."""
    return {"type": "dst", "xfer": xfer, "mode": mode,
            "dsts": [{"seq": s, "blocks": list(blocks), "offset": 0} for s in seqs]}


def tell(s: SchedulerSide, engine: str, msg: dict[str, Any], now: float | None = None) -> None:
    s.prefill.on_event(("msg", engine, msg), time.monotonic() if now is None else now)  # type: ignore[union-attr]


def new_req(rid: str, block_ids: Any, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=rid, block_ids=block_ids, num_computed_tokens=computed)


def step(new: list[SimpleNamespace] = (), cached: list[tuple[str, Any, int]] = (), *,  # type: ignore[assignment]
         tokens: dict[str, int] | None = None, resumed: set[str] | None = None) -> SimpleNamespace:
    """A scheduler output: ``new`` requests, ``cached`` ones as (request id, new block ids, computed tokens),
    ``tokens``: request id -> tokens scheduled; ``resumed``: cached requests resumed after a preemption."""
    c = SimpleNamespace(req_ids=[r for r, _, _ in cached], new_block_ids=[b for _, b, _ in cached],
                        num_computed_tokens=[n for _, _, n in cached])
    if resumed is not None:
        c.resumed_req_ids = resumed
    return SimpleNamespace(scheduled_new_reqs=list(new), num_scheduled_tokens=dict(tokens or {}),
                           scheduled_cached_reqs=c)


def plan(s: SchedulerSide, so: SimpleNamespace | None = None, now: float | None = None) -> StepPlan:
    out = StepPlan()
    s.prefill.plan_step(so or step(), out, time.monotonic() if now is None else now)  # type: ignore[union-attr]
    return out


def planned(p: StepPlan) -> tuple[list[Bind], list[tuple[str, str]], list[str], list[str]]:
    """A plan's (binds, cancels, dropped, releases)."""
    return p.binds, p.cancels, p.dropped, p.send_release


def source(mode: str, fanout: int, *, settled: int = 0, unsettled: int = 0, cancelled: int = 0, msgs: int = 0,
           cancels: int = 0) -> Source:
    """A source with destinations handed to the workers (``settled``), not yet (``unsettled``) or cancelled."""
    src = Source("r", "x", mode, fanout, 40, msgs=msgs, cancels=cancels)
    for i in range(settled):
        src.dsts.append(Destination("D", f"f{i}", [1], 0, forwarded=True))
    for i in range(unsettled):
        src.dsts.append(Destination("D", f"u{i}", [1], 0))
    for i in range(cancelled):
        src.dsts.append(Destination("D", f"c{i}", [1], 0, cancelled=True))
    return src


# ---------------------------------------------------------------------- small pieces
@pytest.mark.parametrize(("rid", "family"), [("0_parent", "parent"), ("12_a_b", "a_b"), ("1_2_p", "2_p"),
                                             ("parent", None), ("_x", None), ("x_1", None), ("a1_x", None)],
                         ids=["child", "child_of_an_id_with_underscores", "child_of_a_child_like_id", "plain",
                              "no_index", "index_last", "not_digits"])
def test_only_a_parallel_sampling_child_id_names_its_family(rid: str, family: str | None) -> None:
    """vLLM names the children of a request ``"{index}_{parent}"``: only a leading index is taken off."""
    assert sampling_family(rid) == family


def test_a_bind_copies_the_destination_and_every_further_kv_cache_group_into_tuples() -> None:
    d = Destination("D", "s1", array("I", [4, 5]), 2, extra=[array("I", [6, 7]), [8, 9]])
    b = d.bind("x")
    assert b == Bind("x", "D", "s1", (4, 5), 2, ((6, 7), (8, 9)))
    assert type(b.blocks) is tuple and all(type(g) is tuple for g in b.groups)
    assert Destination("D", "s2", [1], 0).bind("y") == Bind("y", "D", "s2", (1,), 0, ())


@pytest.mark.parametrize(("dsts", "cancels", "fanout", "known"), [
    (1, 0, 1, True), (0, 1, 1, True), (1, 1, 2, True), (2, 0, 2, True), (3, 0, 2, True),
    (0, 0, 1, False), (1, 0, 2, False), (0, 1, 2, False),
], ids=["one_of_one", "one_cancelled_of_one", "one_and_a_cancel_of_two", "two_of_two", "three_of_two",
        "none_of_one", "one_of_two", "a_cancel_of_two"])
def test_destinations_are_known_once_arrivals_and_cancels_reach_the_fanout(dsts: int, cancels: int, fanout: int,
                                                                           known: bool) -> None:
    assert source("push", fanout, unsettled=dsts, cancels=cancels).destinations_known() is known


@pytest.mark.parametrize(("src", "served"), [
    (source("push", 1, settled=1), True),
    (source("push", 1, unsettled=1), False),
    (source("push", 2, settled=1, cancels=1), True),
    (source("push", 2, settled=1), False),
    (source("push", 1, msgs=1), False),
    (source("push", 1, settled=1, unsettled=1), False),
    (source("push", 1, cancelled=1), True),
    (source("pull", 1, msgs=1), True),
    (source("pull", 1, settled=1), False),
    (source("pull", 1, settled=1, msgs=1), True),
    (source("pull", 1, unsettled=1, msgs=1), False),
    (source("pull", 1, cancels=1), True),
    (source("pull", 2, settled=2, msgs=1), True),
    (source("pull", 2, settled=1, msgs=1), False),
    (source("pull", 2, settled=1, cancels=1, msgs=1), True),
    (source("pull", 2, settled=1, unsettled=1, msgs=1), False),
], ids=["push_one_put", "push_one_not_handed_over", "push_one_put_one_cancelled", "push_one_of_two",
        "push_counts_destinations_not_messages", "push_one_put_one_pending", "push_cancelled_destination",
        "pull_one_message_of_one", "pull_of_one_counts_messages", "pull_one_message_put", "pull_message_not_put",
        "pull_cancelled", "pull_two_children_in_one_message", "pull_one_child_of_two", "pull_one_child_one_cancel",
        "pull_two_children_one_pending"])
def test_a_source_is_served_once_every_expected_destination_came_and_the_workers_have_each(src: Source,
                                                                                          served: bool) -> None:
    """Push: destinations the workers have (plus cancels) reach the fanout. Pull: as many asks (messages when one
    child is expected, else destinations) plus cancels as expected, and the workers have every destination."""
    assert src.served() is served


@pytest.mark.parametrize("book", ["orphans", "_releases", "_cancels", "_dropped", "_orphan_cancels", "none"],
                         ids=["orphans", "releases", "cancels", "dropped", "orphan_cancels", "none"])
def test_work_is_pending_while_any_one_queue_holds_something(side, book: str) -> None:
    p = side.prefill
    assert p.has_pending_work() is False
    value = {"orphans": {"x": (0.0, [], 1)}, "_releases": ["r"], "_cancels": [("x", "s")], "_dropped": ["r"],
             "_orphan_cancels": [("x", "s", "D")]}.get(book)
    if value is not None:
        setattr(p, book, value)
    assert p.has_pending_work() is (book != "none")


def test_the_discovery_answer_names_the_side_channel_mode_and_data_parallel_route(make_side) -> None:
    s = make_side({"mode": "pull"}, dp_route=(2, 4))
    assert s.prefill.discovery_params() == {"kvt_host": "127.0.0.1", "kvt_port": s.server.port, "kvt_engine_id": "P",
                                            "kvt_mode": "pull", "kvt_dp_rank": 2, "kvt_dp_size": 4}
    assert s.server.port > 0


# ---------------------------------------------------------------------- registration
def test_early_destinations_cancels_and_holds_attach_to_the_request_when_it_arrives(side, events) -> None:
    """Before the prefill request exists, decode D sends a destination and a cancel count of 2, decode E renews
    the transfer: the request takes all of it (one message), and nothing is left waiting."""
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    tell(side, "D", {"type": "cancel", "xfer": "x", "mode": "push", "seqs": [], "count": 2})
    tell(side, "E", {"type": "renew", "xfers": ["x"]})
    events.clear()
    src = p.register_source(prefill("r", xfer="x"))
    assert [(d.engine, d.seq) for d in src.dsts] == [("D", "s1")]
    assert (src.msgs, src.cancels, src.holders) == (1, 2, {"D", "E"})
    assert (p.orphans, p.holds, p.sources, p.src_by_req) == ({}, {}, {"x": src}, {"r": src})
    assert events == [("p.new", "x", {"req": "r"}), ("p.dst", "x", {"req": "r", "wait": 0.0})]
    assert p.register_source(prefill("r", xfer="x")) is src  # registered once
    assert events[2:] == []


def test_an_early_cancel_alone_attaches_no_message(side, events) -> None:
    p = side.prefill
    tell(side, "D", {"type": "cancel", "xfer": "x", "mode": "push", "seqs": [], "count": 1})
    events.clear()
    src = p.register_source(prefill("r", xfer="x"))
    assert (src.dsts, src.msgs, src.cancels, src.holders) == ([], 0, 1, set())
    assert events == [("p.new", "x", {"req": "r"})]


@pytest.mark.parametrize(("setting", "flag", "delayed", "delay"), [
    (0.5, True, True, 0.5), (0.5, False, False, 0.0), (0.0, True, False, 0.0), (2.0, True, True, 2.0),
], ids=["flagged_under_a_delay", "unflagged_under_a_delay", "flagged_without_a_delay", "flagged_under_a_long_delay"])
def test_only_a_flagged_request_under_a_debug_push_delay_is_planned_with_that_delay(
        make_side, setting: float, flag: bool, delayed: bool, delay: float) -> None:
    s = make_side({"debug_push_delay": setting})
    src = s.prefill.register_source(prefill("r", xfer="x", debug_delay=flag))
    assert src.debug_delay is delayed
    p = plan(s, step([new_req("r", ([1, 2, 3],))], tokens={"r": 40}))
    assert p.sources == [SourceStep("r", "x", 40, ((1, 2, 3),), 0, 40, layerwise=True, delay=delay)]


def test_a_parallel_sampling_sibling_sharing_a_transfer_id_adds_to_its_first_siblings_fanout(side, events) -> None:
    """A router sends the client's n to the prefill with one transfer id (Mooncake-style): the first child serves
    every decode child; a sibling holds nothing, is never planned and frees its blocks when it finishes."""
    p = side.prefill
    first = p.register_source(prefill("0_fam", xfer="x"))
    sib = p.register_source(prefill("1_fam", xfer="x"))
    third = p.register_source(prefill("2_fam", xfer="x"))
    assert (first.fanout, first.sibling, sib.sibling, third.sibling) == (3, False, True, True)
    assert p.sources == {"x": first} and list(p.src_by_req) == ["0_fam", "1_fam", "2_fam"]
    assert p.family_size == {}  # push sources are no pull family
    out = plan(side, step([new_req("0_fam", ([1, 2, 3],)), new_req("1_fam", ([4, 5, 6],))],
                          tokens={"0_fam": 40, "1_fam": 40}))
    assert [s.req_id for s in out.sources] == ["0_fam"]
    assert p.request_finished(finished(prefill("1_fam", xfer="x")), [4, 5, 6]) == (False, None)
    assert list(p.src_by_req) == ["0_fam", "2_fam"] and p.sources == {"x": first}
    assert plan(side).dropped == [] and "x" not in p.gone
    assert [e for e in events if e[0] == "p.finished"] == []


def test_requests_sharing_a_transfer_id_are_siblings_only_within_one_sampling_family(side) -> None:
    p = side.prefill
    a = p.register_source(prefill("0_fam", xfer="x"))
    b = p.register_source(prefill("0_other", xfer="x"))
    assert (a.fanout, b.sibling, b.fanout) == (1, False, 1)
    c = p.register_source(prefill("plain", xfer="y"))
    d = p.register_source(prefill("plain2", xfer="y"))
    assert (c.sibling, d.sibling, c.fanout) == (False, False, 1)


def test_a_pull_request_is_never_a_sibling_of_a_push_transfer_that_carries_its_id(side) -> None:
    """Only the push flow shares transfer ids: a pull request's transfer is its own id, even when a push request
    of the same family named its transfer so."""
    p = side.prefill
    push = p.register_source(prefill("0_fam", xfer="1_fam"))
    pull = p.register_source(prefill("1_fam"))
    assert (pull.mode, pull.xfer, pull.sibling, push.fanout) == ("pull", "1_fam", False, 1)
    assert p.family_size == {"fam": 1}


TAKEN = ("kv_transfer_params refused: transfer id 'x' is in use by another live prefill request of this engine; "
         "give each request its own (kvt_xfer or transfer_id: only the children of one parallel-sampling request "
         "share one)")


def test_a_request_naming_a_transfer_id_a_live_request_holds_is_refused_and_the_live_one_keeps_it(side,
                                                                                                   caplog) -> None:
    """Two requests, one transfer id (a router that reuses ids, a client retrying with its own): the second would
    replace the first in ``sources``, so either decode could be served the other prompt's KV. It is refused (its
    request fails); the first keeps its transfer; a child of the first's parallel-sampling request still shares
    it; once the first is gone the id is free again."""
    p = side.prefill
    side.on_new_request(prefill("0_a", xfer="x"))
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        side.on_new_request(prefill("0_b", xfer="x"))
    assert side.refused == {"0_b": TAKEN}
    assert [r.getMessage() for r in caplog.records] == [f"kvtransport: request 0_b fails: {TAKEN}"]  # said, once
    assert list(p.src_by_req) == ["0_a"] and p.sources["x"].req_id == "0_a"
    assert side.get_num_new_matched_tokens(prefill("0_b", xfer="x"), 0) == (40, True)  # admitted only to fail
    side.on_new_request(prefill("1_a", xfer="x"))  # a sibling: shares the transfer
    assert "1_a" not in side.refused and p.sources["x"].fanout == 2
    side.on_new_request(prefill("0_a", xfer="x"))  # the same request again (e.g. resumed): not refused
    assert set(side.refused) == {"0_b"}
    p._drop_source("1_a")
    p._drop_source("0_a")
    side.on_new_request(prefill("0_c", xfer="x"))
    assert "0_c" not in side.refused and p.sources["x"].req_id == "0_c"


def test_a_pull_request_whose_id_a_live_push_transfer_carries_is_refused(side) -> None:
    side.on_new_request(prefill("0_a", xfer="x"))
    side.on_new_request(prefill("x"))  # the pull flow: the transfer id is the request id
    assert side.refused == {"x": TAKEN} and side.prefill.sources["x"].req_id == "0_a"


def test_a_transfer_id_in_use_is_named_at_most_64_characters_long(side) -> None:
    long = "y" * 300
    side.on_new_request(prefill("0_a", xfer=long))
    side.on_new_request(prefill("0_b", xfer=long))
    assert side.refused["0_b"] == TAKEN.replace("'x'", repr("y" * 64))


# ---------------------------------------------------------------------- request_finished
def test_a_discovery_request_frees_its_blocks_at_once_and_returns_the_discovery_params(make_side, events) -> None:
    s = make_side(dp_route=(1, 2))
    p = s.prefill
    req = prefill("0_disc", discover=True)
    src = p.register_source(req)
    assert (src.discover, p.sources, p.family_size) == (True, {}, {"disc": 1})
    assert plan(s, step([new_req("0_disc", ([1],))], tokens={"0_disc": 40})).sources == []  # never planned
    assert p.request_finished(finished(req), [1]) == (False, p.discovery_params())
    assert p.discovery_params() == {"kvt_host": "127.0.0.1", "kvt_port": s.server.port, "kvt_engine_id": "P",
                                    "kvt_mode": "push", "kvt_dp_rank": 1, "kvt_dp_size": 2}
    assert (p.src_by_req, p.sources, p.gone, p.family_size, p.family_asked) == ({}, {}, {}, {}, {})
    assert planned(plan(s)) == ([], [], [], [])
    assert [e[0] for e in events] == ["p.new"]
    # one vLLM never announced answers the same, and nothing is registered for it
    assert p.request_finished(finished(prefill("other", discover=True)), []) == (False, p.discovery_params())
    assert (p.src_by_req, p.sources, p.gone) == ({}, {}, {})


def test_a_push_request_that_finished_keeps_its_blocks_and_returns_nixl_params_with_its_transfer(side,
                                                                                                 events) -> None:
    """vLLM hands a finished request's blocks per KV cache group: the first group's go to the decode, every group
    is kept for the workers; the computed tokens are capped at the prompt; the lease starts now."""
    p = side.prefill
    req = prefill("r", xfer="x")
    p.register_source(req)
    t0 = time.monotonic()
    keep, out = p.request_finished(finished(req, "FINISHED_STOPPED", computed=41), ([1, 2, 3], [4, 5, 6], [7, 8, 9]))
    t1 = time.monotonic()
    assert keep is True and out == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3], "remote_engine_id": "P",
        "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": side.port, "tp_size": 1,
        "remote_num_tokens": 40, "kvt_connector": "kvtransport", "kvt_xfer": "x"}
    src = p.src_by_req["r"]
    assert (src.finished, src.complete, src.delay_freed, src.failed) == (True, True, True, None)
    assert (src.blocks, src.extra, src.computed) == ([1, 2, 3], [[4, 5, 6], [7, 8, 9]], 40)
    assert t0 + LEASE <= src.lease_until <= t1 + LEASE
    assert events == [("p.new", "x", {"req": "r"}), ("p.finished", "x", {"req": "r"})]
    assert p.sources == {"x": src} and p.gone == {}


def test_a_pull_request_that_finished_returns_nixl_params_naming_itself_and_its_computed_tokens(side) -> None:
    p = side.prefill
    req = prefill("r", prompt=40)
    src = p.register_source(req)
    src.computed = 40  # planned whole before; vLLM may count fewer computed (a prefix hit)
    keep, out = p.request_finished(finished(req, computed=16), [5, 6, 7])
    assert keep is True and out == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [5, 6, 7], "remote_engine_id": "P",
        "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": side.port, "tp_size": 1,
        "remote_num_tokens": 40, "kvt_connector": "kvtransport"}
    assert (src.computed, src.blocks, src.extra, src.mode) == (40, [5, 6, 7], [], "pull")


def test_a_request_vllm_never_announced_is_registered_when_it_finishes(side, events) -> None:
    p = side.prefill
    keep, out = p.request_finished(finished(prefill("r", xfer="x")), [1, 2, 3])
    assert keep is True and out is not None and out["kvt_xfer"] == "x"
    assert list(p.src_by_req) == ["r"] and p.sources["x"].req_id == "r"
    assert events == [("p.new", "x", {"req": "r"}), ("p.finished", "x", {"req": "r"})]


@pytest.mark.parametrize(("status", "ok"), [("FINISHED_STOPPED", True), ("FINISHED_LENGTH_CAPPED", True),
                                            ("FINISHED_ABORTED", False)],
                         ids=["stopped", "length_capped", "aborted"])
def test_a_status_without_a_name_is_read_as_its_string(side, status: str, ok: bool) -> None:
    req = plain_request("r", {"do_remote_decode": True, "kvt_xfer": "x"})
    req.status, req.num_computed_tokens, req.num_output_tokens, req.output_token_ids = status, 40, 1, [7]
    keep, out = side.prefill.request_finished(req, [1, 2, 3])
    assert (keep, out is not None) == (ok, ok)
    assert side.prefill.gone == ({} if ok else {"x": f"prefill request r ended with {status}"})


def test_a_first_token_request_tells_its_decodes_the_token_it_sampled(side) -> None:
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    req = prefill("r", xfer="x", first_token=True)
    src = p.register_source(req)
    assert src.first_token is True
    assert p.request_finished(finished(req, outputs=(77, 78)), [1, 2, 3])[0] is True
    assert src.first == 77 and side.sent == [("D", {"type": "first", "xfer": "x", "token": 77})]


def test_a_first_token_request_that_sampled_nothing_tells_no_token(side) -> None:
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    req = prefill("r", xfer="x", first_token=True)
    src = p.register_source(req)
    keep, out = p.request_finished(finished(req, outputs=()), [1, 2, 3])
    assert keep is True and out is not None and out["kvt_xfer"] == "x"
    assert src.first is None and side.sent == []


def test_a_request_given_up_before_it_was_scheduled_frees_its_blocks_at_once(side) -> None:
    """Its only decode went away (a renewal, then the side channel's end) before vLLM scheduled it."""
    p = side.prefill
    req = prefill("r", xfer="x")
    src = p.register_source(req)
    tell(side, "D", {"type": "renew", "xfers": ["x"]})
    p.on_event(("bye", "D", "closed"), time.monotonic())
    assert src.failed == "decode engine D disconnected (closed)"
    assert p.request_finished(finished(req), [1, 2, 3]) == (False, None)
    assert (p.src_by_req, p.sources, p.gone) == ({}, {}, {"x": "decode engine D disconnected (closed)"})
    assert planned(plan(side)) == ([], [], [], [])


def test_a_request_given_up_after_it_was_scheduled_keeps_its_blocks_until_the_next_plan_releases_it(side) -> None:
    """Its workers may have put from its blocks: vLLM keeps them until the workers flushed; the next plan drops
    it there and releases it."""
    p = side.prefill
    req = prefill("r", xfer="x")
    src = p.register_source(req)
    tell(side, "D", {"type": "renew", "xfers": ["x"]})
    assert plan(side, step([new_req("r", ([1, 2, 3],))], tokens={"r": 40})).sources != []
    p.on_event(("bye", "D", "closed"), time.monotonic())
    assert p.request_finished(finished(req), [1, 2, 3]) == (True, None)
    assert (src.finished, src.delay_freed, list(p.src_by_req)) == (True, True, ["r"])
    assert planned(plan(side)) == ([], [], ["r"], ["r"])
    assert (p.src_by_req, p.sources, p.gone) == ({}, {}, {"x": "decode engine D disconnected (closed)"})
    assert planned(plan(side)) == ([], [], [], [])


def test_a_request_that_ended_badly_before_it_was_scheduled_fails_its_decodes_and_frees_its_blocks(side,
                                                                                                 events) -> None:
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    req = prefill("r", xfer="x")
    p.register_source(req)
    events.clear()
    why = "prefill request r ended with FINISHED_ABORTED"
    assert p.request_finished(finished(req, "FINISHED_ABORTED"), [1, 2, 3]) == (False, None)
    assert side.sent == [("D", {"type": "fail", "seqs": ["s1"], "reason": why})]
    assert (p.src_by_req, p.sources, p.gone) == ({}, {}, {"x": why})
    assert planned(plan(side)) == ([], [], [], [])
    assert events == [("p.finished", "x", {"req": "r"})]


def test_a_request_that_ended_badly_after_it_was_scheduled_cancels_its_puts_and_is_released_next(side) -> None:
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    req = prefill("r", xfer="x")
    p.register_source(req)
    first = plan(side, step([new_req("r", ([1, 2, 3],))], tokens={"r": 16}))
    assert first.binds == [Bind("x", "D", "s1", (1, 2, 3), 0, ())]
    why = "prefill request r ended with FINISHED_ERROR"
    assert p.request_finished(finished(req, "FINISHED_ERROR", computed=16), [1, 2, 3]) == (True, None)
    assert side.sent == [("D", {"type": "ready", "xfers": ["x"]}), ("D", {"type": "fail", "seqs": ["s1"], "reason": why})]
    assert planned(plan(side)) == ([], [("x", "s1")], ["r"], ["r"])
    assert (p.src_by_req, p.gone) == ({}, {"x": why})


# ---------------------------------------------------------------------- pull families (n > 1 on both sides)
def test_a_pull_child_whose_siblings_took_every_pull_is_dropped_when_it_finishes(side) -> None:
    """vLLM's toy proxy sends n=2 to both sides: the prefill computes children 0_f and 1_f, only 0_f's params reach
    the decode, and both decode children pull 0_f. 1_f is asked for by nobody: it frees its blocks at once, its
    workers forget it; 0_f is released once its pulls are handed over, and the family is forgotten."""
    p = side.prefill
    r0, r1 = prefill("0_f"), prefill("1_f")
    p.register_source(r0)
    p.register_source(r1)
    assert p.family_size == {"f": 2}
    plan(side, step([new_req("0_f", ([1, 2, 3],)), new_req("1_f", ([4, 5, 6],))], tokens={"0_f": 40, "1_f": 40}))
    tell(side, "D", dst_msg("0_f", "d0", "d1", mode="pull"))
    assert p.family_asked == {"f": 2}
    assert p.request_finished(finished(r1), [4, 5, 6]) == (False, None)
    assert list(p.src_by_req) == ["0_f"] and p.family_size == {"f": 1}
    assert p.gone == {"1_f": "source released"}
    binds, cancels, dropped, releases = planned(plan(side))
    assert [(b.xfer, b.seq) for b in binds] == [("0_f", "d0"), ("0_f", "d1")]
    assert (cancels, dropped, releases) == ([], ["1_f"], [])
    keep, out = p.request_finished(finished(r0), [1, 2, 3])
    assert keep is True and out is not None and out["remote_request_id"] == "0_f"
    assert planned(plan(side)) == ([], [], [], ["0_f"])
    assert (p.src_by_req, p.family_size, p.family_asked) == ({}, {}, {})
    assert p.gone == {"1_f": "source released", "0_f": "source released"}


def test_a_lone_pull_child_nobody_asked_for_yet_keeps_its_blocks(side) -> None:
    p = side.prefill
    req = prefill("0_g")
    p.register_source(req)
    assert p.family_size == {"g": 1} and p.family_asked == {}
    keep, out = p.request_finished(finished(req), [1, 2])
    assert keep is True and out is not None and out["remote_request_id"] == "0_g"
    assert list(p.src_by_req) == ["0_g"]
    assert planned(plan(side)) == ([], [], [], [])  # not served, lease running


def test_a_pull_familys_last_child_leaves_no_books_even_when_nobody_asked(side) -> None:
    p = side.prefill
    req = prefill("0_g")
    p.register_source(req)
    assert p.request_finished(finished(req, "FINISHED_ABORTED"), [1, 2]) == (False, None)
    assert (p.src_by_req, p.family_size, p.family_asked) == ({}, {}, {})


def test_asks_count_for_a_pull_family_only(side) -> None:
    p = side.prefill
    push = p.register_source(prefill("0_p", xfer="x"))
    child = p.register_source(prefill("0_f"))
    fanned = p.register_source(prefill("1_h", fanout=2))  # n known: no family
    p._family_asks(push, 2)
    p._family_asks(fanned, 1)
    p._family_asks(child, 0)
    assert p.family_asked == {}
    p._family_asks(child, 2)
    assert p.family_asked == {"f": 2} and p.family_size == {"f": 1}


# ---------------------------------------------------------------------- the plan: sources
def test_a_request_is_planned_with_its_blocks_per_group_and_the_prompt_tokens_each_step_computes(side,
                                                                                                events) -> None:
    """Chunked: 32 tokens with two KV cache groups, then the last 8 with one more block per group; the decode
    holding the transfer is told it may allocate once; a decode step of the request plans nothing."""
    p = side.prefill
    tell(side, "E", {"type": "renew", "xfers": ["x"]})
    src = p.register_source(prefill("r", xfer="x"))
    events.clear()
    first = plan(side, step([new_req("r", ([1, 2], [3, 4]))], tokens={"r": 32}))
    assert first.sources == [SourceStep("r", "x", 40, ((1, 2), (3, 4)), 0, 32, layerwise=True, delay=0.0)]
    assert (src.computed, src.scheduled) == (32, True)
    assert side.sent == [("E", {"type": "ready", "xfers": ["x"]})]
    assert events == []
    second = plan(side, step(cached=[("r", ([5], [6]), 32)], tokens={"r": 8}))
    assert second.sources == [SourceStep("r", "x", 40, ((1, 2, 5), (3, 4, 6)), 32, 40, layerwise=True, delay=0.0)]
    assert (src.blocks, src.extra, src.computed) == ([1, 2, 5], [[3, 4, 6]], 40)
    assert events == [("p.scheduled", "x", {"req": "r"})]
    assert len(side.sent) == 1  # told once
    third = plan(side, step(cached=[("r", None, 40)], tokens={"r": 1}))  # it decodes its first token
    assert third.sources == [] and src.computed == 40 and len(events) == 1


def test_a_step_that_computes_the_last_prompt_token_alone_is_planned(side, events) -> None:
    p = side.prefill
    src = p.register_source(prefill("r", xfer="x"))
    src.computed = 39
    events.clear()
    out = plan(side, step(cached=[("r", None, 39)], tokens={"r": 1}))
    assert out.sources == [SourceStep("r", "x", 40, ((),), 39, 40, layerwise=True, delay=0.0)]
    assert events == [("p.scheduled", "x", {"req": "r"})]


def test_a_step_that_schedules_no_token_of_a_request_plans_nothing_for_it(side) -> None:
    p = side.prefill
    tell(side, "E", {"type": "renew", "xfers": ["x"]})
    src = p.register_source(prefill("r", xfer="x"))
    out = plan(side, step([new_req("r", ([1, 2, 3],))], tokens={}))
    assert out.sources == [] and (src.scheduled, src.computed, src.blocks) == (False, 0, [1, 2, 3])
    out = plan(side, step(cached=[("r", ([4],), 0)], tokens={"other": 16}))
    assert out.sources == [] and (src.scheduled, src.computed, src.blocks) == (False, 0, [1, 2, 3, 4])
    assert side.sent == []


def test_a_step_plans_the_whole_prompt_at_most(side) -> None:
    p = side.prefill
    src = p.register_source(prefill("r", xfer="x", prompt=20))
    out = plan(side, step([new_req("r", ([1, 2],), computed=16)], tokens={"r": 10}))
    assert out.sources == [SourceStep("r", "x", 20, ((1, 2),), 16, 20, layerwise=True, delay=0.0)]
    assert src.computed == 20


@pytest.mark.parametrize(("mode", "xfer", "layerwise"), [("push", "x", True), ("push", None, False),
                                                         ("pull", "x", False), ("pull", None, False)],
                         ids=["push_engine_push_request", "push_engine_pull_request", "pull_engine_push_request",
                              "pull_engine_pull_request"])
def test_only_a_push_request_on_a_push_engine_is_put_layer_by_layer(make_side, mode: str, xfer: str | None,
                                                                    layerwise: bool) -> None:
    s = make_side({"mode": mode})
    s.prefill.register_source(prefill("r", xfer=xfer))
    out = plan(s, step([new_req("r", ([1, 2, 3],))], tokens={"r": 40}))
    assert out.sources == [SourceStep("r", xfer or "r", 40, ((1, 2, 3),), 0, 40, layerwise=layerwise, delay=0.0)]


def test_a_preempted_request_resumes_into_its_new_blocks_and_a_running_one_grows_every_group(side) -> None:
    p = side.prefill
    a = p.register_source(prefill("a", xfer="xa"))
    b = p.register_source(prefill("b", xfer="xb"))
    c = p.register_source(prefill("c", xfer="xc"))
    plan(side, step([new_req("a", ([1],)), new_req("b", ()), new_req("c", None)], tokens={"a": 16, "b": 16, "c": 16}))
    assert (a.blocks, a.extra, b.blocks, b.extra, c.blocks, c.extra) == ([1], [], [], [], [], [])
    out = plan(side, step(cached=[("other", ([5],), 0), ("a", ([7, 8], [9, 10]), 0), ("b", ([2], [3], [4]), 16),
                                  ("c", None, 16)],
                          tokens={"a": 16, "b": 16, "c": 16, "other": 16}, resumed={"a"}))
    assert (a.blocks, a.extra) == ([7, 8], [[9, 10]])  # recomputed into new blocks
    assert (b.blocks, b.extra) == ([2], [[3], [4]])  # groups it had none of yet
    assert (c.blocks, c.extra) == ([], [])
    assert out.sources == [SourceStep("a", "xa", 40, ((7, 8), (9, 10)), 0, 16),
                           SourceStep("b", "xb", 40, ((2,), (3,), (4,)), 16, 32),
                           SourceStep("c", "xc", 40, ((),), 16, 32)]
    out = plan(side, step(cached=[("a", None, 16), ("b", ([5], [6], [7]), 32)], tokens={"a": 8, "b": 8},
                          resumed={"a"}))
    assert (a.blocks, a.extra) == ([], [])  # resumed with nothing new
    assert (b.blocks, b.extra) == ([2, 5], [[3, 6], [4, 7]])
    assert [(s.req_id, s.groups, s.start, s.stop) for s in out.sources] == [
        ("a", ((),), 16, 24), ("b", ((2, 5), (3, 6), (4, 7)), 32, 40)]


def test_an_output_without_resumed_requests_grows_every_cached_request(side) -> None:
    """vLLM before resumed_req_ids: no cached request reads as resumed."""
    p = side.prefill
    src = p.register_source(prefill("r", xfer="x"))
    plan(side, step([new_req("r", ([1],))], tokens={"r": 16}))
    plan(side, step(cached=[("r", ([2],), 16)], tokens={"r": 16}))
    assert src.blocks == [1, 2]


def test_a_failed_request_is_no_longer_planned(side) -> None:
    p = side.prefill
    tell(side, "D", {"type": "renew", "xfers": ["x"]})
    src = p.register_source(prefill("r", xfer="x"))
    plan(side, step([new_req("r", ([1, 2, 3],))], tokens={"r": 16}))
    p.on_event(("bye", "D", "closed"), time.monotonic())
    assert src.failed is not None
    out = plan(side, step(cached=[("r", None, 16)], tokens={"r": 16}))
    assert out.sources == [] and src.computed == 16


# ---------------------------------------------------------------------- the plan: binds and releases
def test_destinations_are_handed_to_the_workers_once_their_request_is_scheduled_or_complete(side) -> None:
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    tell(side, "D", dst_msg("y", "t1", blocks=(4, 5)))
    x = p.register_source(prefill("rx", xfer="x"))
    y = p.register_source(prefill("ry", xfer="y"))
    assert plan(side).binds == []  # neither runs yet
    out = plan(side, step([new_req("rx", ([1, 2, 3],))], tokens={"rx": 16}))
    assert out.binds == [Bind("x", "D", "s1", (1, 2, 3), 0, ())] and x.dsts[0].forwarded is True
    assert plan(side).binds == []  # once
    tell(side, "D", dst_msg("x", "s2"))
    assert plan(side).binds == [Bind("x", "D", "s2", (1, 2, 3), 0, ())]
    assert p.request_finished(finished(prefill("ry", xfer="y")), [9, 9])[0] is True  # complete, never scheduled
    assert planned(plan(side)) == ([Bind("y", "D", "t1", (4, 5), 0, ())], [], [], ["ry"])
    assert y.dsts[0].forwarded is True and list(p.src_by_req) == ["rx"]


def test_a_served_request_is_released_in_the_plan_that_hands_over_its_last_destination(side) -> None:
    p = side.prefill
    req = prefill("r", xfer="x", fanout=2)
    p.register_source(req)
    tell(side, "D", dst_msg("x", "s1"))
    plan(side, step([new_req("r", ([1, 2, 3],))], tokens={"r": 40}))
    assert p.request_finished(finished(req), [1, 2, 3])[0] is True
    assert planned(plan(side)) == ([], [], [], [])  # one of two destinations
    tell(side, "D", dst_msg("x", "s2"))
    assert planned(plan(side)) == ([Bind("x", "D", "s2", (1, 2, 3), 0, ())], [], [], ["r"])
    assert (p.src_by_req, p.sources, p.gone) == ({}, {}, {"x": "source released"})


def test_a_served_request_still_running_is_not_released(side) -> None:
    p = side.prefill
    tell(side, "D", dst_msg("x", "s1"))
    p.register_source(prefill("r", xfer="x"))
    out = plan(side, step([new_req("r", ([1, 2, 3],))], tokens={"r": 40}))
    assert planned(out) == ([Bind("x", "D", "s1", (1, 2, 3), 0, ())], [], [], [])
    assert planned(plan(side, now=time.monotonic() + 10 * LEASE)) == ([], [], [], [])
    assert list(p.src_by_req) == ["r"]


def test_a_finished_request_missing_a_destination_is_released_when_its_lease_ends_not_before(side) -> None:
    """r waits for a second destination, q for its only one; each lease expiration is counted."""
    p = side.prefill
    req, other = prefill("r", xfer="x", fanout=2), prefill("q", xfer="y")
    p.register_source(req)
    p.register_source(other)
    tell(side, "D", dst_msg("x", "s1"))
    plan(side, step([new_req("r", ([1, 2, 3],)), new_req("q", ([4],))], tokens={"r": 40, "q": 40}))
    p.request_finished(finished(req), [1, 2, 3])
    p.request_finished(finished(other), [4])
    leases = [p.src_by_req["r"].lease_until, p.src_by_req["q"].lease_until]
    assert planned(plan(side, now=min(leases) - 0.001)) == ([], [], [], [])
    assert side.counters["lease_expirations"] == 0
    assert planned(plan(side, now=max(leases))) == ([], [], [], ["r", "q"])
    assert side.counters["lease_expirations"] == 2
    assert (p.src_by_req, p.gone) == ({}, {"x": "source released", "y": "source released"})


def test_a_failed_request_is_dropped_and_released_only_once_it_finished(side) -> None:
    """Failed while vLLM still runs it: planned no more, kept until vLLM finishes it."""
    p = side.prefill
    tell(side, "D", {"type": "renew", "xfers": ["x"]})
    req = prefill("r", xfer="x")
    src = p.register_source(req)
    plan(side, step([new_req("r", ([1, 2, 3],))], tokens={"r": 16}))
    p.on_event(("bye", "D", "closed"), time.monotonic())
    assert planned(plan(side, now=time.monotonic() + 10 * LEASE)) == ([], [], [], [])
    assert list(p.src_by_req) == ["r"]
    src.finished = True  # as request_finished leaves it (blocks kept)
    assert planned(plan(side)) == ([], [], ["r"], [])  # not kept: nothing to release
    assert p.src_by_req == {}


def test_the_record_of_released_transfers_keeps_the_newest_4096(side) -> None:
    p = side.prefill
    p.gone.update({f"old{i}": "source released" for i in range(4095)})
    p.request_finished(finished(prefill("r1", xfer="x1"), "FINISHED_ABORTED"), [])
    assert len(p.gone) == 4096 and "old0" in p.gone and p.gone["x1"] == "prefill request r1 ended with FINISHED_ABORTED"
    p.request_finished(finished(prefill("r2", xfer="x2"), "FINISHED_ABORTED"), [])
    assert len(p.gone) == 4096 and "old0" not in p.gone and "old1" in p.gone and list(p.gone)[-2:] == ["x1", "x2"]


# ---------------------------------------------------------------------- expiry
def test_expire_fails_orphans_and_forgets_holds_whose_lease_ended_by_now(side) -> None:
    """An early destination (and the hold its message took) or a renewal before the request came lasts one
    lease: gone at its end exactly, the destination refused to its decode and dropped at the workers."""
    p = side.prefill
    t = time.monotonic()
    tell(side, "D", dst_msg("old", "s1"), now=t)
    tell(side, "D", dst_msg("new", "s2"), now=t + 1)
    tell(side, "E", {"type": "renew", "xfers": ["h1"]}, now=t)
    tell(side, "E", {"type": "renew", "xfers": ["h2"]}, now=t + 1)
    end = p.orphans["old"][0]
    assert end == p.holds["old"][0] == p.holds["h1"][0] == t + LEASE
    p.expire(end - 0.001)
    assert set(p.orphans) == {"old", "new"} and set(p.holds) == {"old", "new", "h1", "h2"}
    assert side.sent == []
    p.expire(end)
    assert list(p.orphans) == ["new"] and set(p.holds) == {"new", "h2"}
    assert side.sent == [("D", {"type": "fail", "seqs": ["s1"],
                                "reason": "no prefill request for transfer old arrived within 30s"})]
    assert plan(side, now=end).cancels == [("old", "s1")]
