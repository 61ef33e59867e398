"""A request's ``kv_transfer_params`` come from any API client: garbage in any field must never raise in vLLM's
engine core (an exception there stops the engine). Each field is read and checked in one place
(``metadata.parse_transfer_params``); a request whose params are refused takes vLLM's failure path (admitted
only to have its "load" fail: FINISHED_ERROR under the default ``kv_load_failure_policy``) and the engine goes on.

The garbage goes through real vLLM Schedulers (a prefill and a decode, our connector on them) and real
``Request`` objects, so every scheduler-side hook that reads the params runs: ``on_new_request``,
``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``, ``request_finished``.
"""

from __future__ import annotations

import math
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from .vllm_helpers import (
    assert_no_leaks,
    empty_output,
    make_config,
    make_request,
    make_scheduler,
    plan_of,
    runner_output,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

HUGE = 10 ** 5000
"""More digits than ``str(int)`` converts (4300 by default): ``str()`` of it raises ValueError."""
PROMPT = list(range(100, 140))  # 40 tokens: 3 blocks of 16


def _label(value: Any) -> str:
    """A short test id for ``value`` (``repr`` of HUGE or of DEEP raises)."""
    return "HUGE" if value is HUGE else "DEEP" if value is DEEP else repr(value)[:20]


def safe_ids(names: list[str]) -> list[str]:
    """Test ids made of ``[A-Za-z0-9_=.-]`` only, at most 40 characters, unique: mutmut hands each test's id back
    to pytest, which cannot take ids with spaces, newlines, ``@``/``:`` or hundreds of characters (every other
    character becomes ``_``; a repeat gets ``~N``)."""
    out: list[str] = []
    seen: dict[str, int] = {}
    for name in names:
        safe = re.sub(r"[^A-Za-z0-9_=.-]", "_", name)[:40]
        n = seen[safe] = seen.get(safe, 0) + 1
        out.append(safe if n == 1 else f"{safe}~{n}")
    return out


def _nested(depth: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(depth):
        out = [out]
    return out


def _loop() -> list[Any]:
    out: list[Any] = []
    out.append(out)
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CLOSED = _closed_port()  # a decode request that got through would connect here and be refused at once


def prefill_params(**over: Any) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": "xf-p", "kvt_fanout": 1, **over}


def decode_params(**over: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": "xf-d", "remote_host": "127.0.0.1",
            "remote_port": CLOSED, "remote_engine_id": "P", **over}


DEEP = _nested(5000)
"""Deeper than ``str()`` goes (RecursionError)."""
_ID_GARBAGE = [True, False, 1.5, math.nan, math.inf, -math.inf, 2 ** 63, -1, HUGE, [], ["x"], {}, {"a": 1},
               "x" * 513, DEEP]
_BOOL_GARBAGE = [1, 0, "true", "", 1.0, math.nan, [], [True], {}, HUGE]
_PORT_GARBAGE = [0, -1, 65536, 2 ** 64, HUGE, True, False, 7000.0, 1.5, math.nan, math.inf, "0", "70000", "0x1b58",
                 "7e3", " 7000", "abc", "7" * 5000, [7000], {"port": 7000}]
_HOST_GARBAGE = [1, True, 1.5, math.nan, [], ["127.0.0.1"], {}, "h" * 254, "a b", "a/b", "h\x00", "\n", HUGE]
_FANOUT_GARBAGE = [0, -1, 257, 2 ** 64, HUGE, True, False, 2.0, math.nan, math.inf, "2", [2], {}]

# (case id, role, params): each one must be refused, naming the field (or the whole), on the role's engine
CASES: list[tuple[str, str, Any, str]] = []
for _v in _BOOL_GARBAGE:
    CASES.append((f"do_remote_decode={_label(_v)}", "prefill", prefill_params(do_remote_decode=_v), "do_remote_decode"))
    CASES.append((f"do_remote_prefill={_label(_v)}", "decode", decode_params(do_remote_prefill=_v), "do_remote_prefill"))
for _key in ("kvt_first_token", "kvt_discover", "kvt_debug_delay", "kvt_debug_late", "kvt_debug_hold"):
    for _v in _BOOL_GARBAGE:
        _role, _make = ("prefill", prefill_params) if _key in ("kvt_discover", "kvt_debug_delay") else (
            "decode", decode_params)
        CASES.append((f"{_key}={_label(_v)}", _role, _make(**{_key: _v}), _key))
# each id where it is read: transfer_id and remote_request_id without a kvt_xfer (which would come first), the
# decode's remote_engine_id without remote_host/remote_port (then it names the side channel)
_WITHOUT = {"kvt_xfer": {}, "transfer_id": {"kvt_xfer": None}, "remote_request_id": {"kvt_xfer": None},
            "remote_engine_id": {"remote_host": None, "remote_port": None}}
for _key, _without in _WITHOUT.items():
    for _v in _ID_GARBAGE:
        _why = "nested deeper than 32" if _v is DEEP else _key
        CASES.append((f"p-{_key}={_label(_v)}", "prefill", prefill_params(**{"kvt_xfer": None, _key: _v}), _why))
        CASES.append((f"d-{_key}={_label(_v)}", "decode", decode_params(**{**_without, _key: _v}), _why))
for _v in _PORT_GARBAGE:
    CASES.append((f"remote_port={_label(_v)}", "decode", decode_params(remote_port=_v), "remote_port"))
for _v in _HOST_GARBAGE:
    CASES.append((f"remote_host={_label(_v)}", "decode", decode_params(remote_host=_v), "remote_host"))
for _v in _FANOUT_GARBAGE:
    CASES.append((f"kvt_fanout={_label(_v)}", "prefill", prefill_params(kvt_fanout=_v), "kvt_fanout"))
CASES += [
    # the side channel in Mooncake's shape (remote_engine_id "<engine>@<host>:<port>"), malformed
    *[(f"engine@{tail}", "decode", decode_params(remote_host=None, remote_port=None, remote_engine_id=f"e@{tail}"),
       "remote_engine_id") for tail in ("h:0", "h:70000", "h:x", ":7000", "h", f"{'h' * 300}:7000", "h:")],
    ("host without port", "decode", decode_params(remote_port=None), "remote_port"),
    ("port without host", "decode", decode_params(remote_host=None), "remote_host"),
    ("both roles", "prefill", prefill_params(do_remote_prefill=True), "do_remote_decode"),
    # the whole: too many keys, a key too long or not a string, too big or too deep below an unknown key
    ("non-string key", "prefill", {**prefill_params(), 7: "x"}, "keys must be strings"),
    ("too many keys", "prefill", {**prefill_params(), **{f"k{i}": i for i in range(200)}}, "204 keys, at most 64"),
    ("a long key", "decode", {**decode_params(), "k" * 10_000: 1}, "a key of 10000 characters"),
    ("a huge list", "decode", decode_params(remote_block_ids=list(range(2_000_000))), "more than 262144 values"),
    ("many small lists", "decode", decode_params(remote_block_ids=[[1, 2]] * 200_000), "more than 262144 values"),
    ("a huge string", "prefill", prefill_params(note="x" * (4 << 20)), "characters of text"),
    ("many strings", "prefill", prefill_params(notes=["x" * 1000] * 2000), "characters of text"),
    ("deep nesting", "prefill", prefill_params(deep=_nested(200)), "nested deeper than 32"),
    ("deep in an object", "decode", decode_params(deep={"a": {"b": {"c": _nested(40)}}}), "nested deeper than 32"),
    ("a self-referencing list", "prefill", prefill_params(loop=_loop()), "nested deeper than 32"),
    # a decode request that names a prefill but no transfer
    ("no transfer", "decode", decode_params(kvt_xfer=None), "kvt_xfer, transfer_id or remote_request_id"),
]
NOT_OBJECTS: list[tuple[str, str, Any, str]] = [
    # not an object: vLLM's API server refuses these itself (its request models type the field as a dict), and
    # vLLM's own Scheduler.add_request calls .get on it, so only the parser sees them
    ("a list", "prefill", [1, 2], "kv_transfer_params"),
    ("a string", "decode", "do_remote_prefill", "kv_transfer_params"),
    ("an int", "prefill", HUGE, "kv_transfer_params"),
]


@pytest.fixture(scope="module")
def engines(tiny_model: str) -> Iterator[dict[str, Any]]:
    """A prefill and a decode scheduler, made again after a test that left either one dirty."""
    made: dict[str, Scheduler] = {}

    def get(role: str) -> Scheduler:
        sched = made.get(role)
        if sched is not None and (sched.requests or len(sched.waiting) or len(sched.running)):
            sched.shutdown()
            sched = None
        if sched is None:
            kv_role = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}[role]
            sched = made[role] = make_scheduler(make_config(tiny_model, role=kv_role), num_blocks=200)
        return sched

    yield {"get": get}
    for sched in made.values():
        sched.shutdown()


def refused_then_failed(sched: Scheduler, params: Any) -> str:
    """Drive a request with ``params`` through ``sched`` the way the engine does; it must be admitted only to
    fail (its "load" is reported failed by the connector's plan) and finish with FINISHED_ERROR, leaving no
    block behind. Returns the reason the plan gave."""
    req = make_request(PROMPT, params=params)
    rid = req.request_id
    sched.add_request(req)  # on_new_request
    so = sched.schedule()  # get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta
    plan = plan_of(so)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, req.status
    assert rid in plan.recv_start and rid in plan.recv_fail, plan
    from kvtransport_vllm.metadata import FailureKind

    assert plan.recv_fail_kind[rid] is FailureKind.INVALID_PARAMS
    sched.update_from_output(so, empty_output())
    # the worker reports the receive failed (what WorkerSide does with recv_fail): vLLM fails the request
    so = sched.schedule()
    assert rid not in plan_of(so).recv_start  # refused once only
    sched.update_from_output(so, empty_output(failed={rid}))
    assert req.status == RequestStatus.FINISHED_ERROR, req.status
    sched.update_from_output(sched.schedule(), empty_output())  # request_finished ran; nothing left
    assert_no_leaks(sched)
    conn = sched.get_kv_connector()._sched
    assert not conn.refused
    return plan.recv_fail[rid]


def abort_and_drain(sched: Scheduler, req: Any) -> None:
    """Abort ``req`` and report what its workers would: sources released, receives aborted."""
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    for _ in range(4):
        so = sched.schedule()
        plan = plan_of(so)
        sched.update_from_output(so, empty_output(sending=set(plan.send_release), recving=set(plan.recv_abort)))


@pytest.mark.parametrize(("role", "params", "field"), [c[1:] for c in CASES], ids=safe_ids([c[0] for c in CASES]))
def test_garbage_is_refused_through_vllms_failure_path(engines, role: str, params: Any, field: str) -> None:
    reason = refused_then_failed(engines["get"](role), params)
    assert reason.startswith("kv_transfer_params refused: ") and field in reason, reason
    assert len(reason) < 400, reason  # bounded: never the value itself


@pytest.mark.parametrize(("role", "params", "field"), [c[1:] for c in CASES[::7]], ids=safe_ids([c[0] for c in CASES[::7]]))
def test_garbage_aborted_before_it_is_scheduled_leaves_nothing(engines, role: str, params: Any, field: str) -> None:
    """What vLLM's API server does for a request it rejected after sending it (``abort_immediately``): added,
    then finished at once; ``request_finished`` must take the garbage too."""
    sched = engines["get"](role)
    req = make_request(PROMPT, params=params)
    sched.add_request(req)
    sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(sched.schedule(), empty_output())
    assert_no_leaks(sched)
    assert not sched.get_kv_connector()._sched.refused


def test_a_kv_both_engine_refuses_garbage_of_either_role(engines) -> None:
    sched = engines["get"]("both")
    for params in (prefill_params(kvt_fanout="2"), decode_params(remote_port=10 ** 30), {"do_remote_decode": 1}):
        assert "kv_transfer_params refused" in refused_then_failed(sched, params)


def test_the_engine_serves_the_next_valid_request(engines) -> None:
    """After garbage, a valid prefill request is served as before (computed, held for its decode)."""
    sched = engines["get"]("prefill")
    refused_then_failed(sched, prefill_params(kvt_fanout=HUGE))
    req = make_request(PROMPT, params=prefill_params(kvt_xfer="xf-next"), max_tokens=1)
    sched.add_request(req)
    so = sched.schedule()
    assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[req.request_id] == len(PROMPT)
    (src,) = plan_of(so).sources
    assert (src.xfer, src.layerwise) == ("xf-next", True)
    sched.update_from_output(so, runner_output([req], token=None))
    abort_and_drain(sched, req)
    assert_no_leaks(sched)


def test_recompute_policy_recomputes_a_refused_request_once(tiny_model: str) -> None:
    """With ``kv_load_failure_policy=recompute`` vLLM computes a refused request itself (its params ignored):
    the connector does not claim it a second time."""
    sched = make_scheduler(make_config(tiny_model, role="kv_consumer", policy="recompute"), num_blocks=200)
    try:
        req = make_request(PROMPT, params=decode_params(remote_port="http"), max_tokens=1)
        sched.add_request(req)
        so = sched.schedule()
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.request_id in plan_of(so).recv_fail
        sched.update_from_output(so, empty_output(failed={req.request_id}))
        so = sched.schedule()
        assert so.num_scheduled_tokens.get(req.request_id) == len(PROMPT), "recomputed from scratch"
        assert not plan_of(so).recv_start
    finally:
        sched.shutdown()


def test_refusals_are_logged_once_each_at_most_20_a_minute(engines, caplog, monkeypatch) -> None:
    """Any client can send garbage as fast as it likes: one line per refused request, at most
    REFUSALS_LOGGED_PER_MINUTE a minute, then one line saying how many more; vLLM's own re-submission of a
    failed request's params (``abort_immediately``, to free what the connector holds) is not logged again."""
    from kvtransport_vllm import scheduler as mod

    clock = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])
    sched = engines["get"]("decode")
    side = sched.get_kv_connector()._sched
    side._refusal_log[:] = [0.0, 0, 0]

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "kv_transfer_params" in r.getMessage()]

    with caplog.at_level("WARNING", logger="vllm.kvtransport"):
        reqs = [make_request(PROMPT, params=decode_params(remote_port=-i)) for i in range(25)]
        for req in reqs:
            sched.add_request(req)
        assert len(lines()) == mod.REFUSALS_LOGGED_PER_MINUTE
        assert "got the integer -3" in lines()[3] and reqs[3].request_id in lines()[3]
        again = make_request(PROMPT, params=decode_params(remote_port=0))
        again.abort_immediately = True  # what AsyncLLM.notify_kv_transfer_request_rejected sends
        sched.add_request(again)
        clock[0] += 61
        sched.add_request(last := make_request(PROMPT, params=decode_params(remote_port=-99)))
        assert lines()[-2:] == [
            "kvtransport: 5 more request(s) refused for their kv_transfer_params in the last minute (not logged one "
            "by one)",
            f"kvtransport: request {last.request_id} fails: kv_transfer_params refused: remote_port must be a port "
            "number in 1..65535, got the integer -99"]
    for req in [*reqs, again, last]:
        sched.finish_requests([req.request_id], RequestStatus.FINISHED_ABORTED)
    sched.update_from_output(sched.schedule(), empty_output())
    assert_no_leaks(sched)
    assert not side.refused


