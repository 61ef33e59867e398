"""Scheduler-side tests: two real vLLM Schedulers (a prefill and a decode instance) with KVTransportConnector,
talking over the real side channel on loopback, driven by fake runner outputs (no model runs)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import trace
from vllm.v1.request import RequestStatus

from .vllm_helpers import (
    EOS,
    PrefillWorkers,
    assert_no_leaks,
    empty_output,
    make_config,
    make_request,
    make_scheduler,
    plan_of,
    runner_output,
    wait_until,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]
BS = 16


class Pair:
    """A prefill scheduler and a decode scheduler; helpers to emulate their workers."""

    def __init__(self, model: str, *, p_extra: dict | None = None, d_extra: dict | None = None,
                 policy: str = "fail", max_batched: int = 256, d_block_size: int = BS) -> None:
        self.p = make_scheduler(make_config(model, role="kv_producer", extra=p_extra, max_num_batched_tokens=max_batched))
        self.d = make_scheduler(make_config(model, role="kv_consumer", extra=d_extra, policy=policy,
                                            block_size=d_block_size), num_blocks=1000)
        self.pc = self.p.get_kv_connector()._sched
        self.dc = self.d.get_kv_connector()._sched

    @property
    def addr(self) -> dict:
        return {"remote_host": self.pc.host, "remote_port": self.pc.port, "remote_engine_id": self.pc.engine_id}

    def push_params(self, xfer: str, n: int = 1) -> tuple[dict, dict]:
        p = {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": xfer, "kvt_fanout": n}
        d = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": xfer, **self.addr}
        return p, d

    def prefill_sees_dsts(self, xfer: str, n: int = 1) -> None:
        """Drain the prefill side channel (as build_connector_meta does) until ``n`` destinations arrived."""
        def ok() -> bool:
            self.pc._drain_inbox(time.monotonic())
            src = self.pc.prefill.sources.get(xfer)
            got = len(src.dsts) if src is not None else len(self.pc.prefill.orphans.get(xfer, (0, [], 0))[1])
            return got >= n
        wait_until(ok)

    def close(self) -> None:
        self.p.shutdown()
        self.d.shutdown()


@pytest.fixture
def pair(tiny_model: str):
    made: list[Pair] = []

    def make(**kw) -> Pair:
        pr = Pair(tiny_model, **kw)
        made.append(pr)
        return pr

    yield make
    for pr in made:
        pr.close()


def _blocks(sched, req) -> set[int]:
    """The blocks ``req`` holds in ``sched`` (a failed receive's load errors, for vLLM < 0.32)."""
    return set(sched.kv_cache_manager.get_block_ids(req.request_id)[0])


def _decode_admit(pr: Pair, req, pushes_expected: bool = True) -> None:
    """Decode: schedule ``req`` into WAITING_FOR_REMOTE_KVS and return its recv plan."""
    pr.d.add_request(req)
    so = pr.d.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.request_id in plan_of(so).recv_start
    pr.d.update_from_output(so, empty_output())


def _push_first_step(pr: Pair, tag: str, prompt: list[int], *, d_block_size: int = 16) -> tuple[Any, ...]:
    """Push mode, one request under ``tag``: the decode admits it (blocks of ``d_block_size`` tokens), the prefill
    (max_tokens=1) learns its destinations and schedules once. Returns (decode request, prefill request, the
    prefill's SchedulerOutput, the prefill's block ids, the decode's block ids)."""
    pparams, dparams = pr.push_params(tag)
    dreq = make_request(prompt, params=dparams, block_size=d_block_size)
    _decode_admit(pr, dreq)
    dst_blocks = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts(tag)
    so = pr.p.schedule()
    src_blocks = pr.p.kv_cache_manager.get_block_ids(preq.request_id)[0]
    return dreq, preq, so, src_blocks, dst_blocks


def test_push_layerwise_plan_and_clean_finish(pair) -> None:
    pr = pair()
    w = PrefillWorkers()
    prompt = list(range(10, 10 + 40))  # 3 blocks, last one partial
    dreq, preq, so, src_blocks, dst_blocks = _push_first_step(pr, "x1", prompt)
    plan = plan_of(so)
    (st,) = plan.sources
    assert (st.req_id, st.xfer, st.prompt_len, st.start, st.stop, st.layerwise) == (preq.request_id, "x1", 40, 0, 40,
                                                                                     True)
    assert list(st.groups[0]) == list(src_blocks)
    (b,) = plan.binds
    assert (b.seq, b.engine, b.offset, list(b.blocks)) == (dreq.request_id, pr.dc.engine_id, 0, list(dst_blocks[:3]))
    w.run(plan)
    assert w.puts[dreq.request_id] == list(zip(src_blocks[:3], dst_blocks[:3], strict=True))
    assert w.signals == {dreq.request_id: "layerwise"}
    pr.p.update_from_output(so, runner_output([preq]))  # max_tokens=1: finished, blocks held
    assert preq.request_id in pr.p.requests
    so = pr.p.schedule()
    assert plan_of(so).send_release == [preq.request_id]
    assert not plan_of(so).binds
    pr.p.update_from_output(so, empty_output(sending={preq.request_id}))
    assert_no_leaks(pr.p)
    # decode: KV landed -> admitted with the last prompt token to compute, then decodes
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output(recving={dreq.request_id}))
    so = pr.d.schedule()
    assert so.num_scheduled_tokens == {dreq.request_id: 1}
    assert dreq.num_computed_tokens == len(prompt)  # 39 landed + the last one recomputed
    pr.d.update_from_output(so, runner_output([dreq], token=EOS))
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output())
    assert_no_leaks(pr.d)

def test_late_destination_gets_whole_push(pair) -> None:
    """The prefill runs at once; its destination comes after the forward: the workers get it with the next
    plan (the release after it) and put the whole prompt in one go."""
    pr = pair()
    w = PrefillWorkers()
    prompt = list(range(100, 120))
    pparams, dparams = pr.push_params("late")
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    assert preq.request_id in so.num_scheduled_tokens  # never held for its destination
    assert not plan_of(so).binds  # unknown yet
    src = pr.p.kv_cache_manager.get_block_ids(preq.request_id)[0]
    w.run(plan_of(so))
    pr.p.update_from_output(so, runner_output([preq]))
    assert preq.request_id in pr.p.requests  # kept for the destination
    dreq = make_request(prompt, params=dparams)
    _decode_admit(pr, dreq)
    pr.prefill_sees_dsts("late")
    so = pr.p.schedule()
    plan = plan_of(so)
    dst = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]
    (b,) = plan.binds
    assert b.seq == dreq.request_id and list(b.blocks) == list(dst[:2])
    assert plan.send_release == [preq.request_id]  # after its destination in the same plan
    w.run(plan)
    assert w.puts[dreq.request_id] == list(zip(src[:2], dst[:2], strict=True))
    assert w.signals == {dreq.request_id: "whole"}
    pr.p.update_from_output(so, empty_output())
    assert not pr.pc.prefill.sources

def test_short_prompt_and_chunked_prefill(pair) -> None:
    pr = pair(max_batched=32)
    w = PrefillWorkers()
    # shorter than a block
    pparams, dparams = pr.push_params("short")
    dreq = make_request([5, 6, 7], params=dparams)
    _decode_admit(pr, dreq)
    preq = make_request([5, 6, 7], params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("short")
    so = pr.p.schedule()
    w.run(plan_of(so))
    assert len(w.puts[dreq.request_id]) == 1 and w.signals[dreq.request_id] == "layerwise"
    pr.p.update_from_output(so, runner_output([preq]))
    # chunked: 70 tokens in 32-token chunks -> three steps; each block goes once it is complete, the last (partial)
    # one with the last chunk, and the signal after it
    pparams, dparams = pr.push_params("chunked")
    prompt = list(range(200, 270))
    dreq2 = make_request(prompt, params=dparams)
    _decode_admit(pr, dreq2)
    preq2 = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq2)
    pr.prefill_sees_dsts("chunked")
    chunks, signalled = [], []
    for step in range(3):
        so = pr.p.schedule()
        plan = plan_of(so)
        chunks += [(st.start, st.stop) for st in plan.sources if st.req_id == preq2.request_id]
        w.run(plan)
        signalled.append(dreq2.request_id in w.signals)
        reqs = [r for r in (preq2,) if r.request_id in so.num_scheduled_tokens]
        pr.p.update_from_output(so, runner_output(reqs, token=7 if step == 2 else None))
    assert chunks == [(0, 32), (32, 64), (64, 70)] and signalled == [False, False, True]
    src = pr.p.kv_cache_manager.get_block_ids(preq2.request_id)[0]
    dst = pr.d.kv_cache_manager.get_block_ids(dreq2.request_id)[0]
    assert w.puts[dreq2.request_id] == list(zip(src[:5], dst[:5], strict=True))  # 70 tokens = 5 blocks, each once

def _kv_params(engine_outputs) -> dict:
    for eco in engine_outputs.values():
        for out in eco.outputs:
            if out.kv_transfer_params:
                return out.kv_transfer_params
    raise AssertionError("no kv_transfer_params in the outputs")


def test_pull_mode_nixl_keys(pair) -> None:
    pr = pair()
    w = PrefillWorkers()
    prompt = list(range(300, 300 + 50))
    toy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}  # what vLLM's toy proxy sends
    preq = make_request(prompt, params=toy, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    assert [st.layerwise for st in plan_of(so).sources] == [False]  # pull: nothing goes from inside the forward
    w.run(plan_of(so))
    kv = _kv_params(pr.p.update_from_output(so, runner_output([preq])))
    for key in ("do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_request_id",
                "remote_host", "remote_port", "tp_size"):
        assert key in kv, key
    assert kv["do_remote_prefill"] is True and kv["remote_port"] == pr.pc.port
    assert preq.request_id in pr.p.requests  # held until pulled
    assert not w.ops
    dreq = make_request(prompt, params=kv)
    _decode_admit(pr, dreq)
    dst = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]

    def pulled() -> bool:
        so = pr.p.schedule()
        w.run(plan_of(so))
        released = plan_of(so).send_release
        pr.p.update_from_output(so, empty_output(sending=set(released)))
        return preq.request_id not in pr.p.requests
    wait_until(pulled)
    assert w.puts[dreq.request_id] == list(zip(kv["remote_block_ids"][:4], dst[:4], strict=True))
    assert w.signals == {dreq.request_id: "whole"}
    assert_no_leaks(pr.p)

