"""The connector's scheduler side (``SchedulerSide``) alone, without a vLLM scheduler: a decode's geometry as the
prefill records it from the decode's hello (what is read, what is bounded, why an unlike decode is refused: a hello
comes from any peer that passed admission), what a finished request leaves behind, and where the workers' send
failures go. Exact values throughout."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm.config import resolve_settings
from kvtransport_vllm.metadata import SendFailure
from kvtransport_vllm.scheduler import SchedulerSide

from .test_scheduler_connector import _Blocks
from .vllm_helpers import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]

MINE = {"tp_size": 1, "block_size": 16, "kv_order": "HN"}
LAYOUT = ("(not [blocks, heads, block, head] dense per layer: MLA's latent cache, cross-layer blocks) serves "
          "like-for-like peers only: run both at one TP size and block size")


@pytest.fixture
def side():
    """A prefill's scheduler side (TP 1, block size 16) whose worker 0 has a unit layout (head order HN)."""
    s = make_side("P")
    s.set_worker_metadata({0: {"kv_order": "HN"}})
    s.sent = []  # type: ignore[attr-defined]  # what it sends to decodes (none connects)
    s.server.send = lambda engine, msg: s.sent.append((engine, msg)) or True  # type: ignore[union-attr,attr-defined]
    yield s
    s.shutdown()


def make_side(engine_id: str = "P", *, producer: bool = True, env: dict[str, str] | None = None,
              **kw: Any) -> SchedulerSide:
    """A scheduler side of one role (block size 16), its settings from ``env`` alone."""
    return SchedulerSide(settings=resolve_settings({}, env=env or {}), engine_id=engine_id, block_size=16,
                         producer=producer, consumer=not producer, compat_info={"model": "m"}, **kw)


def decode_hello(s: SchedulerSide, engine: str) -> dict[str, Any]:
    """A decode's hello that ``s`` finds compatible (no workers)."""
    from kvtransport_vllm.protocol import PROTOCOL_VERSION

    h, info = s.compat()
    return {"type": "hello", "version": PROTOCOL_VERSION, "engine_id": engine, "compat": h, "compat_info": info,
            "tp_size": 1, "workers": {}}


def hello(tp: Any = 1, **geometry: Any) -> dict[str, Any]:
    return {"tp_size": tp, "geometry": {"block_size": 16, "kv_order": "HN", **geometry}}


def taken(side: SchedulerSide, msg: dict[str, Any], engine: str = "D") -> tuple[dict[str, Any], str | None]:
    side._take_geometry(engine, msg)
    return side.peer_geometry[engine], side.unmappable.get(engine)


@pytest.mark.parametrize(("block_size", "read"), [
    (16, 16), (1, 1), (1 << 20, 1 << 20),  # the bounds, inclusive
    (0, -1), (-16, -1), ((1 << 20) + 1, -1), (1 << 21, -1), ("16", -1), (16.0, -1), (None, -1),
])
def test_the_block_size_is_read_within_its_bounds_else_minus_one(side, block_size: Any, read: int) -> None:
    geo, why = taken(side, hello(block_size=block_size))
    assert geo == {**MINE, "block_size": read}
    assert (why is None) == (read > 0)  # an out-of-bounds block size cannot be mapped


@pytest.mark.parametrize(("order", "read"), [("HN", "HN"), ("NH", "NH"), ("CPU", "CPU"), ("nh", None),
                                             ("XX", None), (1, None), (None, None)])
def test_the_head_order_is_one_of_three_names_else_none(side, order: Any, read: Any) -> None:
    geo, _ = taken(side, hello(kv_order=order))
    assert geo["kv_order"] == read


