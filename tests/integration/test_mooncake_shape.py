"""The ``kv_transfer_params`` shape the ecosystem's routers already speak for concurrent dispatch: Mooncake's
(``transfer_id`` on both legs; the decode's ``remote_bootstrap_addr`` and ``remote_engine_id`` read from the
prefill's ``GET /query``). The prefill serves that endpoint (``bootstrap_port``); its engine id there carries the
side channel's address, so the push flow runs unchanged behind vllm-router ``--kv-connector mooncake`` or llm-d's
sidecar. Real vLLM schedulers and side channels, no model."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm.metadata import push_transfer_id, side_channel_of

from .test_scheduler_connector import Pair, _decode_admit
from .vllm_helpers import (
    PrefillWorkers,
    assert_no_leaks,
    empty_output,
    make_request,
    plan_of,
    runner_output,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


@pytest.fixture
def pair(tiny_model: str):
    made: list[Pair] = []

    def make(**kw) -> Pair:  # type: ignore[no-untyped-def]
        pr = Pair(tiny_model, **kw)
        made.append(pr)
        return pr

    yield make
    for pr in made:
        pr.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_params_are_read_and_bounded() -> None:
    assert push_transfer_id({"kvt_xfer": "a", "transfer_id": "b"}) == "a"
    assert push_transfer_id({"transfer_id": "xfer-1"}) == "xfer-1"
    assert push_transfer_id({"transfer_id": 7}) == "7"
    for bad in ({}, None, {"transfer_id": ""}, {"transfer_id": True}, {"transfer_id": "x" * 513},
                {"transfer_id": ["x"]}, {"remote_request_id": "pull"}):
        assert push_transfer_id(bad) is None, bad
    assert side_channel_of({"remote_host": "10.0.0.5", "remote_port": 7000}) == ("10.0.0.5", 7000)
    assert side_channel_of({"remote_engine_id": "eng-1@10.0.0.5:7000"}) == ("10.0.0.5", 7000)
    assert side_channel_of({"remote_engine_id": "a@b@::1:7000"}) == ("::1", 7000)
    for bad in ({"remote_engine_id": "eng-1"}, {"remote_engine_id": "e@host:0"}, {"remote_engine_id": "e@host:x"},
                {"remote_engine_id": "e@:7000"}, {"remote_engine_id": "e@host:70000"}, {"remote_host": "h"},
                {"remote_host": "h", "remote_port": True}, {"remote_host": "h", "remote_port": 1.5},
                {"remote_host": ["h"], "remote_port": 1}, {"remote_engine_id": f"e@{'h' * 300}:1"}):
        assert side_channel_of(bad) is None, bad


def test_a_mooncake_shaped_pair_pushes_through_the_bootstrap_endpoint(pair) -> None:
    bport = free_port()
    pr = pair(p_extra={"bootstrap_port": bport})
    w = PrefillWorkers()
    with urllib.request.urlopen(f"http://{pr.pc.host}:{bport}/query", timeout=10) as r:
        answer = json.loads(r.read())
    engine = f"{pr.pc.engine_id}@{pr.pc.host}:{pr.pc.port}"
    assert answer == {"0": {"engine_id": engine, "worker_addr": {"0": {"0": f"{pr.pc.host}:{pr.pc.port}"}}}}
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{pr.pc.host}:{bport}/register", timeout=10)
    assert err.value.code == 404
    prompt = list(range(500, 540))
    # as vllm-router (mooncake) sends them: the prefill leg first, answered, then the decode leg
    preq = make_request(prompt, params={"do_remote_decode": True, "do_remote_prefill": False,
                                        "transfer_id": "xfer-mc-1"}, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    (st,) = plan_of(so).sources
    assert st.xfer == "xfer-mc-1" and st.layerwise
    w.run(plan_of(so))
    pr.p.update_from_output(so, runner_output([preq]))
    assert preq.request_id in pr.p.requests  # held for its decode
    dreq = make_request(prompt, params={"do_remote_prefill": True, "do_remote_decode": False,
                                        "transfer_id": "xfer-mc-1", "remote_bootstrap_addr": f"http://127.0.0.1:{bport}",
                                        "remote_engine_id": answer["0"]["engine_id"]})
    _decode_admit(pr, dreq)
    released: list[str] = []

    def served() -> bool:
        so = pr.p.schedule()
        w.run(plan_of(so))
        released.extend(plan_of(so).send_release)
        pr.p.update_from_output(so, empty_output(sending=set(plan_of(so).send_release)))
        return preq.request_id in released

    wait_until(served)
    dst = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]
    assert w.signals == {dreq.request_id: "whole"} and [d for _, d in w.puts[dreq.request_id]] == list(dst[:3])
    assert_no_leaks(pr.p)


def test_parallel_sampling_children_share_one_transfer(pair) -> None:
    """A router that sends the client's n to the prefill (children ``0_<id>``, ``1_<id>``) with one transfer id:
    the first child serves both decode children, the second holds no block."""
    pr = pair(p_extra={"bootstrap_port": free_port()})
    w = PrefillWorkers()
    prompt = list(range(600, 640))
    params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-n2"}
    kids = [make_request(prompt, params=dict(params), max_tokens=1, rid=f"{i}_cmpl-fam") for i in range(2)]
    for k in kids:
        pr.p.add_request(k)
    so = pr.p.schedule()
    assert [st.req_id for st in plan_of(so).sources] == [kids[0].request_id]  # the sibling is not tracked
    w.run(plan_of(so))
    pr.p.update_from_output(so, runner_output(kids))
    assert kids[0].request_id in pr.p.requests and kids[1].request_id not in pr.p.requests
    engine = f"{pr.pc.engine_id}@{pr.pc.host}:{pr.pc.port}"
    dparams = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": "xfer-n2",
               "remote_bootstrap_addr": "http://127.0.0.1:1", "remote_engine_id": engine}
    dkids = [make_request(prompt, params=dict(dparams), rid=f"{i}_cmpl-dec") for i in range(2)]
    for d in dkids:
        _decode_admit(pr, d)
    released: list[str] = []

    def served() -> bool:
        so = pr.p.schedule()
        w.run(plan_of(so))
        released.extend(plan_of(so).send_release)
        pr.p.update_from_output(so, empty_output(sending=set(plan_of(so).send_release)))
        return bool(released)

    wait_until(served)
    assert released == [kids[0].request_id]
    assert w.signals == {d.request_id: "whole" for d in dkids}
    assert_no_leaks(pr.p)


def test_a_taken_bootstrap_port_fails_the_start(pair) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError):
            pair(p_extra={"bootstrap_port": s.getsockname()[1]})