def test_pull_mode_keeps_the_source_for_every_decode_child(pair) -> None:
    """Our proxy's pull mode tells the prefill the decode request's n (kvt_fanout): the source stays until
    every child pulled, so a child that asks after its sibling's pull finished still gets the KV."""
    pr = pair()
    prompt = list(range(700, 700 + 50))
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None, "kvt_fanout": 2}
    w = PrefillWorkers()
    preq = make_request(prompt, params=params, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    w.run(plan_of(so))
    kv = _kv_params(pr.p.update_from_output(so, runner_output([preq])))
    released: list = []

    def step_prefill() -> None:
        so = pr.p.schedule()
        w.run(plan_of(so))
        released.extend(plan_of(so).send_release)
        pr.p.update_from_output(so, empty_output(sending=set(plan_of(so).send_release)))

    d1 = make_request(prompt, params=kv)
    _decode_admit(pr, d1)
    wait_until(lambda: (step_prefill(), len(w.signals) == 1)[1])
    for _ in range(5):  # the first child's pull is done: the source must stay for the second
        step_prefill()
        time.sleep(0.02)
    assert not released and preq.request_id in pr.p.requests
    d2 = make_request(prompt, params=kv)
    _decode_admit(pr, d2)
    wait_until(lambda: (step_prefill(), preq.request_id not in pr.p.requests)[1])
    assert w.signals == {d1.request_id: "whole", d2.request_id: "whole"} and released == [preq.request_id]
    assert_no_leaks(pr.p)

    # children allocated in the same step ask in one message: freed once both pulled, not at the lease
    prompt = list(range(800, 800 + 50))
    preq = make_request(prompt, params=params, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    w.run(plan_of(so))
    kv = _kv_params(pr.p.update_from_output(so, runner_output([preq])))
    w.signals.clear()
    released.clear()
    d3, d4 = make_request(prompt, params=kv), make_request(prompt, params=kv)
    pr.d.add_request(d3)
    pr.d.add_request(d4)
    so = pr.d.schedule()
    assert {d3.request_id, d4.request_id} <= set(plan_of(so).recv_start)
    pr.d.update_from_output(so, empty_output())
    wait_until(lambda: (step_prefill(), preq.request_id not in pr.p.requests)[1], timeout=10)
    assert w.signals == {d3.request_id: "whole", d4.request_id: "whole"} and released == [preq.request_id]
    assert_no_leaks(pr.p)


def test_decode_partial_prefix_hit_pulls_only_the_tail(pair) -> None:
    pr = pair()
    prefix = list(range(700, 732))  # two full blocks
    d0 = make_request([*prefix, 1, 2, 3], params=None, max_tokens=1)
    pr.d.add_request(d0)  # computed locally: caches the prefix blocks on the decode side
    so = pr.d.schedule()
    pr.d.update_from_output(so, runner_output([d0], token=EOS))
    pparams, dparams = pr.push_params("tail")
    dreq = make_request(prefix + list(range(900, 920)), params=dparams)
    _decode_admit(pr, dreq)
    rec = pr.dc.decode.recvs[dreq.request_id]
    assert rec.xfer == "tail"
    preq = make_request(prefix + list(range(900, 920)), params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("tail")
    so = pr.p.schedule()
    w = PrefillWorkers()
    w.run(plan_of(so))
    src = pr.p.kv_cache_manager.get_block_ids(preq.request_id)[0]
    dst = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]
    assert plan_of(so).binds[0].offset == 2  # the decode had the first two blocks
    assert w.puts[dreq.request_id] == list(zip(src[2:4], dst[2:4], strict=True))


def test_decode_abort_while_waiting_frees_blocks(pair) -> None:
    pr = pair()
    _, dparams = pr.push_params("abort")
    dreq = make_request(list(range(40)), params=dparams)
    _decode_admit(pr, dreq)
    pr.d.finish_requests(dreq.request_id, RequestStatus.FINISHED_ABORTED)
    assert dreq.request_id in pr.d.requests  # blocks held until the worker confirms
    so = pr.d.schedule()
    assert dreq.request_id in plan_of(so).recv_abort
    pr.d.update_from_output(so, empty_output(recving={dreq.request_id}))
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output())
    assert_no_leaks(pr.d)


def test_prefill_abort_fails_decode(pair) -> None:
    pr = pair(policy="recompute")
    pparams, dparams = pr.push_params("pabort")
    prompt = list(range(500, 540))
    dreq = make_request(prompt, params=dparams)
    _decode_admit(pr, dreq)
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("pabort")
    pr.p.finish_requests(preq.request_id, RequestStatus.FINISHED_ABORTED)

    def failed() -> bool:
        so = pr.d.schedule()
        pr.d.update_from_output(so, empty_output())
        return dreq.request_id in plan_of(so).recv_fail
    wait_until(failed)
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output(failed={dreq.request_id}, failed_blocks=_blocks(pr.d, dreq)))
    so = pr.d.schedule()  # recompute policy: prefilled locally
    assert so.num_scheduled_tokens.get(dreq.request_id) == len(prompt)


def test_fanout_two_destinations(pair) -> None:
    pr = pair()
    prompt = list(range(600, 640))
    pparams, dparams = pr.push_params("fan", n=2)
    d1 = make_request(prompt, params=dparams)
    d2 = make_request(prompt, params=dparams)
    pr.d.add_request(d1)
    pr.d.add_request(d2)
    so = pr.d.schedule()
    assert set(plan_of(so).recv_start) == {d1.request_id, d2.request_id}
    pr.d.update_from_output(so, empty_output())
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("fan", n=2)
    so = pr.p.schedule()
    assert {b.seq for b in plan_of(so).binds} == {d1.request_id, d2.request_id}
    w = PrefillWorkers()
    w.run(plan_of(so))
    assert w.signals == {d1.request_id: "layerwise", d2.request_id: "layerwise"}
    pr.p.update_from_output(so, runner_output([preq]))
    so = pr.p.schedule()
    assert plan_of(so).send_release == [preq.request_id]


def test_incompatible_peer_is_refused(pair) -> None:
    """Without workers' unit layouts (no worker metadata here: the block layout) another block size cannot be
    mapped: the prefill refuses the decode at the handshake and the decode learns which field differs."""
    pr = pair(d_block_size=32)
    _, dparams = pr.push_params("incompat")
    dreq = make_request(list(range(40)), params=dparams, block_size=32)
    _decode_admit(pr, dreq)
    _wait_refused(pr, dreq, "incompatible KV caches, fields that differ: kv_cache")


def _wait_refused(pr: Pair, dreq, reason_end: str) -> None:
    """Step the decode until ``dreq``'s receive fails; its reason must end with ``reason_end``."""
    def failed() -> bool:
        so = pr.d.schedule()
        pr.d.update_from_output(so, empty_output())
        reasons = plan_of(so).recv_fail
        if dreq.request_id in reasons:
            assert reasons[dreq.request_id].endswith(reason_end)
            return True
        return False
    wait_until(failed)


def test_unlike_tp_with_a_block_layout_is_refused_at_the_handshake(pair, caplog) -> None:
    """What an MLA model gets (its 3-D latent cache keeps the block layout: no ``kv_order`` from the workers): a
    decode at another TP size is refused at the handshake, the decode's request fails naming the field, and the
    prefill's log names both sides' values."""
    pr = pair()
    pr.dc.tp_size = 2  # the decode's hello and compatibility fields as a TP2 decode's
    _, dparams = pr.push_params("mla-tp")
    dreq = make_request(list(range(40)), params=dparams)
    _decode_admit(pr, dreq)
    with caplog.at_level(logging.WARNING):
        _wait_refused(pr, dreq, "incompatible KV caches, fields that differ: kv_cache")
    assert "blocks of tp_size 1 and block_size 16 (like-for-like peers only)" in caplog.text
    assert "blocks of tp_size 2 and block_size 16 (like-for-like peers only)" in caplog.text


def test_plugin_registration_is_idempotent() -> None:
    from kvtransport_vllm.connector import KVTransportConnector
    from kvtransport_vllm.plugin import register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    assert register() is False
    assert KVConnectorFactory.get_connector_class_by_name("KVTransportConnector") is KVTransportConnector
    assert KVTransportConnector.requires_piecewise_for_cudagraph({}) is True
    assert KVTransportConnector.requires_piecewise_for_cudagraph({"mode": "pull"}) is False


def test_pull_with_n2_serves_every_decode_child_then_frees_the_family(pair) -> None:
    """vLLM's toy proxy forwards n=2 to both sides: two prefill children compute, only one child's params
    reach the decode, and both decode children pull that one. A decode child asking after its sibling's pull
    finished still gets the KV; once both asked, every prefill child is freed (not held for the lease)."""
    pr = pair()
    prompt = list(range(800, 840))
    toy = {"do_remote_decode": True, "do_remote_prefill": False}
    kids = [make_request(prompt, params=dict(toy), max_tokens=1, rid=f"{i}_cmpl-parent") for i in range(2)]
    for k in kids:
        pr.p.add_request(k)
    w = PrefillWorkers()
    so = pr.p.schedule()
    w.run(plan_of(so))
    kv = _kv_params(pr.p.update_from_output(so, runner_output(kids)))

    def step_prefill() -> None:
        so = pr.p.schedule()
        w.run(plan_of(so))
        pr.p.update_from_output(so, empty_output(sending=set(plan_of(so).send_release)))

    d0 = make_request(prompt, params=dict(kv), rid="0_cmpl-decode")
    _decode_admit(pr, d0)
    wait_until(lambda: (step_prefill(), len(w.signals) == 1)[1])
    for _ in range(5):  # the first decode child was served: the family waits for the second
        step_prefill()
        time.sleep(0.02)
    assert pr.p.requests, "the family was freed before its second child asked"
    d1 = make_request(prompt, params=dict(kv), rid="1_cmpl-decode")
    _decode_admit(pr, d1)
    wait_until(lambda: (step_prefill(), not pr.p.requests)[1])
    assert w.signals == {d0.request_id: "whole", d1.request_id: "whole"}
    assert not pr.pc.prefill.family_size and not pr.pc.prefill.family_asked  # nothing kept per family afterwards
    assert_no_leaks(pr.p)


def _spy_gauges(pr: Pair) -> dict[str, int]:
    """The decode scheduler's connector gauges as last reported to vLLM's stats collection."""
    seen: dict[str, int] = {}
    orig = pr.dc.stats_delta

    def spy() -> dict[str, int]:
        out = orig()
        seen.update({k: v for k, v in out.items() if k.startswith("recv_")})
        return out

    pr.dc.stats_delta = spy
    return seen


def _spy_counters(pr: Pair) -> dict[str, int]:
    """The prefill scheduler's connector counters, summed over vLLM's stats collection (which resets them)."""
    seen: dict[str, int] = {}
    orig = pr.pc.stats_delta

    def spy() -> dict[str, int]:
        out = orig()
        for k, v in out.items():
            if isinstance(v, int):  # counters (timings are lists)
                seen[k] = seen.get(k, 0) + v
        return out

    pr.pc.stats_delta = spy
    return seen