def test_the_tp_size_defaults_to_one_and_the_geometry_to_ours_in_block_size() -> None:
    s = make_side("P")
    try:
        s._take_geometry("D", {})  # an older decode: no tp_size, no geometry
        assert s.peer_geometry["D"] == {"tp_size": 1, "block_size": 16, "kv_order": None}
        assert "D" not in s.unmappable  # like-for-like with a block layout (ours has no worker metadata)
        s._take_geometry("D2", {"tp_size": 2})
        assert s.peer_geometry["D2"] == {"tp_size": 2, "block_size": 16, "kv_order": None}
    finally:
        s.shutdown()


def test_an_unmappable_decode_is_told_why_and_a_later_hello_clears_it(side) -> None:
    geo, why = taken(side, hello(tp=2, block_size=32, kv_order=None))
    assert geo == {"tp_size": 2, "block_size": 32, "kv_order": None}
    assert why == ("decode engine D differs in tp_size 2 (ours 1), block_size 32 (ours 16), KV head order None "
                   f"(ours HN), and the KV cache layout of that decode {LAYOUT}")
    _, why = taken(side, hello(tp=2))  # the same engine again, now with a unit layout: mapped
    assert why is None and "D" not in side.unmappable
    _, why = taken(side, hello(block_size=0))
    assert why == f"decode engine D differs in block_size -1 (ours 16), and the KV cache layout of that decode {LAYOUT}"
    assert set(side.unmappable) == {"D"}
    taken(side, hello(), engine="E")  # another engine's hello leaves D's refusal alone
    assert set(side.unmappable) == {"D"}


def test_a_prefill_with_a_block_layout_maps_no_unlike_decode(side) -> None:
    side.set_worker_metadata({0: {}})  # no kv_order: MLA or cross-layer blocks
    geo, why = taken(side, hello(tp=1, block_size=16, kv_order="NH"))
    assert geo == {"tp_size": 1, "block_size": 16, "kv_order": "NH"}
    assert why == f"decode engine D differs in KV head order NH (ours None), and the KV cache layout of this prefill {LAYOUT}"
    geo, why = taken(side, hello(kv_order=None))  # like for like: nothing to map
    assert why is None


@pytest.mark.parametrize("msg", [hello(tp=2), hello(block_size=8), hello(kv_order="NH"), hello(tp=4, block_size=1)])
def test_an_unlike_decode_with_a_unit_layout_is_mapped(side, msg: dict[str, Any]) -> None:
    _, why = taken(side, msg)
    assert why is None and side.unmappable == {}


# ---------------------------------------------------------------------- a finished request, send failures
def request(rid: str, params: Any, prompt: int = 40) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=prompt,
                           abort_immediately=False)


def books(s: SchedulerSide) -> list[Any]:
    return [dict(s._parsed), dict(s.refused), dict(s._refused_claimed), set(s._refused_failed)]


DECODE = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": "x", "remote_host": "127.0.0.1",
          "remote_port": 9, "remote_engine_id": "P"}


def test_a_finished_request_leaves_nothing_in_the_books_and_holds_no_blocks(side) -> None:
    """``request_finished`` forgets the request in every book (checked params, refusals, claimed and failed
    refusals) and, for anything but a prefill request of a prefill engine, asks vLLM to free its blocks now."""
    keep = request("keep", dict(DECODE))
    side.params(keep)  # another request's entries stay
    side.refused["keep"] = "why"
    side._refused_claimed["keep"] = [1]
    side._refused_failed.add("keep")
    kept = books(side)

    decode = request("d", dict(DECODE))  # a decode request on a prefill-only engine
    assert side.params(decode).role == "decode" and "d" in side._parsed
    assert side.request_finished(decode, [1, 2, 3]) == (False, None)
    assert books(side) == kept

    garbage = request("g", {"do_remote_decode": "yes"})
    assert side.get_num_new_matched_tokens(garbage, 8) == (32, True)  # claimed, to fail
    assert side.refused["g"].startswith("kv_transfer_params refused: ")
    side._refused_claimed["g"] = [4, 5]
    side._refused_failed.add("g")
    assert side.request_finished(garbage, [4, 5]) == (False, None)
    assert books(side) == kept

    whole = request("w", {"do_remote_decode": "yes"})  # refused, its whole prompt found locally: nothing to claim
    assert side.get_num_new_matched_tokens(whole, 40) == (0, False)
    last = request("l", {"do_remote_decode": "yes"})  # one token left to claim: claimed, to fail
    assert side.get_num_new_matched_tokens(last, 39) == (1, True)
    for r in (whole, last):
        side.request_finished(r, [])
    plain = request("n", None)
    assert side.request_finished(plain, [6]) == (False, None)
    assert books(side) == kept and not side.sent  # type: ignore[attr-defined]