# ---------------------------------------------------------------------- the parser itself
def test_valid_params_are_read_as_before() -> None:
    from kvtransport_vllm.metadata import parse_transfer_params

    p = parse_transfer_params(prefill_params(kvt_fanout=3, kvt_first_token=True))
    assert (p.role, p.xfer, p.fanout, p.first_token, p.discover) == ("prefill", "xf-p", 3, True, False)
    d = parse_transfer_params(decode_params(remote_port="7000"))
    assert (d.role, d.xfer, d.side_channel, d.transfer) == ("decode", "xf-d", ("127.0.0.1", 7000), "xf-d")
    # NixlConnector's keys as a prefill answers them (unknown keys ignored), and the toy proxy's prefill leg
    nixl = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(range(4096)),
            "remote_engine_id": "P", "remote_request_id": "cmpl-1", "remote_host": "10.0.0.5", "remote_port": 7000,
            "tp_size": 1, "remote_num_tokens": 40, "kvt_connector": "kvtransport", "remote_prefill_cached_tokens": 0}
    n = parse_transfer_params(nixl)
    assert (n.role, n.xfer, n.transfer, n.side_channel) == ("decode", None, "cmpl-1", ("10.0.0.5", 7000))
    toy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None, "kvt_fanout": 2}
    t = parse_transfer_params(toy)
    assert (t.role, t.xfer, t.fanout, t.side_channel) == ("prefill", None, 2, None)
    # Mooncake's shape: transfer_id (an int is an id too), the side channel in remote_engine_id
    m = parse_transfer_params({"do_remote_prefill": True, "transfer_id": 7, "remote_bootstrap_addr": "http://h:1",
                               "remote_engine_id": "eng-1@a@::1:7000"})
    assert (m.xfer, m.side_channel) == ("7", ("::1", 7000))
    assert parse_transfer_params({"do_remote_decode": True, "kvt_xfer": "a", "transfer_id": "b"}).xfer == "a"
    for empty in (None, {}, {"unrelated": [1, {"x": None}]}, {"do_remote_decode": False, "do_remote_prefill": None}):
        assert parse_transfer_params(empty).role is None
    # an engine id that names no side channel (NixlConnector's) is just an id
    assert parse_transfer_params({"do_remote_prefill": True, "remote_engine_id": "uuid-1"}).side_channel is None
    # the limits are inclusive
    assert parse_transfer_params(decode_params(kvt_xfer="x" * 512, remote_host="h" * 253, remote_port=65535)).xfer
    assert parse_transfer_params(prefill_params(kvt_fanout=256)).fanout == 256