def test_lease_renewed_by_live_decode_then_freed_when_it_disconnects(pair) -> None:
    """A finished prefill request waiting for its destination is kept past the lease while the decode renews it
    (the decode's request waits unallocated), and freed at once when that decode's side channel closes."""
    lease = 3.0  # seconds: margins a loaded 2-core CI VM (GC pauses, unscheduled side-channel threads) keeps
    pr = pair(p_extra={"lease": lease})  # the prefill runs before its destination is known
    seen = _spy_counters(pr)
    prompt = list(range(10, 10 + 40))
    pparams, dparams = pr.push_params("x-lease")
    dreq = make_request(prompt, params=dparams)
    pr.dc.on_new_request(dreq)  # what add_request does; the decode never schedules it (no free slot, say)
    pr.dc.build_plan(None)
    wait_until(lambda: (pr.pc._drain_inbox(time.monotonic()) or "x-lease" in pr.pc.prefill.holds))
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    pr.p.update_from_output(so, runner_output([preq]))  # finished, blocks held for the decode
    end = time.monotonic() + 2.5 * lease
    while time.monotonic() < end:  # 2.5 leases: the decode's renewals (every lease/3) keep it
        pr.dc.build_plan(None)
        so = pr.p.schedule()
        assert not plan_of(so).send_release
        pr.p.update_from_output(so, empty_output())
        time.sleep(0.1)
    assert pr.pc.prefill.src_by_req[preq.request_id].holders
    for c in pr.dc.decode.clients.values():  # the decode goes away
        c.close()
    released: list[str] = []

    def freed() -> bool:
        so = pr.p.schedule()
        released.extend(plan_of(so).send_release)
        pr.p.update_from_output(so, empty_output(sending=set(plan_of(so).send_release)))
        return bool(released)

    wait_until(freed, timeout=lease / 2)  # the last renewal was < lease/3 ago: the lost side channel, not the lease
    assert released == [preq.request_id]
    assert seen == {"decode_disconnects": 1}
    assert_no_leaks(pr.p)


def test_lease_expires_without_decode(pair) -> None:
    """Blocks held for a decode that never comes are freed once the lease expires, and counted."""
    lease = 2.0  # the first schedule() below must come within it, also on a loaded CI VM
    pr = pair(p_extra={"lease": lease})  # the prefill runs before its destination is known
    seen = _spy_counters(pr)
    pparams, _ = pr.push_params("x-nobody")
    preq = make_request(list(range(10, 50)), params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    pr.p.update_from_output(so, runner_output([preq]))
    so = pr.p.schedule()
    assert not plan_of(so).send_release
    pr.p.update_from_output(so, empty_output())
    time.sleep(lease + 0.1)
    so = pr.p.schedule()
    assert plan_of(so).send_release == [preq.request_id]
    pr.p.update_from_output(so, empty_output(sending={preq.request_id}))
    assert seen == {"lease_expirations": 1}
    assert_no_leaks(pr.p)


def test_debug_hold_keeps_a_decode_request_waiting_and_renewing(pair) -> None:
    """Test-only ``debug_hold`` (used by the E2E fault tests): a decode request carrying ``kvt_debug_hold`` is never
    admitted (no block allocated) while the prefill's holders list and lease see it; other requests, and the same
    flag on an instance without the knob, are admitted as usual."""
    pr = pair(p_extra={"lease": 0.6}, d_extra={"debug_hold": True})
    _, dparams = pr.push_params("x-hold")
    held = make_request(list(range(10, 50)), params={**dparams, "kvt_debug_hold": True})
    pr.d.add_request(held)
    for _ in range(3):
        so = pr.d.schedule()
        assert held.request_id not in so.num_scheduled_tokens and not plan_of(so).recv_start
        pr.d.update_from_output(so, empty_output())
    assert held.status == RequestStatus.WAITING
    assert not pr.d.kv_cache_manager.get_block_ids(held.request_id)[0]
    wait_until(lambda: (pr.pc._drain_inbox(time.monotonic()) or pr.dc.engine_id in pr.pc.prefill.holds.get("x-hold", (0, ()))[1]))
    _, other = pr.push_params("x-other")
    _decode_admit(pr, make_request(list(range(60, 100)), params=other))
    plain = pair()  # the request flag alone does nothing
    _, dparams = plain.push_params("x-plain")
    _decode_admit(plain, make_request(list(range(10, 50)), params={**dparams, "kvt_debug_hold": True}))


def test_a_pull_for_a_freed_transfer_is_refused_without_an_engine_step(pair) -> None:
    """A decode asking for a transfer the prefill already freed gets its failure from the side channel's
    reader at once: the prefill's scheduler does not run while its engine is idle."""
    pr = pair()
    prompt = list(range(900, 950))
    toy = {"do_remote_decode": True, "do_remote_prefill": False}
    preq = make_request(prompt, params=toy, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    kv = _kv_params(pr.p.update_from_output(so, runner_output([preq])))
    d0 = make_request(prompt, params=dict(kv))
    _decode_admit(pr, d0)
    wait_until(lambda: (pr.p.update_from_output(
        so := pr.p.schedule(), empty_output(sending=set(plan_of(so).send_release))), not pr.p.requests)[1])
    assert kv["remote_request_id"] in pr.pc.prefill.gone
    late = make_request(prompt, params=dict(kv))
    _decode_admit(pr, late)  # no prefill schedule() from here on: the engine is idle
    failed: list = []

    def told() -> bool:
        so = pr.d.schedule()
        failed.extend(plan_of(so).recv_fail)
        pr.d.update_from_output(so, empty_output())
        return late.request_id in failed
    wait_until(told, timeout=10)


# ---------------------------------------------------------------------- layer-wise push by default
def _step(sched, **kw):
    so = sched.schedule()
    sched.update_from_output(so, empty_output(**kw))
    return so


def test_a_push_flow_prefill_never_waits_for_its_destination(pair) -> None:
    """A push-flow prefill request that arrives before its decode allocated is scheduled in the very first step
    (the decode is told "ready" then); its destination binds whenever it comes, here between two chunks: the
    first chunk's blocks go in one put, the rest as computed, each block once."""
    pr = pair(max_batched=32)
    w = PrefillWorkers()
    prompt = list(range(900, 960))  # 60 tokens: chunks of 32 and 28
    pparams, dparams = pr.push_params("x-now")
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    assert so.num_scheduled_tokens == {preq.request_id: 32}  # at once: no destination known
    assert not plan_of(so).binds
    w.run(plan_of(so))
    pr.p.update_from_output(so, runner_output([preq], token=None))
    dreq = make_request(prompt, params=dparams)
    _decode_admit(pr, dreq)
    pr.prefill_sees_dsts("x-now")
    so = pr.p.schedule()
    assert so.num_scheduled_tokens == {preq.request_id: 28}
    (b,) = plan_of(so).binds
    assert b.seq == dreq.request_id
    ops = w.run(plan_of(so))
    src = pr.p.kv_cache_manager.get_block_ids(preq.request_id)[0]
    dst = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]
    first = ops[0]
    assert first.layers == (0, 1) and list(first.push.dst) == list(dst[:2])  # chunk 1: every layer, one put
    assert w.puts[dreq.request_id] == list(zip(src[:4], dst[:4], strict=True)) and w.signals == {
        dreq.request_id: "layerwise"}
    assert w.planner.counts["during"] == 1
    pr.p.update_from_output(so, runner_output([preq]))
    so = _step(pr.p, sending=set())
    assert plan_of(so).send_release == [preq.request_id]

def test_dst_wait_is_accepted_and_ignored(pair, caplog) -> None:
    """An older configuration with ``dst_wait`` still starts (with a warning): the prefill never waits."""
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        pr = pair(p_extra={"dst_wait": 5})
    assert "dst_wait is no longer used" in caplog.text
    pparams, _ = pr.push_params("x-nodst")
    preq = make_request(list(range(10, 50)), params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    assert preq.request_id in so.num_scheduled_tokens
    pr.p.update_from_output(so, runner_output([preq]))

def test_decode_above_admit_below_allocates_only_when_the_prefill_is_ready(pair) -> None:
    """admit_below=0: the decode holds no block for a push-flow request until the prefill says it is about to
    compute it; then it allocates at once and the prefill still pushes layer-wise."""
    pr = pair(d_extra={"admit_below": 0})
    gauges = _spy_gauges(pr)
    prompt = list(range(1000, 1040))
    pparams, dparams = pr.push_params("x-ready")
    dreq = make_request(prompt, params=dparams)
    pr.d.add_request(dreq)
    for _ in range(3):
        so = _step(pr.d)
        assert dreq.status == RequestStatus.WAITING and not plan_of(so).recv_start
        assert pr.d.kv_cache_manager.block_pool.get_num_free_blocks() == 999  # nothing allocated for it
    assert gauges == {"recv_unallocated": 1, "recv_in_progress": 0}
    wait_until(lambda: (pr.pc._drain_inbox(time.monotonic()), "x-ready" in pr.pc.prefill.holds)[1])  # its renewal
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    w = PrefillWorkers()
    so = pr.p.schedule()
    assert preq.request_id in so.num_scheduled_tokens  # runs at once, and says "ready"
    w.run(plan_of(so))
    pr.p.update_from_output(so, runner_output([preq]))

    def admitted() -> bool:
        so = _step(pr.d)
        return dreq.request_id in plan_of(so).recv_start

    wait_until(admitted)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _step(pr.d)
    assert gauges == {"recv_unallocated": 0, "recv_in_progress": 1}

    def pushed() -> bool:
        w.run(plan_of(_step(pr.p)))
        return dreq.request_id in w.signals

    wait_until(pushed)
    assert w.signals == {dreq.request_id: "whole"}


def test_decode_waiting_for_a_dead_prefill_takes_the_failure_path(pair) -> None:
    """admit_below=0 and the prefill's side channel cannot be reached: the request is not left waiting
    unallocated for ever; it is admitted only to fail (vLLM's failure policy then applies)."""
    pr = pair(d_extra={"admit_below": 0, "connect_timeout": 1})
    _, dparams = pr.push_params("x-dead")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dparams = {**dparams, "remote_port": s.getsockname()[1]}  # nobody listens there
    dreq = make_request(list(range(60)), params=dparams)
    pr.d.add_request(dreq)
    fails: dict = {}

    def failed() -> bool:
        so = _step(pr.d)
        fails.update(plan_of(so).recv_fail)
        return dreq.request_id in fails

    wait_until(failed, timeout=15)
    assert "prefill side channel unusable" in fails[dreq.request_id]
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output(failed={dreq.request_id}, failed_blocks=_blocks(pr.d, dreq)))
    _step(pr.d)
    assert_no_leaks(pr.d)


def test_pull_abort_before_allocation_frees_the_prefill_at_once(pair) -> None:
    """Pull flow: a decode request aborted before its blocks were allocated tells the prefill, which frees the
    blocks it kept for the pull within a second (not after the 30 s lease)."""
    pr = pair()
    prompt = list(range(1100, 1150))
    toy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}
    preq = make_request(prompt, params=toy, max_tokens=1)
    pr.p.add_request(preq)
    so = pr.p.schedule()
    kv = _kv_params(pr.p.update_from_output(so, runner_output([preq])))
    assert preq.request_id in pr.p.requests
    dreq = make_request(prompt, params=kv)
    pr.d.add_request(dreq)
    pr.d.finish_requests(dreq.request_id, RequestStatus.FINISHED_ABORTED)  # before any schedule
    _step(pr.d)  # its cancel goes out with the decode's next step
    t0 = time.monotonic()
    released: list = []

    def freed() -> bool:
        so = pr.p.schedule()
        released.extend(plan_of(so).send_release)
        pr.p.update_from_output(so, empty_output(sending=set(plan_of(so).send_release)))
        return preq.request_id not in pr.p.requests

    wait_until(freed, timeout=5)
    assert time.monotonic() - t0 < 1.0 and released == [preq.request_id]
    assert_no_leaks(pr.p)
    assert_no_leaks(pr.d)