def test_a_workers_send_failures_are_told_to_their_decode_engines(side) -> None:
    """Each failure of the workers' last step goes to its own decode engine, naming its sequence and reason."""
    side.update_connector_output([SendFailure(seq="s1", engine="D1", reason="link down"),
                                  SendFailure(seq="s2", engine="D2", reason="refused")], None)
    assert side.sent == [  # type: ignore[attr-defined]
        ("D1", {"type": "fail", "seqs": ["s1"], "reason": "link down"}),
        ("D2", {"type": "fail", "seqs": ["s2"], "reason": "refused"}),
    ]


def test_a_prefill_request_finishing_on_a_decode_only_engine_frees_its_blocks() -> None:
    s = make_side("D", producer=False)
    try:
        prefill = request("p", {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": "x"})
        assert s.params(prefill).role == "prefill"
        assert s.request_finished(prefill, [1, 2]) == (False, None)
        assert books(s) == [{}, {}, {}, set()]
    finally:
        s.shutdown()


# ---------------------------------------------------------------------- compatibility fields, hello, params cache
def test_compat_info_names_the_layout_and_the_workers_backend_hash_and_layers(side) -> None:
    from kvtransport_vllm.protocol import PROTOCOL_VERSION, b64, compat_hash

    side.set_worker_metadata({0: {"kv_order": "HN", "backend": "ucx", "layout_hash": "h1", "layer_names": ["a", "b"],
                                  "metadata": b"meta0"}, 1: {"metadata": b"meta1"}})
    info = {"model": "m", "kv_cache": "units (TP size, block size and head order are mapped)", "backend": "ucx",
            "layout_hash": "h1", "layer_names": ["a", "b"]}
    assert side.compat_info() == info
    assert side.compat() == (compat_hash(info), info)
    assert side.hello() == {"type": "hello", "version": PROTOCOL_VERSION, "engine_id": "P", "compat": compat_hash(info),
                            "compat_info": info, "tp_size": 1, "geometry": MINE,
                            "workers": {"0": b64(b"meta0"), "1": b64(b"meta1")}}
    side.set_worker_metadata({})
    assert side.compat_info() == {"model": "m", "kv_cache": "blocks of tp_size 1 and block_size 16 (like-for-like "
                                                           "peers only)"}


def test_checked_params_are_kept_per_request_until_they_change_and_within_a_bound(side, monkeypatch) -> None:
    from kvtransport_vllm import scheduler as scheduler_mod

    req = request("r1", dict(DECODE))
    first = side.params(req)
    assert side.params(req) is first and side._parsed["r1"] == (req.kv_transfer_params, first)  # read once
    req.kv_transfer_params = {**DECODE, "kvt_xfer": "y"}  # vLLM replaced them: read again
    again = side.params(req)
    assert again is not first and again.xfer == "y" and side.params(req) is again
    monkeypatch.setattr(scheduler_mod, "MAX_PARSED", 3)
    for i in range(2, 6):
        side.params(request(f"r{i}", dict(DECODE)))
    assert list(side._parsed) == ["r3", "r4", "r5"]  # the oldest dropped past the bound


def test_a_refusal_is_logged_unless_the_request_is_aborted_at_once_and_a_parser_bug_is_refused_quietly(
        side, caplog, monkeypatch) -> None:
    import logging

    from kvtransport_vllm import scheduler as scheduler_mod

    caplog.set_level(logging.WARNING, logger="vllm.kvtransport")
    loud = request("loud", {"do_remote_decode": "yes"})
    assert side.params(loud).role is None
    why = side.refused["loud"]
    assert why.startswith("kv_transfer_params refused: ") and "do_remote_decode" in why
    assert [r.getMessage() for r in caplog.records] == [f"kvtransport: request loud fails: {why}"]
    caplog.clear()
    quiet = request("quiet", {"do_remote_decode": "yes"})
    quiet.abort_immediately = True  # vLLM hands back a failed request's params in one aborted at once
    side.params(quiet)
    assert side.refused["quiet"] == why and caplog.records == []
    no_flag = SimpleNamespace(request_id="old", kv_transfer_params={"do_remote_decode": "yes"}, num_prompt_tokens=4)
    side.params(no_flag)  # an older vLLM's request has no abort_immediately: logged
    assert [r.getMessage() for r in caplog.records] == [f"kvtransport: request old fails: {why}"]
    caplog.clear()

    def broken(raw: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(scheduler_mod, "parse_transfer_params", broken)
    side.params(request("bug", dict(DECODE)))
    assert side.refused["bug"] == "kv_transfer_params refused: unreadable (RuntimeError)"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("ERROR", "kvtransport: reading the kv_transfer_params of request bug failed")]


def test_each_role_hook_acts_only_for_its_own_role_on_an_engine_that_plays_it(side) -> None:
    """A decode request reaching a prefill-only engine: registered nowhere, no remote KV claimed, nothing
    allocated for it; a prefill request is registered as a source (at arrival and again at allocation: once)."""
    decode = request("d", dict(DECODE))
    side.on_new_request(decode)
    assert side.get_num_new_matched_tokens(decode, 0) == (0, False)
    side.update_state_after_alloc(decode, None, 0)
    assert side.prefill.src_by_req == {}
    prefill = request("p", {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": "xp"})
    prefill.num_prompt_tokens = 40
    side.on_new_request(prefill)
    src = side.prefill.src_by_req["p"]
    assert (src.xfer, src.mode) == ("xp", "push")
    side.update_state_after_alloc(prefill, None, 0)
    assert side.prefill.src_by_req == {"p": src}
    assert side.get_num_new_matched_tokens(prefill, 0) == (0, False)


# ---------------------------------------------------------------------- what the prefill tells others about itself
def test_the_prefill_names_itself_to_proxies_decodes_and_its_traces() -> None:
    """The discovery answer (a proxy's ``kvt_discover``), the side channel's welcome and a pull-mode request's
    ``kv_transfer_params`` name this engine, its side channel, its TP size and its DP route; the trace file is
    named after the role."""
    import queue

    from kvtransport_vllm import trace
    from kvtransport_vllm.sidechannel import PeerClient

    trace._role = ""  # the first role set in a process names its trace file
    s = make_side("P7", tp_size=2, dp_route=(1, 3))
    try:
        assert trace._role == "prefill"
        assert s.port == s.server.port > 0
        assert s.prefill.discovery_params() == {
            "kvt_host": s.settings.address, "kvt_port": s.port, "kvt_engine_id": "P7", "kvt_mode": s.settings.mode,
            "kvt_dp_rank": 1, "kvt_dp_size": 3}
        client = PeerClient(s.host, s.port, lambda: decode_hello(s, "D"), s.compat, queue.Queue(), timeout=5)
        wait_until(lambda: client.peer_engine is not None, timeout=5)
        assert client.peer_engine == "P7"  # the welcome names this engine
        client.close()
        pull = request("p", {"do_remote_decode": True, "do_remote_prefill": False})
        pull.num_prompt_tokens, pull.num_computed_tokens, pull.num_output_tokens = 40, 40, 1
        pull.status = SimpleNamespace(name="FINISHED_LENGTH_CAPPED")
        s.on_new_request(pull)
        keep, params = s.request_finished(pull, [3, 4, 5])
        assert keep is True and params == {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [3, 4, 5],
            "remote_engine_id": "P7", "remote_request_id": "p", "remote_host": s.settings.address,
            "remote_port": s.port, "tp_size": 2, "remote_num_tokens": 40, "kvt_connector": "kvtransport"}
    finally:
        s.shutdown()
    trace._role = ""
    d = make_side("D", producer=False)
    try:
        assert trace._role == "decode" and d.port == 0 and d.server is None
    finally:
        d.shutdown()


def test_refusal_lines_are_counted_from_a_fresh_engines_first_and_the_minute_is_exactly_sixty_seconds(
        side, caplog, monkeypatch) -> None:
    import logging

    from kvtransport_vllm import scheduler as scheduler_mod

    clock = [1000.0]
    monkeypatch.setattr(scheduler_mod.time, "monotonic", lambda: clock[0])
    caplog.set_level(logging.WARNING, logger="vllm.kvtransport")
    for i in range(21):
        side.params(request(f"g{i}", {"do_remote_decode": "yes"}))
    assert len(caplog.records) == scheduler_mod.REFUSALS_LOGGED_PER_MINUTE == 20  # the 21st is only counted
    caplog.clear()
    clock[0] += 60.0  # a minute to the second: a new window
    side.params(request("next", {"do_remote_decode": "yes"}))
    assert [r.getMessage() for r in caplog.records] == [
        "kvtransport: 1 more request(s) refused for their kv_transfer_params in the last minute (not logged one by one)",
        f"kvtransport: request next fails: {side.refused['next']}"]


# ---------------------------------------------------------------------- the step plan
def idle_output() -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                           scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]))


def test_a_refused_requests_claimed_load_is_failed_by_the_next_plan_once(side) -> None:
    """A request whose params were refused and whose remote "load" vLLM allocated (n > 0 tokens): the next plan
    has its workers start that receive and fail it at once with the refusal's reason; the plan after has nothing.
    An allocation of 0 external tokens, or a second one after the failure, claims nothing."""
    from kvtransport_vllm.metadata import FailureKind

    bad = request("bad", {"do_remote_decode": "yes"})
    assert side.get_num_new_matched_tokens(bad, 0) == (40, True)
    side.update_state_after_alloc(request("none", {"do_remote_decode": "yes"}), _Blocks([[9]], [[9]]), 0)  # nothing claimed
    side.update_state_after_alloc(bad, _Blocks([[4, 5, 6]], [[4, 5, 6]]), 1)
    plan = side.build_plan(idle_output())
    assert (plan.recv_start, plan.recv_blocks, plan.recv_fail, plan.recv_fail_kind) == (
        {"bad": side.settings.transfer_timeout}, {"bad": [4, 5, 6]}, {"bad": side.refused["bad"]},
        {"bad": FailureKind.INVALID_PARAMS})
    again = side.build_plan(idle_output())
    assert (again.recv_start, again.recv_blocks, again.recv_fail) == ({}, {}, {})
    side.update_state_after_alloc(bad, _Blocks([[7]], [[7]]), 40)  # kv_load_failure_policy=recompute: not claimed again
    assert side.get_num_new_matched_tokens(bad, 0) == (0, False) and side.build_plan(idle_output()).recv_fail == {}


def test_a_prefill_request_allocated_before_vllm_announced_it_is_registered_then(side) -> None:
    """vLLM versions without ``on_new_request``: the allocation registers the prefill request as a source."""
    prefill = request("p", {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": "xp"})
    side.update_state_after_alloc(prefill, _Blocks([[1, 2, 3]], [[1, 2, 3]]), 0)
    assert list(side.prefill.src_by_req) == ["p"] and side.prefill.src_by_req["p"].xfer == "xp"


def test_a_new_decode_peers_workers_and_geometry_go_into_the_next_plan_only(side) -> None:
    side.inbox.put(("hello", "D", {**hello(tp=2), "workers": {"0": "bWV0YQ=="}}))
    plan = side.build_plan(idle_output())
    assert plan.peers == {"D": {"0": "bWV0YQ=="}} and plan.peer_geometry == {"D": {**MINE, "tp_size": 2}}
    assert side.peer_workers == {"D": {"0": "bWV0YQ=="}}
    again = side.build_plan(idle_output())
    assert again.peers == {} and again.peer_geometry == {}


def test_a_decodes_gauges_are_reported_when_they_change_only() -> None:
    s = make_side("D", producer=False)
    try:
        assert s.stats_delta() == {"recv_unallocated": 0, "recv_in_progress": 0}
        assert s.stats_delta() == {}  # unchanged: not repeated
        s.counters["first_tokens_received"] += 2
        assert s.stats_delta() == {"first_tokens_received": 2} and s.stats_delta() == {}
    finally:
        s.shutdown()


def test_an_idle_decode_waiting_for_a_first_token_takes_the_event_that_comes_during_its_wait(monkeypatch) -> None:
    """A step that schedules nothing while a request waits for its first token waits for the side channel
    (IDLE_INBOX_WAIT_S, 0.8 s here); an event arriving during that wait is handled in this step, at this step's
    time."""
    import threading

    from kvtransport_vllm import scheduler as scheduler_mod

    monkeypatch.setattr(scheduler_mod, "IDLE_INBOX_WAIT_S", 0.8)
    s = make_side("D", producer=False)
    try:
        s.decode.awaits_first_token = lambda: True  # type: ignore[method-assign]
        threading.Timer(0.2, lambda: s.inbox.put(("ready", ("127.0.0.1", 9), ["x1"]))).start()
        t0 = time.monotonic()
        s.build_plan(idle_output())
        took = time.monotonic() - t0
        assert 0.15 < took < 1.5, took  # returned once the event came, not after the whole wait
        stamp = s.decode.ready_xfers["x1"]
        assert isinstance(stamp, float) and t0 - 0.01 <= stamp <= t0 + 0.01  # the step's own time
    finally:
        s.shutdown()


def test_an_orphan_past_its_lease_is_expired_by_the_next_plan_and_refused_to_its_decode(side) -> None:
    """A destination whose prefill request never came is held for a lease; the first plan after it ends (an
    idle step, nothing in the inbox) drops it and tells its decode."""
    from kvtransport_vllm import protocol as proto

    msg = {"type": "dst", "xfer": "x", "mode": "push", "dsts": [{"seq": "s1", "blocks": [1, 2], "offset": 0}]}
    side.prefill._on_message("D", proto.check_message(proto.parse_message(proto.encode_message(msg)[4:])),
                             time.monotonic() - side.settings.lease - 1)
    assert list(side.prefill.orphans) == ["x"]
    side.build_plan(idle_output())
    assert side.prefill.orphans == {}
    assert [(e, m["type"], m["seqs"]) for e, m in side.sent] == [("D", "fail", ["s1"])]  # type: ignore[attr-defined]


def test_a_prefill_with_a_secret_admits_only_decodes_that_prove_it() -> None:
    import queue

    from kvtransport_vllm.sidechannel import PeerClient

    s = make_side("P", env={"KV_TRANSPORT_SECRET": "s3cret"})
    try:
        stranger = PeerClient(s.host, s.port, lambda: decode_hello(s, "D"), s.compat, queue.Queue(), timeout=3)
        friend = PeerClient(s.host, s.port, lambda: decode_hello(s, "D2"), s.compat, queue.Queue(), timeout=3,
                            secret=b"s3cret")
        wait_until(lambda: stranger.error is not None and friend.peer_engine is not None, timeout=5)
        assert stranger.dead and stranger.peer_engine is None
        assert friend.peer_engine == "P" and not friend.dead
        stranger.close()
        friend.close()
    finally:
        s.shutdown()