@pytest.mark.parametrize(("role", "params", "field"), [c[1:] for c in CASES + NOT_OBJECTS],
                         ids=safe_ids([c[0] for c in CASES + NOT_OBJECTS]))
def test_the_parser_names_the_field(role: str, params: Any, field: str) -> None:
    from kvtransport_vllm.metadata import TransferParamsError, parse_transfer_params

    with pytest.raises(TransferParamsError, match=field):
        parse_transfer_params(params)


def test_fuzz_the_parser_and_the_hooks(engines) -> None:
    """Any JSON-like value in any field: the parser returns a checked object or raises TransferParamsError
    (nothing else), and the scheduler hooks never raise: a refused request fails, an accepted one is served
    or waits for its KV as usual."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    from kvtransport_vllm.metadata import MAX_FANOUT, MAX_PARAM_CHARS, TransferParamsError, parse_transfer_params

    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2 ** 80), max_value=2 ** 80),
                        st.builds(lambda: HUGE), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                        st.text(min_size=500, max_size=600), st.sampled_from(["127.0.0.1", "7000", "e@127.0.0.1:1"]))
    values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5),
                                                                                               inner, max_size=4),
                          max_leaves=8)
    keys = st.sampled_from(["do_remote_decode", "do_remote_prefill", "kvt_xfer", "transfer_id", "remote_request_id",
                            "remote_engine_id", "remote_host", "remote_port", "kvt_fanout", "kvt_first_token",
                            "kvt_discover", "kvt_debug_delay", "kvt_debug_late", "kvt_debug_hold", "other"])
    params_st = st.one_of(
        st.dictionaries(keys, values, max_size=8),
        st.builds(lambda over: {**prefill_params(), **over}, st.dictionaries(keys, values, max_size=3)),
        st.builds(lambda over: {**decode_params(), **over}, st.dictionaries(keys, values, max_size=3)),
        values)
    seen = {"refused": 0, "accepted": 0}

    @hypothesis.settings(max_examples=300, deadline=None, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(params=params_st, role=st.sampled_from(["prefill", "decode", "both"]))
    def run(params: Any, role: str) -> None:
        try:
            p = parse_transfer_params(params)
        except TransferParamsError as exc:
            assert str(exc).startswith("kv_transfer_params refused: ") and len(str(exc)) < 400
            p = None
        else:
            assert p.role in (None, "prefill", "decode") and 1 <= p.fanout <= MAX_FANOUT
            for s in (p.xfer, p.remote_request_id):
                assert s is None or (isinstance(s, str) and 0 < len(s) <= MAX_PARAM_CHARS)
            assert p.side_channel is None or (isinstance(p.side_channel[0], str) and 0 < p.side_channel[1] < 65536)
        if params and not isinstance(params, dict):
            return  # vLLM's API server refuses it, and vLLM's own add_request would call .get on it
        sched = engines["get"](role)
        if p is None:
            seen["refused"] += 1
            refused_then_failed(sched, params)
            return
        seen["accepted"] += 1
        req = make_request(PROMPT, params=params, max_tokens=1)
        sched.add_request(req)
        so = sched.schedule()
        sched.update_from_output(so, runner_output([req], token=None) if req.request_id in so.num_scheduled_tokens
                                 else empty_output())
        abort_and_drain(sched, req)
        assert not sched.requests

    run()
    assert seen["refused"] > 50 and seen["accepted"] > 10, seen