def test_only_a_layerwise_producer_asks_for_piecewise_cuda_graphs(tiny_model: str) -> None:
    """vLLM asks ``requires_piecewise_for_cudagraph(extra_config)`` while it builds the VllmConfig, without the
    role: a decode keeps full CUDA graphs, a push-mode producer (or kv_both) gets piecewise, pull mode none."""
    from kvtransport_vllm.connector import KVTransportConnector
    from vllm.config import KVTransferConfig

    class Building:  # stands for VllmConfig.__post_init__'s frame, where vLLM makes the call
        def __init__(self, role: str, extra: dict) -> None:
            self.kv_transfer_config = KVTransferConfig(
                kv_connector="KVTransportConnector", kv_connector_module_path="kvtransport_vllm.connector",
                kv_role=role, kv_connector_extra_config=extra)

        def piecewise(self) -> bool:
            return KVTransportConnector.requires_piecewise_for_cudagraph(
                self.kv_transfer_config.kv_connector_extra_config)

    assert Building("kv_consumer", {}).piecewise() is False
    assert Building("kv_producer", {}).piecewise() is True
    assert Building("kv_both", {}).piecewise() is True
    assert Building("kv_producer", {"mode": "pull"}).piecewise() is False
    assert KVTransportConnector.requires_piecewise_for_cudagraph({}) is True  # role unknown: the safe answer




def test_decode_requests_are_bound_to_the_prefill_workers_that_push_them(pair) -> None:
    """The prefill's welcome names its workers' kvtransport instance ids; the decode's plan binds each
    request it waits for to the worker of its rank (workers then ``expect`` that sender only)."""
    import kvtransport
    from kvtransport.workload.caches import CacheSpec, HostCache

    pr = pair()
    with kvtransport.open(HostCache(CacheSpec(1, 4, 1, 2, 4)).layout, backend="inproc") as cm:
        meta = cm.metadata()  # (a decode's hello carries its workers' real metadata)
    # no backend/layout fields: the compatibility hashes of both sides stay equal
    pr.pc.set_worker_metadata({0: {"instance": "prefill-worker-0", "metadata": meta}})
    pr.dc.set_worker_metadata({0: {"instance": "decode-worker-0", "metadata": meta}})
    prompt = list(range(1200, 1240))
    _, dparams = pr.push_params("bind")
    dreq = make_request(prompt, params=dparams)
    pr.d.add_request(dreq)
    bound: dict = {}

    def told() -> bool:
        so = _step(pr.d)
        bound.update(plan_of(so).recv_from)
        return dreq.request_id in bound

    wait_until(told)
    assert bound[dreq.request_id] == {0: "prefill-worker-0"}
    addr = (pr.pc.host, pr.pc.port)
    assert pr.dc.decode.prefill_senders[addr] == {0: "prefill-worker-0"}


def test_fanout_release_waits_for_every_destination(pair) -> None:
    """n=2 and the prefill runs knowing only the first destination: that one is pushed layer-wise, the prefill
    request finishes, and its blocks stay held until the second destination came and was pushed whole; only then
    is the request released."""
    pr = pair()
    w = PrefillWorkers()
    prompt = list(range(1300, 1340))
    pparams, dparams = pr.push_params("fan-late", n=2)
    d1 = make_request(prompt, params=dparams)
    _decode_admit(pr, d1)
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("fan-late", n=1)
    so = pr.p.schedule()
    assert [b.seq for b in plan_of(so).binds] == [d1.request_id]
    w.run(plan_of(so))
    pr.p.update_from_output(so, runner_output([preq]))  # finished: held for the second destination
    for _ in range(3):
        so = _step(pr.p)
        w.run(plan_of(so))
        assert preq.request_id not in plan_of(so).send_release, "released before the second destination came"
        assert preq.request_id in pr.p.requests
    d2 = make_request(prompt, params=dparams)
    _decode_admit(pr, d2)
    released: list = []

    def served() -> bool:
        so = _step(pr.p)
        w.run(plan_of(so))
        released.extend(plan_of(so).send_release)
        return preq.request_id in released

    wait_until(served)
    assert w.signals == {d1.request_id: "layerwise", d2.request_id: "whole"}


def test_first_token_flow_continues_the_decode_from_the_prefills_token(pair, tmp_path) -> None:
    """Splitwise's order: the prefill samples the first token; the decode gets it over the side channel,
    appends it to its prompt (the model runner reads it from there), computes only its KV and samples the second
    token, and reports both to its API server in its first output. Its workers may report the KV landed only
    once the token is there. Traced: the step that first schedules it records ``d.scheduled`` once."""
    trace.configure(str(tmp_path / "trace"), "decode-scheduler")
    try:
        rid, before, after = _first_token_flow(pair)
    finally:
        trace.configure(None, "")
    scheduled = [r for r in trace.load(tmp_path / "trace") if r["ev"] == "d.scheduled"]
    assert [r["key"] for r in scheduled] == [rid]  # once, in the step that scheduled its first forward
    assert before <= scheduled[0]["t"] <= after


def _first_token_flow(pair) -> tuple[str, float, float]:
    """The flow of the test above; returns the decode request's id and the bounds of the step that first
    scheduled it."""
    pr = pair()
    prompt = list(range(10, 10 + 40))  # 3 blocks of 16, the last one partial
    pparams, dparams = pr.push_params("ft")
    pparams["kvt_first_token"] = dparams["kvt_first_token"] = True
    dreq = make_request(prompt, params=dparams, max_tokens=3)
    pr.d.add_request(dreq)
    so = pr.d.schedule()
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    plan = plan_of(so)
    assert plan.recv_hold == {dreq.request_id} and not plan.recv_release
    pr.d.update_from_output(so, empty_output())
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("ft")
    so = pr.p.schedule()
    assert [b.seq for b in plan_of(so).binds] == [dreq.request_id]
    pr.p.update_from_output(so, runner_output([preq], token=77))  # the first token: 77
    # the decode scheduler receives it, appends it to the prompt and releases the held receive
    def released() -> bool:
        so = pr.d.schedule()
        ok = dreq.request_id in plan_of(so).recv_release
        pr.d.update_from_output(so, empty_output(recving={dreq.request_id} if ok else None))
        return ok
    wait_until(released)
    assert list(dreq.prompt_token_ids) == [*prompt, 77] and dreq.num_prompt_tokens == 41
    assert list(dreq.all_token_ids) == [*prompt, 77] and dreq.num_output_tokens == 0
    before = time.monotonic()
    so = pr.d.schedule()
    after = time.monotonic()
    assert so.num_scheduled_tokens == {dreq.request_id: 1}  # only the first token's KV: the prompt landed
    assert dreq.num_computed_tokens == len(prompt) + 1  # 40 landed + the first token, scheduled
    (new,) = so.scheduled_new_reqs
    assert list(new.prompt_token_ids) == [*prompt, 77]  # the model runner reads the token from the prompt
    outs = pr.d.update_from_output(so, runner_output([dreq], token=88))
    assert list(dreq.output_token_ids) == [88]
    # the API server gets #1 with #2 (its detokenizer starts from the client's prompt): text as a single instance's
    (out,) = [o for eco in outs.values() for o in eco.outputs if o.request_id == dreq.request_id]
    assert list(out.new_token_ids) == [77, 88]
    so = pr.d.schedule()
    outs = pr.d.update_from_output(so, runner_output([dreq], token=EOS))
    (out,) = [o for eco in outs.values() for o in eco.outputs if o.request_id == dreq.request_id]
    assert list(out.new_token_ids) == [EOS]  # once
    return dreq.request_id, before, after


def test_first_token_flow_with_a_partial_prefix_hit_and_an_early_token(pair) -> None:
    """A decode that holds part of the prompt in its own cache receives only the rest; a first token that comes
    before the decode allocated (here: queued with the request) is appended all the same, and the decode then
    computes only that token."""
    pr = pair()
    prompt = list(range(300, 332))  # exactly 2 full blocks
    warm = make_request(prompt, max_tokens=1)  # fills the decode's prefix cache with this prompt
    pr.d.add_request(warm)
    so = pr.d.schedule()
    pr.d.update_from_output(so, runner_output([warm]))
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output())
    pparams, dparams = pr.push_params("cached")
    pparams["kvt_first_token"] = dparams["kvt_first_token"] = True
    dreq = make_request(prompt, params=dparams, max_tokens=3)
    pr.d.add_request(dreq)
    pr.dc.inbox.put(("first", (pr.pc.host, pr.pc.port), "cached", 55))  # the token is there before allocation
    so = pr.d.schedule()
    plan = plan_of(so)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert dreq.request_id in plan.recv_hold and dreq.request_id in plan.recv_release  # held and released at once
    assert list(dreq.prompt_token_ids) == [*prompt, 55]
    pr.d.update_from_output(so, empty_output())
    preq = make_request(prompt, params=pparams, max_tokens=1)
    pr.p.add_request(preq)
    pr.prefill_sees_dsts("cached")
    so = pr.p.schedule()
    w = PrefillWorkers()
    w.run(plan_of(so))
    assert len(w.puts[dreq.request_id]) == 1  # the block the decode did not have
    pr.p.update_from_output(so, runner_output([preq], token=55))
    so = pr.d.schedule()
    pr.d.update_from_output(so, empty_output(recving={dreq.request_id}))
    so = pr.d.schedule()
    assert so.num_scheduled_tokens == {dreq.request_id: 1}
    pr.d.update_from_output(so, runner_output([dreq], token=9))
    assert list(dreq.prompt_token_ids) == [*prompt, 55] and list(dreq.output_token_ids) == [9]


def test_unlike_block_size_is_pushed_as_token_ranges(pair) -> None:
    """Both sides' workers hold unit layouts (``kv_order``): a decode with another block size is accepted, told
    to the workers with its geometry, and its KV planned as token ranges over each side's own blocks."""
    import kvtransport
    from kvtransport.workload.caches import CacheSpec, HostCache

    pr = pair(d_block_size=32)
    with kvtransport.open(HostCache(CacheSpec(1, 4, 1, 2, 4)).layout, backend="inproc") as cm:
        meta = cm.metadata()
    pr.pc.set_worker_metadata({0: {"instance": "p-w0", "metadata": meta, "kv_order": "HN"}})
    pr.dc.set_worker_metadata({0: {"instance": "d-w0", "metadata": meta, "kv_order": "HN"}})
    prompt = list(range(2000, 2040))
    _, preq, so, src_blocks, dst_blocks = _push_first_step(pr, "unlike", prompt, d_block_size=32)
    plan = plan_of(so)
    assert plan.peer_geometry == {pr.dc.engine_id: {"tp_size": 1, "block_size": 32, "kv_order": "HN"}}
    w = PrefillWorkers(unlike=plan.peer_geometry)
    ops = w.run(plan)
    push = ops[0].push  # layer 0, as the forward computed it
    assert ops[0].layers == (0,) and [type(o).__name__ for o in ops] == ["PutOp", "PutOp", "SignalOp"]
    assert (push.start, push.stop, push.src_first, push.dst_first) == (0, 40, 0, 0)
    assert list(push.src) == list(src_blocks[:3]) and list(push.dst) == list(dst_blocks[:2])
    pr.p.update_from_output(so, runner_output([preq]))
    so = pr.p.schedule()
    assert plan_of(so).send_release == [preq.request_id]
    pr.p.update_from_output(so, empty_output(sending={preq.request_id}))
    assert_no_leaks(pr.p)


def test_pipeline_and_context_parallel_are_refused_with_our_message(tiny_model: str) -> None:
    from kvtransport_vllm.connector import check_parallel

    cfg = make_config(tiny_model, role="kv_producer")
    check_parallel(cfg)  # PP=1 passes
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match=r"does not support pipeline parallelism \(pipeline_parallel_size=2\): run "
                                         r"the prefill and decode instances with pipeline_parallel_size=1"):
        check_parallel(cfg)
    cfg.parallel_config.pipeline_parallel_size = 1
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        setattr(cfg.parallel_config, name, 2)
        with pytest.raises(ValueError, match=rf"does not support context parallelism \({name}=2\): .* run the prefill "
                                             rf"and decode instances with {name}=1"):
            check_parallel(cfg)
        setattr(cfg.parallel_config, name, 1)
    check_parallel(cfg)


def test_compatibility_still_refuses_model_dtype_and_head_size(tiny_model: str) -> None:
    """TP size and block size left the hashed fields; dtype, head size and the model stay, named when they differ."""
    from kvtransport_vllm.connector import _compat_fields
    from kvtransport_vllm.protocol import compat_hash, describe_mismatch

    a = _compat_fields(make_config(tiny_model, role="kv_producer"), None)
    b = _compat_fields(make_config(tiny_model, role="kv_consumer", block_size=32), None)
    assert "tp_size" not in a and "block_size" not in a and compat_hash(a) == compat_hash(b)
    assert (a["dtype"], a["head_size"], a["num_kv_heads"]) == ("float32", 64, 2)
    for key, other in (("dtype", "bfloat16"), ("head_size", 128), ("model", "other-model")):
        c = {**a, key: other}
        assert compat_hash(c) != compat_hash(a)
        assert describe_mismatch(a, c) == f"{key}: ours={a[key]!r} peer={other!r}"


def test_kv_cache_groups_the_connector_cannot_move_are_refused_by_name() -> None:
    from types import SimpleNamespace

    import torch
    from kvtransport_vllm.connector import check_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=48)
    cfg = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=window, layer_names=["l0", "l2"]),
                                           SimpleNamespace(kv_cache_spec=full, layer_names=["l1"])])
    assert check_groups(cfg) == {"l0": 0, "l2": 0, "l1": 1}
    assert check_groups(None) == {}
    from vllm.v1.kv_cache_interface import MLAAttentionSpec  # DeepSeek-class latent caches move as whole blocks

    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    assert check_groups(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=mla, layer_names=["a", "b"])])) \
        == {"a": 0, "b": 0}

    class MambaSpec:  # stands for vLLM's (only its name and block size are read)
        block_size = 16

    cfg.kv_cache_groups.append(SimpleNamespace(kv_cache_spec=MambaSpec(), layer_names=["m3"]))
    with pytest.raises(ValueError, match=r"cannot move KV cache group 2 \(MambaSpec, layers \['m3'\]\): it moves full"
                                         r", sliding-window and MLA attention KV only; Mamba/SSM state is not supported"):
        check_groups(cfg)


def test_a_decodes_new_blocks_go_out_before_its_idle_wait(pair, monkeypatch) -> None:
    """A decode waiting for one request's first token waits (IDLE_INBOX_WAIT_S) for side-channel events in idle
    steps; the blocks it allocated in that same step go to the prefill first, not after the wait."""
    import threading

    from kvtransport_vllm import scheduler as sched_mod

    pr = pair()
    _, dparams = pr.push_params("waits-first")
    dparams["kvt_first_token"] = True
    _decode_admit(pr, make_request(list(range(3000, 3040)), params=dparams))  # waits for its first token
    monkeypatch.setattr(sched_mod, "IDLE_INBOX_WAIT_S", 3.0)
    _, dparams = pr.push_params("new-blocks")
    dreq = make_request(list(range(3100, 3140)), params=dparams)
    pr.d.add_request(dreq)
    out: list = []
    stepping = threading.Thread(target=lambda: out.append(pr.d.schedule()))
    t0 = time.monotonic()
    stepping.start()
    pr.prefill_sees_dsts("new-blocks")
    seen = time.monotonic() - t0
    stepping.join(10)
    took = time.monotonic() - t0
    assert seen < 2.0 <= took, (seen, took)  # the blocks were at the prefill while the decode still waited
    assert dreq.request_id in plan_of(out[0]).recv_start


def test_each_data_parallel_engine_gets_its_own_side_channel_port(tiny_model: str) -> None:
    """Issue 28: a fixed side_channel_port is a base, DP engine r listens on base + r (two DP engines of one
    instance on one host collided on the base); 0 (any free port) stays 0. Both shapes vLLM gives an engine:
    a MoE model's (data_parallel_size and _rank kept) and a dense model's (independent DP=1 engines: size 1,
    rank 0, the rank only in data_parallel_index, ``_dp<rank>`` on the engine id). A bootstrap endpoint is refused
    only where no engine could be pinned (the hybrid and external balancers with a dense model)."""
    import dataclasses

    from kvtransport_vllm.config import resolve_settings
    from kvtransport_vllm.connector import dp_position, dp_route, per_dp_engine

    cfg = make_config(tiny_model, role="kv_producer")
    base = resolve_settings({"side_channel_port": 7000}, env={})
    assert per_dp_engine(base, cfg, "e").side_channel_port == 7000
    assert dp_position(cfg, "e") == (0, 1) and dp_route(cfg, "e") == (0, 1)
    pc = cfg.parallel_config
    for shape in ("moe", "dense"):
        for rank in range(4):
            pc.data_parallel_size, pc.data_parallel_rank = (4, rank) if shape == "moe" else (1, 0)
            pc.data_parallel_index = rank
            engine = f"e_dp{rank}"
            assert per_dp_engine(base, cfg, engine).side_channel_port == 7000 + rank, (shape, rank)
            assert dp_position(cfg, engine) == (rank, 4 if shape == "moe" else 0), (shape, rank)
            assert dp_route(cfg, engine) == (rank, 4 if shape == "moe" else 0), (shape, rank)
        assert per_dp_engine(resolve_settings({}, env={}), cfg, engine).side_channel_port == 0
        with pytest.raises(ValueError, match=r"past 65535"):
            per_dp_engine(dataclasses.replace(base, side_channel_port=65534), cfg, engine)
        # the internal balancer: DP engine 0 serves the bootstrap endpoint for every engine (bootstrap.DPRegistry)
        boot = resolve_settings({"bootstrap_port": 8998}, env={})
        assert per_dp_engine(boot, cfg, "e_dp0").bootstrap_port == 8998
    # the hybrid and external balancers front a node's engines: no header without a known local count
    pc.data_parallel_hybrid_lb = True
    assert dp_route(cfg, "e_dp3") == (0, 1)  # dense: the local count is unknown
    with pytest.raises(ValueError, match=r"bootstrap endpoint \(bootstrap_port=8998\) maps DP ranks to engines .* "
                                         r"--data-parallel-hybrid-lb or --data-parallel-external-lb"):
        per_dp_engine(boot, cfg, "e_dp3")
    pc.data_parallel_size, pc.data_parallel_rank, pc.data_parallel_size_local = 4, 3, 2
    assert dp_route(cfg, "e_dp3") == (1, 2)  # MoE: rank 3 is the second of its node's two engines
    assert per_dp_engine(boot, cfg, "e_dp3").bootstrap_port == 8998


# ---------------------------------------------------------------- the decode's own bookkeeping, exactly (issue 32)
class _Link:
    """A stand-in for a PeerClient the decode holds: counts its closes, never dead."""

    dead = False

    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def _recording_client(made: list[Any]) -> type:
    """A PeerClient stand-in class whose instances record their constructor's arguments (``args``, ``kw``) and
    what is sent through them (``sent``), each appended to ``made`` when built."""

    class Recording(_Link):
        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__()
            self.args, self.kw, self.sent = args, kw, []
            made.append(self)

        def send(self, msg: Any) -> bool:
            self.sent.append(msg)
            return True

    return Recording


def _forgot(c: Any, rid: str) -> list[str]:
    """What the decode role still holds for ``rid`` (each name an entry a leak would keep)."""
    held = {"recvs": c.recvs, "wanted": c.wanted, "arrived": c.arrived, "doomed": c.doomed,
            "first_waits": c.first_waits, "consumed": c.consumed, "_recv_start": c._recv_start}
    return [name for name, d in held.items() if rid in d]


def test_an_aborted_receive_is_cancelled_once_at_its_prefill_and_forgotten(pair) -> None:
    """A decode request aborted while its KV is on the way: exactly one cancel naming it goes to its prefill, its
    workers are told to abort it, and the decode role keeps nothing of it (a kept ``wanted`` entry would renew
    the prefill's lease for ever)."""
    pr = pair()
    c = pr.dc.decode
    _, dparams = pr.push_params("ab1")
    dreq = make_request(list(range(10, 50)), params=dparams)
    _decode_admit(pr, dreq)
    rid, addr = dreq.request_id, (pr.pc.host, pr.pc.port)
    assert _forgot(c, rid) == ["recvs", "wanted", "consumed"] and not c._outgoing.get(addr)
    pr.d.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert dict(c._outgoing) == {addr: [{"type": "cancel", "xfer": "ab1", "seqs": [rid], "count": 0}]}
    assert c._recv_abort == [rid] and _forgot(c, rid) == []
    so = pr.d.schedule()
    assert plan_of(so).recv_abort == [rid] and not c._outgoing.get(addr)


@pytest.mark.parametrize("flow", ["push", "pull"])
def test_a_request_aborted_before_its_blocks_were_allocated_releases_its_prefill(pair, flow: str) -> None:
    """Never allocated: the prefill is told not to wait for (push) or hold (pull) one destination, in the flow's
    mode, after the lease the request took on arrival; nothing of it stays."""
    pr = pair()
    c = pr.dc.decode
    _, dparams = pr.push_params("nb1")
    if flow == "pull":
        del dparams["kvt_xfer"]
        dparams["remote_request_id"] = "nb1"
    dreq = make_request(list(range(10, 50)), params=dparams)
    pr.d.add_request(dreq)
    rid, addr = dreq.request_id, (pr.pc.host, pr.pc.port)
    pr.d.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
    assert dict(c._outgoing) == {addr: [{"type": "renew", "xfers": ["nb1"]},
                                        {"type": "cancel", "xfer": "nb1", "seqs": [], "count": 1, "mode": flow}]}
    assert _forgot(c, rid) == [] and c._recv_abort == []


def test_a_finished_request_of_another_role_sends_nothing(pair) -> None:
    """A prefill-role request (its transfer named, no side channel to a prefill) finishing in a decode role (a
    ``kv_both`` engine sees both) is not the decode's: no message, to no address."""
    pr = pair()
    c = pr.dc.decode
    pparams, _ = pr.push_params("pr1")
    c.request_finished(make_request(list(range(10, 50)), params=pparams))
    assert dict(c._outgoing) == {}


def test_a_late_destination_of_an_aborted_request_is_dropped_and_the_others_kept(pair) -> None:
    """Test-only ``debug_dst_delay`` holds destinations back; an abort drops the aborted request's only."""
    pr = pair(d_extra={"debug_dst_delay": 30})
    c = pr.dc.decode
    reqs = []
    for tag in ("late1", "late2"):
        _, dparams = pr.push_params(tag)
        dparams["kvt_debug_late"] = True
        reqs.append(make_request(list(range(10, 50)), params=dparams))
        _decode_admit(pr, reqs[-1])
    assert [x[2]["dsts"][0]["seq"] for x in c._late] == [r.request_id for r in reqs]
    pr.d.finish_requests(reqs[0].request_id, RequestStatus.FINISHED_ABORTED)
    assert [x[2]["dsts"][0]["seq"] for x in c._late] == [reqs[1].request_id]


def test_the_first_token_goes_to_the_waiting_requests_of_its_transfer_and_prefill_only(pair, tmp_path) -> None:
    """``_first_token_arrived``: of the requests waiting for a first token, those of that transfer and that
    prefill, not applied yet, still waiting (not scheduled, no output, the prompt as it came) get it appended;
    the others are left as they are, wherever they stand in the list. Each applied one is counted once, handed
    to the API server's emitter unless it asked for logprobs, and traced."""
    from kvtransport_vllm.compat import first_token_emitter
    from kvtransport_vllm.consumer import FirstWait

    pr = pair()
    c = pr.dc.decode
    addr, prompt = ("127.0.0.1", 1), list(range(10, 50))

    def wait(xfer: str, at: tuple[str, int], *, status: Any = RequestStatus.WAITING_FOR_REMOTE_KVS,
             output: bool = False, logprobs: int | None = None, applied: bool = False, plen: int = 40) -> Any:
        req = make_request(prompt)
        req.status = status
        if output:
            req.append_output_token_ids(5)
        req.sampling_params.logprobs = logprobs
        c.first_waits[req.request_id] = FirstWait(req, xfer, at, plen, applied)
        return req

    skipped = [wait("y", addr), wait("x", ("127.0.0.1", 2)), wait("x", addr, applied=True),
               wait("x", addr, status=RequestStatus.RUNNING), wait("x", addr, output=True),
               wait("x", addr, plen=39)]
    taken = [wait("x", addr, status=RequestStatus.WAITING), wait("x", addr), wait("x", addr, logprobs=2)]
    before = c.counters["first_tokens_received"]
    trace.configure(str(tmp_path / "trace"), "decode-scheduler")
    try:
        c._first_token_arrived(addr, "x", 77)
    finally:
        trace.configure(None, "")
    try:
        assert [list(r.prompt_token_ids) for r in taken] == [[*prompt, 77]] * 3
        assert [r.num_prompt_tokens for r in taken] == [41] * 3
        assert [list(r.prompt_token_ids) for r in skipped] == [prompt] * 6
        assert [c.first_waits[r.request_id].applied for r in skipped + taken] == [False, False, True, False, False,
                                                                                  False, True, True, True]
        assert c.counters["first_tokens_received"] == before + 3
        assert c._first_ready == {r.request_id for r in taken}
        assert {r: first_token_emitter.pending.get(r.request_id) for r in skipped + taken} == {
            **{r: None for r in skipped}, taken[0]: 77, taken[1]: 77, taken[2]: None}
        rows = [(r["ev"], r["key"], r.get("seq")) for r in trace.load(tmp_path / "trace")]
        assert rows == [("d.first", "x", r.request_id) for r in taken]
    finally:
        for r in skipped + taken:
            first_token_emitter.discard(r.request_id)


def test_a_prompt_token_appended_to_a_mixed_prompt_is_marked_a_token() -> None:
    """vLLM 0.32+ marks each prompt position a token id or an embedding (``prompt_is_token_ids``): the first
    token appended is a token id."""
    from kvtransport_vllm.consumer import append_prompt_token

    req = make_request(list(range(10, 50)))
    req.prompt_is_token_ids = [True] * 39 + [False]
    append_prompt_token(req, 77)
    assert req.prompt_is_token_ids == [True] * 39 + [False, True]
    assert list(req.prompt_token_ids)[-1] == 77 and req.num_prompt_tokens == 41
    plain = make_request(list(range(10, 50)))
    append_prompt_token(plain, 77)
    assert plain.prompt_is_token_ids is None


def test_tracing_the_first_schedule_takes_an_output_without_new_requests(pair) -> None:
    from types import SimpleNamespace

    pr = pair()
    pr.dc.decode._reported["r"] = None
    pr.dc.decode.trace_scheduled(SimpleNamespace())  # (an output object of another shape: nothing scheduled)
    assert list(pr.dc.decode._reported) == ["r"]


def test_landed_receives_are_forgotten_and_traced_within_a_bound(pair, tmp_path, monkeypatch) -> None:
    """The workers' report of landed receives: those requests leave the decode's receive, lease and first-token
    books (the others stay); traced, the newest TRACED_REPORTED wait for their first schedule, the oldest go."""
    from kvtransport_vllm import consumer as consumer_mod
    from kvtransport_vllm.consumer import FirstWait, Receive

    monkeypatch.setattr(consumer_mod, "TRACED_REPORTED", 2)
    c = pair().dc.decode
    addr = ("127.0.0.1", 1)
    for rid in ("a", "b", "c", "keep"):
        c.recvs[rid] = Receive(rid, "x", addr, 0.0)
        c.wanted[rid] = ("x", addr)
        c.first_waits[rid] = FirstWait(None, "x", addr, 40)
    trace.configure(str(tmp_path / "trace"), "decode-scheduler")
    try:
        c.landed({"a"})
        c.landed({"b"})
        c.landed({"c"})
    finally:
        trace.configure(None, "")
    assert (list(c.recvs), list(c.wanted), list(c.first_waits)) == (["keep"], ["keep"], ["keep"])
    assert list(c._reported) == ["b", "c"]


def test_a_prefills_worker_links_go_with_it_and_no_other(pair) -> None:
    """A prefill that went away takes its workers' destination channels (closed, forgotten, their retry
    timers too) with it; another prefill's stay."""
    c = pair().dc.decode

    gone, stays = ("10.0.0.1", 5), ("10.0.0.2", 6)
    links = {(*gone, 0): _Link(), (*gone, 1): _Link(), (*stays, 0): _Link()}
    c.worker_at = {gone: {0: ("10.0.0.1", 7)}, stays: {0: ("10.0.0.2", 8)}}
    c.worker_links = dict(links)
    c._link_retry = {(*gone, 0): 1.0, (*stays, 0): 2.0}  # rank 1 of the gone prefill has no retry timer
    c._drop_worker_links(gone)
    assert list(c.worker_at) == [stays] and list(c.worker_links) == [(*stays, 0)]
    assert [link.closed for link in links.values()] == [1, 1, 0]
    assert c._link_retry == {(*stays, 0): 2.0}


class _Blocks:
    """vLLM's KVCacheBlocks as ``new_blocks`` reads it: every group's ids, and the unhashed (new) ones."""

    def __init__(self, groups: list[list[int]], unhashed: list[list[int]]) -> None:
        self.groups, self.unhashed = groups, unhashed

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(self.groups)

    def get_unhashed_block_ids(self) -> list[int]:
        return list(self.unhashed[0])

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return self.unhashed


def _decode_role(pair, tag: str, *, flow: str = "push", late: bool = False, **d_extra: Any) -> tuple[Any, Any, Any]:
    """(the decode role, a decode request of transfer ``tag``, its prefill's address); nothing queued yet."""
    pr = pair(d_extra=d_extra or None)
    _, dparams = pr.push_params(tag)
    if flow == "pull":
        del dparams["kvt_xfer"]
        dparams["remote_request_id"] = tag
    if late:
        dparams["kvt_debug_late"] = True
    return pr.dc.decode, make_request(list(range(10, 74)), params=dparams), (pr.pc.host, pr.pc.port)


@pytest.mark.parametrize("flow, groups, unhashed, dst_groups", [
    ("push", [[3, 4, 5, 6]], [[5, 6]], None),
    ("pull", [[3, 4, 5, 6]], [[5, 6]], None),
    ("push", [[3, 4, 5, 6], [0, 0, 7, 8]], [[5, 6], [7, 8]], [[7, 8]]),  # hybrid: the sliding window's too
])
def test_an_allocation_queues_its_destination_and_plans_its_workers_exactly(pair, tmp_path, flow: str,
                                                                            groups: Any, unhashed: Any,
                                                                            dst_groups: Any) -> None:
    """The blocks vLLM just allocated (the new ones: past the prefix it found) go to the prefill in one ``dst``
    message in the flow's mode; the workers' plan gets the receive's timeout, blocks and senders; traced."""
    c, req, addr = _decode_role(pair, "al1", flow=flow)
    rid = req.request_id
    c.prefill_senders[addr] = {0: "inst0"}
    trace.configure(str(tmp_path / "trace"), "decode-scheduler")
    try:
        c.update_state_after_alloc(req, _Blocks(groups, unhashed), 32)  # (no on_new_request: nothing assumed)
    finally:
        trace.configure(None, "")
    dst: dict[str, Any] = {"seq": rid, "blocks": [5, 6], "offset": 2}
    if dst_groups:
        dst["groups"] = dst_groups
    assert dict(c._outgoing) == {addr: [{"type": "dst", "xfer": "al1", "mode": flow, "dsts": [dst]}]}
    rec = c.recvs[rid]
    assert (rec.req_id, rec.xfer, rec.addr, type(rec.started)) == (rid, "al1", addr, float)
    assert (c._recv_start, c._recv_blocks, c._recv_from) == ({rid: c.settings.transfer_timeout}, {rid: [5, 6]},
                                                             {rid: {0: "inst0"}})
    assert rid in c.consumed and c._late == [] and c._recv_fail == {}
    assert [(r["ev"], r["key"], r.get("seq")) for r in trace.load(tmp_path / "trace")] == [("d.alloc", "al1", rid)]
    c._outgoing.clear()
    c.update_state_after_alloc(req, _Blocks(groups, unhashed), 32)  # once consumed, a second call does nothing
    assert dict(c._outgoing) == {}


@pytest.mark.parametrize("external", [0, 1])
def test_a_request_found_locally_tells_its_prefill_not_to_wait(pair, external: int) -> None:
    """No token to receive: one ``cancel`` (count 1), no receive. One token to receive is a receive."""
    c, req, addr = _decode_role(pair, "loc1")
    c.update_state_after_alloc(req, _Blocks([[3, 4, 5, 6]], [[6]] if external else [[]]), external)
    if external:
        assert [m["type"] for m in c._outgoing[addr]] == ["dst"] and req.request_id in c.recvs
    else:
        assert dict(c._outgoing) == {addr: [{"type": "cancel", "xfer": "loc1", "seqs": [], "count": 1,
                                             "mode": "push"}]}
        assert req.request_id not in c.recvs and req.request_id in c.consumed


def test_a_doomed_request_is_allocated_only_to_fail(pair) -> None:
    """Its KV cannot come: the prefill is told not to wait, the workers fail the receive with the reason, the
    lease is dropped, and no destination goes out."""
    from kvtransport_vllm.metadata import Failure, FailureKind

    c, req, addr = _decode_role(pair, "doom1")
    c.on_new_request(req)
    c._outgoing.clear()
    why = Failure(FailureKind.ADMISSION_TIMEOUT, "for the test")
    c.doomed[req.request_id] = why
    c.update_state_after_alloc(req, _Blocks([[3, 4, 5, 6]], [[5, 6]]), 32)
    assert dict(c._outgoing) == {addr: [{"type": "cancel", "xfer": "doom1", "seqs": [], "count": 1,
                                         "mode": "push"}]}
    assert c._recv_fail == {req.request_id: why} and req.request_id in c.recvs
    assert req.request_id not in c.wanted and req.request_id not in c.doomed


@pytest.mark.parametrize("delay, late, held", [(0.0, True, False), (0.5, True, True), (0.5, False, False)])
def test_only_a_flagged_request_under_a_dst_delay_is_held_back(pair, delay: float, late: bool, held: bool) -> None:
    """Test-only ``debug_dst_delay`` holds back the destination of a request flagged ``kvt_debug_late``, until
    ``delay`` from now; any other goes at once."""
    c, req, addr = _decode_role(pair, "dl1", late=late, debug_dst_delay=delay)
    t0 = time.monotonic()
    c.update_state_after_alloc(req, _Blocks([[3, 4, 5, 6]], [[5, 6]]), 32)
    assert [m["type"] for m in c._outgoing.get(addr, [])] == ([] if held else ["dst"])
    assert len(c._late) == held
    if held:
        due, at, msg = c._late[0]
        assert t0 + delay <= due <= time.monotonic() + delay and at == addr and msg["dsts"][0]["seq"] == req.request_id


def test_matched_tokens_claim_the_prompt_once_admitted_and_wait_for_a_first_token(pair) -> None:
    """``get_num_new_matched_tokens``: the remote KV covers the prompt as the client sent it (a first-token
    request's is one token shorter than its prompt once #1 is appended); a request that continues from its
    prefill's first token waits for it even when its prompt was found locally, unless doomed."""
    from kvtransport_vllm.consumer import FirstWait
    from kvtransport_vllm.metadata import Failure, FailureKind

    c, req, addr = _decode_role(pair, "mt1")
    rid = req.request_id
    assert c.get_num_new_matched_tokens(req, 0) == (64, True)
    assert c.get_num_new_matched_tokens(req, 63) == (1, True)
    assert c.get_num_new_matched_tokens(req, 64) == (0, False)
    first = c.first_waits[rid] = FirstWait(req, "mt1", addr, 63)  # #1 appended: the client's prompt was 63
    assert c.get_num_new_matched_tokens(req, 0) == (63, True)
    assert c.get_num_new_matched_tokens(req, 63) == (None, False)  # found locally: wait for the first token
    c.doomed[rid] = Failure(FailureKind.ADMISSION_TIMEOUT, "x")
    assert c.get_num_new_matched_tokens(req, 63) == (0, False)
    del c.doomed[rid]
    first.applied = True
    assert c.get_num_new_matched_tokens(req, 63) == (0, False)
    c.consumed.add(rid)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)


def test_matched_tokens_of_an_unadmitted_or_held_request_are_none(pair) -> None:
    c, req, _ = _decode_role(pair, "mt2", admit_below=0)  # a full cache: only a ready prefill admits it
    c.on_new_request(req)
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    c.ready_xfers["mt2"] = time.monotonic()
    assert c.get_num_new_matched_tokens(req, 0) == (64, True)
    c2, held, _ = _decode_role(pair, "mt3", debug_hold=True)
    held.kv_transfer_params["kvt_debug_hold"] = True
    assert c2.get_num_new_matched_tokens(held, 0) == (None, False)


def test_admission_waits_for_the_prefill_then_dooms_on_a_dead_channel_or_past_the_timeout(pair, monkeypatch) -> None:
    """``_admit_now`` with a full cache: admitted once the prefill says it is ready (even if that news comes
    while the side channel is drained), doomed with its kind and reason when the prefill's channel is dead or the
    transfer timeout passed (not at it)."""
    from types import SimpleNamespace

    from kvtransport_vllm import consumer as consumer_mod
    from kvtransport_vllm.metadata import Failure, FailureKind, parse_transfer_params

    c, req, addr = _decode_role(pair, "ad1", admit_below=0)
    rid, params = req.request_id, parse_transfer_params(req.kv_transfer_params)
    now = [1000.0]
    monkeypatch.setattr(consumer_mod.time, "monotonic", lambda: now[0])
    c.arrived[rid] = now[0] - c.settings.transfer_timeout  # at the timeout, not past it
    assert c._admit_now(rid, params) is False and rid not in c.doomed
    monkeypatch.setattr(c, "drain_inbox", lambda t: c.ready_xfers.setdefault("ad1", t))
    assert c._admit_now(rid, params) is True and c.ready_xfers["ad1"] == 1000.0
    del c.ready_xfers["ad1"]
    monkeypatch.setattr(c, "drain_inbox", lambda t: None)
    now[0] += 0.001  # past the timeout
    assert c._admit_now(rid, params) is True
    assert c.doomed.pop(rid) == Failure(
        FailureKind.ADMISSION_TIMEOUT, f"the prefill did not start transfer ad1 within {c.settings.transfer_timeout:g}s "
        "(admit_below: this decode waited for its go-ahead)")
    c.clients[addr] = SimpleNamespace(dead=True, error="reset by peer")
    assert c._admit_now(rid, params) is True
    assert c.doomed.pop(rid) == Failure(FailureKind.SIDE_CHANNEL_UNUSABLE,
                                        "prefill side channel unusable: reset by peer")
    del c.arrived[rid], c.clients[addr]  # never seen arriving: not timed out
    assert c._admit_now(rid, params) is False and rid not in c.doomed


def test_the_cache_usage_read_for_admission(pair) -> None:
    from types import SimpleNamespace

    pr = pair()
    c = pr.dc.decode
    assert c.block_pool is pr.d.kv_cache_manager.block_pool  # vLLM's own, bound through the scheduler side
    c.block_pool = None
    assert c._kv_usage() == 0.0
    c.block_pool = SimpleNamespace(get_usage=lambda: 0.75)
    assert c._kv_usage() == 0.75
    c.block_pool = SimpleNamespace()  # no get_usage: treated as empty
    assert c._kv_usage() == 0.0


def test_worker_links_open_once_and_reopen_a_dead_one_only_after_the_retry_time(pair, monkeypatch) -> None:
    """Links to a prefill's workers' destination channels: opened on first use with the decode's secret (``worker``
    links), kept; a dead one is reopened no sooner than WORKER_LINK_RETRY_S after the last try, and meanwhile the
    other ranks' links are still used."""
    import dataclasses

    from kvtransport_vllm import consumer as consumer_mod

    made: list[Any] = []

    monkeypatch.setattr(consumer_mod, "PeerClient", _recording_client(made))
    now = [0.5]
    monkeypatch.setattr(consumer_mod.time, "monotonic", lambda: now[0])
    c = pair().dc.decode
    c.settings = dataclasses.replace(c.settings, secret=b"s" * 32)
    addr = ("10.0.0.1", 5)
    c.worker_at[addr] = {0: ("10.0.0.1", 7), 1: ("10.0.0.1", 8)}
    first = c._worker_links(addr)
    assert first == made and [(m.args[:2], m.kw) for m in made] == [
        (("10.0.0.1", 7), {"secret": b"s" * 32, "worker": True}), (("10.0.0.1", 8), {"secret": b"s" * 32, "worker": True})]
    assert made[0].args[2:] == (c.hello, c.compat, c.inbox, c.settings.connect_timeout)
    retry = 0.5 + consumer_mod.WORKER_LINK_RETRY_S
    assert c._link_retry == {("10.0.0.1", 5, 0): retry, ("10.0.0.1", 5, 1): retry}
    assert c._worker_links(addr) == first and len(made) == 2  # kept
    made[0].dead = True
    now[0] = retry - 0.001
    assert c._worker_links(addr) == [made[1]] and len(made) == 2  # rank 0 waits, rank 1 still used
    now[0] = retry
    assert c._worker_links(addr) == [made[2], made[1]] and made[2].args[:2] == ("10.0.0.1", 7)
    assert c._link_retry[("10.0.0.1", 5, 0)] == retry + consumer_mod.WORKER_LINK_RETRY_S


def test_a_lost_prefill_fails_its_receives_dooms_its_unallocated_requests_and_drops_its_links(pair) -> None:
    """``lost``: that prefill's receives fail (PREFILL_LOST, with the reason; an earlier failure stays), its
    requests not allocated yet are doomed, its workers and their links are forgotten; another prefill's stay."""
    from kvtransport_vllm.consumer import Receive
    from kvtransport_vllm.metadata import Failure, FailureKind

    c = pair().dc.decode
    a, b = ("10.0.0.1", 5), ("10.0.0.2", 6)
    refused = Failure(FailureKind.REFUSED, "earlier")
    c.recvs.update({"r1": Receive("r1", "x1", a, 0.0), "r2": Receive("r2", "x2", a, 0.0), "r3": Receive("r3", "x3", b, 0.0)})
    c._recv_fail["r2"] = refused
    c.wanted.update({"r1": ("x1", a), "r3": ("x3", b), "w4": ("x4", a), "w5": ("x5", a), "w6": ("x6", b)})
    c.consumed.add("w5")  # allocated already (found locally): not doomed
    c.prefill_senders.update({a: {0: "pa"}, b: {0: "pb"}})
    c.worker_at.update({a: {0: ("10.0.0.1", 7)}, b: {0: ("10.0.0.2", 8)}})
    c.on_event(("lost", list(a), "reset"), time.monotonic())
    lost = Failure(FailureKind.PREFILL_LOST, "prefill lost: reset")
    assert c._recv_fail == {"r2": refused, "r1": lost}
    assert sorted(c.wanted) == ["r3", "w4", "w5", "w6"] and c.doomed == {"w4": lost}
    assert c.prefill_senders == {b: {0: "pb"}} and list(c.worker_at) == [b]


def test_a_refused_transfer_fails_only_a_receive_in_progress(pair) -> None:
    from kvtransport_vllm.consumer import Receive
    from kvtransport_vllm.metadata import Failure, FailureKind

    c = pair().dc.decode
    c.recvs["r1"] = Receive("r1", "x1", ("h", 1), 0.0)
    c.wanted.update({"r1": ("x1", ("h", 1)), "w2": ("x2", ("h", 1))})
    c.on_event(("fail", "r1", "no room"), time.monotonic())
    c.on_event(("fail", "w2", "no room"), time.monotonic())  # not receiving: nothing to fail
    assert c._recv_fail == {"r1": Failure(FailureKind.REFUSED, "no room")} and list(c.wanted) == ["w2"]


@pytest.mark.parametrize("groups, unhashed, expect", [
    ([[3, 4, 5, 6]], [[5, 6]], (2, [5, 6], [])),
    ([[3, 4, 5, 6]], [[]], (4, [], [])),
    ([[3, 4, 5, 6], [0, 0, 7, 8]], [[5, 6], [7, 8]], (2, [5, 6], [[7, 8]])),
    ([[3, 4, 5, 6], [0, 0, 0, 8], [0, 9, 10, 11]], [[5, 6], [8], [10, 11]], (2, [5, 6], [[0, 8], [10, 11]])),
    ([[0, 0, 5, 6], [3, 4, 7, 8]], [[5, 6], [4, 7, 8]], (1, [0, 5, 6], [[4, 7, 8]])),  # group 0 a sliding window
])
def test_new_blocks_are_the_trailing_ones_of_every_group(groups: Any, unhashed: Any, expect: Any) -> None:
    """A hybrid model's groups cover the same token blocks; the new ones are the most any group has unhashed (a
    sliding window's skipped blocks are the null block, not in its unhashed list), aligned in every group."""
    from kvtransport_vllm.consumer import new_blocks

    assert new_blocks(_Blocks(groups, unhashed)) == expect


def test_a_request_awaits_its_first_token_only_while_allocated_and_not_applied(pair) -> None:
    from kvtransport_vllm.consumer import FirstWait, Receive

    c = pair().dc.decode
    req = make_request(list(range(10, 50)))
    first = c.first_waits[req.request_id] = FirstWait(req, "x", ("h", 1), 40)
    assert c.awaits_first_token() is False  # not allocated yet
    c.recvs[req.request_id] = Receive(req.request_id, "x", ("h", 1), 0.0)
    assert c.awaits_first_token() is True
    first.applied = True
    assert c.awaits_first_token() is False


def test_an_aborted_first_token_request_is_forgotten_everywhere(pair) -> None:
    """Aborted between its allocation and its plan (direct calls), with a first token on its way to the API server
    and a doom recorded: nothing of it stays, the emitter's entry included."""
    from kvtransport_vllm.compat import first_token_emitter
    from kvtransport_vllm.consumer import FirstWait
    from kvtransport_vllm.metadata import Failure, FailureKind

    c, req, addr = _decode_role(pair, "fa1")
    rid = req.request_id
    c.first_waits[rid] = FirstWait(req, "fa1", addr, 64)
    c.update_state_after_alloc(req, _Blocks([[3, 4, 5, 6]], [[5, 6]]), 32)
    c.doomed[rid] = Failure(FailureKind.ADMISSION_TIMEOUT, "x")
    first_token_emitter.add(rid, 77)
    try:
        c.request_finished(req)
        assert _forgot(c, rid) == [] and rid not in first_token_emitter.pending
    finally:
        first_token_emitter.discard(rid)


@pytest.mark.parametrize("arrived", [True, False])
def test_a_doomed_request_with_one_token_to_receive_fails_and_keeps_no_lease(pair, arrived: bool) -> None:
    from kvtransport_vllm.metadata import Failure, FailureKind

    c, req, _ = _decode_role(pair, "doom2")
    if arrived:
        c.on_new_request(req)
    c.doomed[req.request_id] = why = Failure(FailureKind.PREFILL_LOST, "gone")
    c.update_state_after_alloc(req, _Blocks([[3, 4, 5, 6]], [[6]]), 1)
    assert c._recv_fail == {req.request_id: why} and req.request_id not in c.wanted


def test_a_first_token_reaches_a_request_without_sampling_params(pair) -> None:
    """A request whose sampling params are None (as a pooling request's are) still gets its first token."""
    from kvtransport_vllm.compat import first_token_emitter
    from kvtransport_vllm.consumer import FirstWait

    c = pair().dc.decode
    req = make_request(list(range(10, 50)))
    req.sampling_params = None
    c.first_waits[req.request_id] = FirstWait(req, "x", ("h", 1), 40)
    try:
        c._first_token_arrived(("h", 1), "x", 77)
        assert list(req.prompt_token_ids)[-1] == 77 and first_token_emitter.pending.get(req.request_id) == 77
    finally:
        first_token_emitter.discard(req.request_id)


def test_a_prompt_token_appended_to_a_request_of_an_older_vllm() -> None:
    """vLLM before 0.32 has no ``prompt_is_token_ids``: nothing else is read."""
    from types import SimpleNamespace

    from kvtransport_vllm.consumer import append_prompt_token

    hashed: list[int] = []
    req = SimpleNamespace(prompt_token_ids=[1, 2], _all_token_ids=[1, 2], num_prompt_tokens=2,
                          update_block_hashes=lambda: hashed.append(1))
    append_prompt_token(req, 77)
    assert (req.prompt_token_ids, req._all_token_ids, req.num_prompt_tokens, hashed) == ([1, 2, 77], [1, 2, 77], 3, [1])


def test_leases_are_renewed_every_third_of_the_lease(pair) -> None:
    c = pair().dc.decode
    addr = ("h", 1)
    c.wanted.update({"r1": ("x1", addr), "r2": ("x2", addr)})
    lease = c.settings.lease
    c._last_renew = 100.0
    c._renew(100.0 + lease / 3 - 0.001)
    assert dict(c._outgoing) == {}
    c._renew(100.0 + lease / 3)
    assert dict(c._outgoing) == {addr: [{"type": "renew", "xfers": ["x1", "x2"]}]}
    assert c._last_renew == 100.0 + lease / 3


def test_events_about_what_is_gone_already_change_nothing_and_raise_nothing(pair) -> None:
    """A refusal or loss for a receive whose lease went already (doomed at allocation), a second ``lost`` for the
    same prefill, a re-welcome of its workers (the old links go)."""
    from kvtransport_vllm.consumer import Receive

    c = pair().dc.decode
    a = ("10.0.0.1", 5)
    c.recvs["r"] = Receive("r", "x", a, 0.0)  # no wanted entry (doomed at allocation)
    c.on_event(("fail", "r", "no"), 0.0)
    del c._recv_fail["r"]
    c.on_event(("lost", list(a), "reset"), 0.0)
    c.on_event(("lost", list(a), "reset"), 0.0)  # its senders and links are gone already
    assert list(c._recv_fail) == ["r"]

    old = c.worker_links[(*a, 0)] = _Link()
    c.on_event(("workers", list(a), {0: ("10.0.0.1", 9)}), 0.0)
    assert old.closed == 1 and (*a, 0) not in c.worker_links and c.worker_at[a] == {0: ("10.0.0.1", 9)}


def test_go_aheads_are_remembered_within_a_bound_oldest_first(pair) -> None:
    c = pair().dc.decode
    c.on_event(("ready", ("h", 1), [f"x{i}" for i in range(4097)]), 5.0)
    assert len(c.ready_xfers) == 4096 and "x0" not in c.ready_xfers and c.ready_xfers["x4096"] == 5.0


def test_a_late_destination_goes_out_when_it_is_due_not_before(pair, monkeypatch) -> None:
    from kvtransport_vllm.metadata import StepPlan

    c = pair().dc.decode
    sent: list[Any] = []
    monkeypatch.setattr(c, "_flush_outgoing", lambda: sent.extend(c._outgoing.items()) or c._outgoing.clear())
    msg = {"type": "dst", "xfer": "x", "mode": "push", "dsts": []}
    c._late = [(10.0, ("h", 1), msg), (10.5, ("h", 1), msg)]
    c.plan_step(StepPlan(), 10.0)
    assert sent == [(("h", 1), [msg])] and [t for t, _, _ in c._late] == [10.5]


def test_queued_messages_go_to_the_prefills_channel_with_the_secret_and_to_its_workers_only_with_a_dst(
        pair, monkeypatch) -> None:
    """``_flush_outgoing``: the prefill's side channel is opened with the decode's secret; the workers' channels
    are opened only for destination messages (a lease renewal alone opens none)."""
    import dataclasses

    from kvtransport_vllm import consumer as consumer_mod

    made: list[Any] = []

    monkeypatch.setattr(consumer_mod, "PeerClient", _recording_client(made))
    c = pair().dc.decode
    c.settings = dataclasses.replace(c.settings, secret=b"s" * 32)
    addr = ("10.0.0.1", 5)
    c.worker_at[addr] = {0: ("10.0.0.1", 7)}
    c._outgoing[addr].append({"type": "renew", "xfers": ["x"]})
    c._flush_outgoing()
    assert [(m.args[:2], m.kw, m.sent) for m in made] == [(addr, {"secret": b"s" * 32}, [{"type": "renew",
                                                                                           "xfers": ["x"]}])]
    dst = {"type": "dst", "xfer": "x", "mode": "push", "dsts": [{"seq": "r", "blocks": [1], "offset": 0}]}
    c._outgoing[addr].append(dst)
    c._flush_outgoing()
    assert [(m.args[:2], m.sent[-1]) for m in made] == [(addr, dst), (("10.0.0.1", 7), dst)]


def test_a_new_request_takes_a_lease_only_when_it_names_a_prefill(pair, tmp_path) -> None:
    """``on_new_request``: a decode request renews its transfer's lease at once and is traced (``d.new``); a
    request of the prefill role (a ``kv_both`` engine's: its transfer, no prefill to name) takes none."""
    pr = pair()
    c = pr.dc.decode
    pparams, dparams = pr.push_params("nr1")
    other = make_request(list(range(10, 50)), params=pparams)
    req = make_request(list(range(10, 50)), params=dparams)
    trace.configure(str(tmp_path / "trace"), "decode-scheduler")
    try:
        c.on_new_request(other)
        c.on_new_request(req)
    finally:
        trace.configure(None, "")
    addr = (pr.pc.host, pr.pc.port)
    assert dict(c._outgoing) == {addr: [{"type": "renew", "xfers": ["nr1"]}]}
    assert list(c.wanted) == [req.request_id] and list(c.arrived) == [req.request_id]
    rows = [(r["ev"], r["key"], r.get("seq")) for r in trace.load(tmp_path / "trace")]
    assert rows == [("d.new", "nr1", req.request_id)]
