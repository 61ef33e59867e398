"""Worker-side tests: a prefill WorkerSide pushes into a decode WorkerSide over the real nccl backend (gloo on
host memory), with vLLM-shaped KV caches (one int8 buffer, per-layer [blocks, heads, block, 2*head] views in
the HND order the CPU backend uses). Checks bytes, completion reports, timeouts and aborts, and late binding:
destinations that come with the plan or straight over the worker's destination channel, before, during or
after the forward."""

from __future__ import annotations

import queue
import socket
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm.config import resolve_settings  # noqa: E402
from kvtransport_vllm.metadata import Bind, SourceStep, StepPlan  # noqa: E402
from kvtransport_vllm.worker import TransferResults, WorkerSide  # noqa: E402

from kvtransport import wire  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

LAYERS, BLOCKS, HEADS, BS, HEAD = 3, 64, 2, 16, 8
BLOCK_BYTES = HEADS * BS * 2 * HEAD * 4  # one block of one layer (float32)


def vllm_like_cache(seed: int | None) -> dict[str, torch.Tensor]:
    """One backing buffer; per-layer float32 views [num_blocks, heads, block_size, 2*head_size]."""
    per_layer = BLOCKS * HEADS * BS * 2 * HEAD
    buf = torch.zeros(LAYERS * per_layer * 4, dtype=torch.int8)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        buf.view(torch.float32).copy_(torch.randn(LAYERS * per_layer, generator=g))
    flat = buf.view(torch.float32)
    return {f"model.layers.{i}.self_attn.attn": flat[i * per_layer:(i + 1) * per_layer].view(BLOCKS, HEADS, BS, 2 * HEAD)
            for i in range(LAYERS)}


def worker(cache: dict[str, torch.Tensor], **extra) -> WorkerSide:
    w = WorkerSide(settings=resolve_settings({"backend": "nccl", "connect_timeout": 20, **extra}), engine_id="e",
                   block_size=BS)
    w.register_kv_caches(cache)
    return w


@pytest.fixture
def pd():
    src, dst = vllm_like_cache(1), vllm_like_cache(None)
    p, d = worker(src), worker(dst, transfer_timeout=60)
    yield p, d, src, dst
    p.shutdown()
    d.shutdown()


def poll(w: WorkerSide, what: str, rid: str, timeout: float = 30, sender: WorkerSide | None = None) -> TransferResults:
    """Until ``rid`` is in ``w``'s ``what``; with ``sender``, fails as soon as that prefill worker reports a push
    failure (the scheduler would tell the decode, which this harness has not)."""
    deadline = time.monotonic() + timeout
    seen = TransferResults(set(), set(), set())
    while time.monotonic() < deadline:
        if sender is not None and sender.pusher is not None:  # a peek: the test's own polls still see everything
            with sender.pusher.lock:
                sent_fails = [*sender._pending_send_failures, *sender.pusher.failures]
            assert not sent_fails, [(f.seq, f.reason) for f in sent_fails]
        r = w.transfer_results()
        seen.finished_sending |= r.finished_sending
        seen.finished_recving |= r.finished_recving
        seen.failed_recving |= r.failed_recving
        if rid in getattr(seen, what):
            return seen
        time.sleep(0.01)
    raise AssertionError(f"{rid} not in {what} after {timeout}s: {seen}")


def step(p: WorkerSide, plan: StepPlan, cache: dict[str, torch.Tensor]) -> None:
    """One prefill engine step: bind, the forward calls save_kv_layer per layer, then wait_for_save."""
    p.bind(plan)
    for name, t in cache.items():
        p.save_kv_layer(name, t)
    p.wait_for_save()


def source(req: str, blocks: tuple[int, ...], start: int = 0, stop: int | None = None,
           prompt_len: int | None = None, xfer: str | None = None, **kw) -> SourceStep:
    """Prefill request ``req`` (transfer ``xfer``, default the same id) computing tokens [start, stop) of a prompt
    held in ``blocks`` (default: the whole prompt, which fills every block)."""
    plen = prompt_len if prompt_len is not None else len(blocks) * BS
    return SourceStep(req, xfer or req, plen, (blocks,), start, plen if stop is None else stop, **kw)


def dest(xfer: str, seq: str, blocks: tuple[int, ...], engine: str = "D", offset: int = 0) -> Bind:
    return Bind(xfer, engine, seq, blocks, offset)


def test_layerwise_push_lands_and_releases(pd) -> None:
    p, d, src, dst = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"dreq": 60}))
    s_ids, d_ids = (3, 4, 5, 9), (40, 41, 7, 8)
    step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("preq", s_ids)], binds=[dest("preq", "dreq", d_ids)]), src)
    r = poll(d, "finished_recving", "dreq", sender=p)
    assert "dreq" not in r.failed_recving
    for name in src:
        for s, t in zip(s_ids, d_ids, strict=True):
            assert torch.equal(src[name][s], dst[name][t])
        assert dst[name][0].abs().sum() == 0  # untouched
    p.bind(StepPlan(send_release=["preq"]))  # a step without a forward: vLLM calls no wait_for_save
    poll(p, "finished_sending", "preq")
    ps, ds = p.stats_delta(), d.stats_delta()
    assert ps["bytes_sent"] == ds["bytes_received"] == 4 * LAYERS * HEADS * BS * 2 * HEAD * 4
    assert ps["transfers_layerwise"] == 1 and ds["transfers_received"] == 1 and ps["backend"] == ["nccl"]
    assert (ps["dst_bound_before"], ps["dst_bound_during"], ps["dst_bound_after"]) == (1, 0, 0)
    assert ps["puts"] == ds["puts_received"] == LAYERS  # one put per layer, as the forward reached it


def test_chunked_then_whole_push(pd) -> None:
    """A prompt in two chunks whose first ends inside block 2: that block goes with the second chunk, once; a
    destination that comes after the forward gets the whole prompt in one put per layer set."""
    p, d, src, dst = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"a": 60, "b": 60}))
    plen = 3 * BS - 5
    step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("p1", (1, 2, 3), 0, BS + 5, plen)],
                     binds=[dest("p1", "a", (11, 12, 13))]), src)
    time.sleep(0.2)
    assert "a" not in d.transfer_results().finished_recving
    assert p.cm.stats()["bytes_sent"] == LAYERS * BLOCK_BYTES  # block 1 only: block 2 is not complete yet
    step(p, StepPlan(sources=[source("p1", (1, 2, 3), BS + 5, plen, plen)]), src)
    poll(d, "finished_recving", "a", sender=p)
    # destination known only after the forward: one put of the whole prompt
    step(p, StepPlan(sources=[source("p2", (20, 21))]), src)
    p.bind(StepPlan(binds=[dest("p2", "b", (30, 31))]))
    poll(d, "finished_recving", "b", sender=p)
    for name in src:
        for s_, t in ((1, 11), (2, 12), (3, 13), (20, 30), (21, 31)):
            assert torch.equal(src[name][s_], dst[name][t])
    ps = p.stats_delta()
    assert ps["bytes_sent"] == 5 * LAYERS * BLOCK_BYTES  # every block of every layer once
    assert (ps["transfers_layerwise"], ps["transfers_whole"]) == (1, 1)
    assert (ps["dst_bound_before"], ps["dst_bound_after"]) == (1, 1)


def test_a_destination_bound_mid_forward_over_the_direct_channel(pd) -> None:
    """The decode's blocks reach the worker straight over its destination channel (no plan carries them) while
    the forward is between layer 0 and layer 1: layer 0 goes at once in one put, the others as they come; every
    block of every layer is written once and the request lands."""
    from kvtransport_vllm.protocol import PROTOCOL_VERSION
    from kvtransport_vllm.sidechannel import PeerClient

    p, d, src, dst = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"mid": 60}))
    names = list(src)
    host, port = p.handshake()["dst_at"]
    hello = {"type": "hello", "version": PROTOCOL_VERSION, "engine_id": "D", "compat": "x", "tp_size": 1,
             "workers": {}}
    inbox: queue.Queue = queue.Queue()
    link = PeerClient(host, port, lambda: hello, lambda: ("x", {}), inbox, 10, worker=True)
    try:
        p.bind(StepPlan(peers={"D": {0: meta}}, sources=[source("pm", (4, 5, 6))]))
        p.save_kv_layer(names[0], src[names[0]])  # layer 0 computed: no destination yet
        link.send({"type": "dst", "xfer": "pm", "mode": "push", "dsts": [{"seq": "mid", "blocks": [50, 51, 52],
                                                                           "offset": 0}]})
        deadline = time.monotonic() + 20
        while p.pusher.planner.counts["during"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.pusher.planner.counts["during"] == 1, p.pusher.planner.counts
        for name in names[1:]:
            p.save_kv_layer(name, src[name])
        p.wait_for_save()
        poll(d, "finished_recving", "mid", sender=p)
        for name in src:
            for s_, t in ((4, 50), (5, 51), (6, 52)):
                assert torch.equal(src[name][s_], dst[name][t])
        assert p.cm.stats()["bytes_sent"] == d.cm.stats()["bytes_received"] == 3 * LAYERS * BLOCK_BYTES
    finally:
        link.close()


def test_timeout_and_abort_take_the_failure_path(pd) -> None:
    _, d, _, _ = pd
    d.bind(StepPlan(recv_start={"late": 0.2, "gone": 60}))
    r = poll(d, "failed_recving", "late")
    assert "late" in r.finished_recving  # failed receives are finished too (vLLM's contract)
    d.bind(StepPlan(recv_abort=["gone"]))
    r = poll(d, "finished_recving", "gone")
    assert "gone" not in r.failed_recving
    d.bind(StepPlan(recv_start={"refused": 60}))
    d.bind(StepPlan(recv_fail={"refused": "prefill aborted"}))
    poll(d, "failed_recving", "refused")


def test_unknown_peer_reports_send_failure(pd) -> None:
    p, _, src, _ = pd
    step(p, StepPlan(sources=[source("px", (1,))], binds=[dest("px", "sx", (1,), engine="nobody")]), src)
    deadline = time.monotonic() + 10
    fails = []
    while not fails and time.monotonic() < deadline:
        p.transfer_results()
        fails = p.take_send_failures()
        time.sleep(0.01)
    assert fails and fails[0].seq == "sx" and "nobody" in fails[0].reason


def test_a_blackholed_decode_does_not_delay_another_decodes_push() -> None:
    """Connects run per destination, off the pusher thread: a decode that accepts TCP and never answers holds
    its own pushes (until connect_timeout fails them), not those to a live decode."""
    src, dst = vllm_like_cache(1), vllm_like_cache(None)
    p, d = worker(src, connect_timeout=5), worker(dst, transfer_timeout=60)
    try:
        live = d.handshake()["metadata"]
        d.bind(StepPlan(recv_start={"warm": 60, "live": 60}))
        step(p, StepPlan(peers={"LIVE": {0: live}}, sources=[source("p0", (1,))],
                         binds=[dest("p0", "warm", (1,), engine="LIVE")]), src)
        poll(d, "finished_recving", "warm")  # the live link exists: what follows measures only the push
        with socket.create_server(("127.0.0.1", 0)) as hole:  # the kernel completes TCP; nobody ever answers
            dead = wire.encode_metadata({**wire.decode_metadata(live), "instance": "blackhole",
                                         "port": hole.getsockname()[1]})
            t0 = time.monotonic()
            step(p, StepPlan(peers={"DEAD": {0: dead}}, sources=[source("p1", (1, 2)), source("p2", (3, 4))],
                             binds=[dest("p1", "to-dead", (1, 2), engine="DEAD"),
                                    dest("p2", "live", (5, 6), engine="LIVE")]), src)
            poll(d, "finished_recving", "live", timeout=20)
            assert time.monotonic() - t0 < 1.0, "the live decode's push waited for the dead decode's connect"
            deadline = time.monotonic() + 20
            fails = []
            while not fails and time.monotonic() < deadline:  # the dead one's backlog fails at connect_timeout
                p.transfer_results()
                fails = p.take_send_failures()
                time.sleep(0.05)
            assert [(f.seq, f.engine) for f in fails] == [("to-dead", "DEAD")]
        for name in src:
            assert torch.equal(src[name][3], dst[name][5]) and torch.equal(src[name][4], dst[name][6])
    finally:
        p.shutdown()
        d.shutdown()


def test_debug_delay_holds_back_one_signal_without_blocking_others(pd) -> None:
    """Test-only ``debug_push_delay``: the delayed request's final signal (and its release) waits, while a request
    pushed after it lands at once."""
    p, d, src, _ = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"slow": 60, "fast": 60}))
    step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("ps", (1,), delay=4.0)],
                     binds=[dest("ps", "slow", (11,))]), src)
    t0 = time.monotonic()
    step(p, StepPlan(sources=[source("pf", (2,))]), src)
    p.bind(StepPlan(binds=[dest("pf", "fast", (12,))]))
    seen = poll(d, "finished_recving", "fast", sender=p)
    step(p, StepPlan(send_release=["ps", "pf"]), src)
    sent = poll(p, "finished_sending", "pf")
    # "fast" landed and was released while "slow" still waits for its delayed signal: nothing queued behind
    # it. (No wall-clock bound here: the first connect to D is inside this span and takes seconds on a
    # loaded CI VM.)
    assert "slow" not in seen.finished_recving and "ps" not in sent.finished_sending, \
        "the other request waited for the delayed signal"
    poll(d, "finished_recving", "slow", sender=p)
    assert time.monotonic() - t0 >= 3.5
    poll(p, "finished_sending", "ps")


def test_failed_receives_name_their_blocks_for_vllm_before_0_32(pd, monkeypatch) -> None:
    """vLLM 0.24-0.31 learns of a failed receive only from its blocks (``get_block_ids_with_load_errors``, asked
    right after ``get_finished``): the connector reports exactly the failed request's destination blocks, once;
    neither a landed nor an aborted receive reports any."""
    from kvtransport_vllm import connector as conn_mod

    _, d, _, _ = pd
    monkeypatch.setattr(conn_mod, "REPORTS_FAILED_RECVING", False)
    c = conn_mod.KVTransportConnector.__new__(conn_mod.KVTransportConnector)
    c._worker, c._load_errors = d, set()
    d.bind(StepPlan(recv_start={"late": 0.2, "gone": 60}, recv_blocks={"late": [5, 6, 9], "gone": [1, 2]}))
    deadline = time.monotonic() + 30
    recving: set[str] = set()
    errors: set[int] = set()
    while "late" not in recving and time.monotonic() < deadline:
        recving |= c.get_finished(set())[1] or set()
        errors |= c.get_block_ids_with_load_errors()
        time.sleep(0.01)
    assert "late" in recving and errors == {5, 6, 9}
    d.bind(StepPlan(recv_abort=["gone"]))
    while "gone" not in recving and time.monotonic() < deadline:
        recving |= c.get_finished(set())[1] or set()
        errors |= c.get_block_ids_with_load_errors()
        time.sleep(0.01)
    assert "gone" in recving and errors == {5, 6, 9}  # an abort is not a load error
    assert c.get_block_ids_with_load_errors() == set() and d.blocks_of({"late", "gone"}) == set()


def test_a_bound_request_refuses_another_prefills_push(pd) -> None:
    """A decode request bound to its prefill worker (``recv_from``) takes no KV from another peer: that
    peer's puts and signals are refused (and counted), the request does not complete, and the right prefill's
    push then lands."""
    p, d, src, dst = pd
    other = worker(vllm_like_cache(2))
    try:
        meta = d.handshake()["metadata"]
        d.bind(StepPlan(recv_start={"bound": 60}, recv_from={"bound": {0: p.cm.instance}}))
        step(other, StepPlan(peers={"D": {0: meta}}, sources=[source("x", (1, 2))], binds=[dest("x", "bound", (30, 31))]),
             src)
        # A refused frame fails the push at its sender, so how many of its puts and signals reach the decode
        # before the sender stops is a race (CI saw 2 and 3): at least one is refused and not a byte lands.
        deadline = time.monotonic() + 20
        while d.cm.stats()["foreign_refused"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.cm.stats()["foreign_refused"] >= 1, d.cm.stats()
        assert "bound" not in d.transfer_results().finished_recving
        for name in dst:
            assert not dst[name][30].any() and not dst[name][31].any(), name
        step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("y", (3, 4))], binds=[dest("y", "bound", (30, 31))]),
             src)
        poll(d, "finished_recving", "bound")
        for name in src:
            assert torch.equal(src[name][3], dst[name][30]) and torch.equal(src[name][4], dst[name][31])
    finally:
        other.shutdown()


def test_aborted_and_failed_receives_are_reported_only_after_the_abort_fence(pd, monkeypatch) -> None:
    """vLLM may reuse a request's blocks as soon as it is reported: an aborted or failed receive is reported
    (finished_recving) only once ``CommManager.abort`` returned (no byte of it can land any more)."""
    import threading

    _, d, _, _ = pd
    fence = threading.Event()
    real_abort = d.cm.abort

    def slow_abort(seq, *, timeout):  # the senders are still confirming
        fence.wait(10)
        real_abort(seq, timeout=timeout)

    monkeypatch.setattr(d.cm, "abort", slow_abort)
    d.bind(StepPlan(recv_start={"ab": 60, "fl": 0.1}))
    d.bind(StepPlan(recv_abort=["ab"]))
    deadline = time.monotonic() + 1.0
    seen = set()
    while time.monotonic() < deadline:
        seen |= d.transfer_results().finished_recving
        time.sleep(0.02)
    assert not seen & {"ab", "fl"}, "reported before the abort fence returned"
    fence.set()
    got = TransferResults(set(), set(), set())
    deadline = time.monotonic() + 30
    while not {"ab", "fl"} <= got.finished_recving and time.monotonic() < deadline:
        r = d.transfer_results()
        got.finished_recving |= r.finished_recving
        got.failed_recving |= r.failed_recving
        time.sleep(0.02)
    assert {"ab", "fl"} <= got.finished_recving and got.failed_recving == {"fl"}, got  # an abort is no failure


def test_a_held_receive_is_reported_only_once_released(pd) -> None:
    """First-token flow: a receive the scheduler holds (``recv_hold``) is reported landed only after
    ``recv_release`` (its first token is then in its prompt); a held receive the prefill cannot finish any
    more is reported failed, and one that is aborted is reported finished without waiting for a release."""
    p, d, src, dst = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"held": 60, "gone": 60, "dropped": 60}, recv_hold={"held", "gone", "dropped"}))
    step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("p1", (3, 4)), source("p2", (5,)), source("p3", (6,))]),
         src)
    p.bind(StepPlan(binds=[dest("p1", "held", (40, 41)), dest("p2", "gone", (42,)), dest("p3", "dropped", (43,))]))
    landed = time.monotonic() + 30
    while len(d._landed_held) < 3 and time.monotonic() < landed:  # all three landed, none reported
        assert d.transfer_results().finished_recving == set()
        time.sleep(0.01)
    assert set(d._landed_held) == {"held", "gone", "dropped"}
    assert d.transfer_results().finished_recving == set()
    d.bind(StepPlan(recv_release={"held"}, recv_fail={"gone": "prefill lost: test"}, recv_abort=["dropped"]))
    r = d.transfer_results()
    assert r.finished_recving == {"held", "gone", "dropped"} and r.failed_recving == {"gone"}
    assert torch.equal(dst["model.layers.0.self_attn.attn"][40], src["model.layers.0.self_attn.attn"][3])
    assert d.transfer_results().finished_recving == set()  # each reported once


HOSTILE_PEER_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from test_worker_connector import StepPlan, dest, source, vllm_like_cache, worker
from kvtransport import wire
src, dst = vllm_like_cache(1), vllm_like_cache(None)
p, d = worker(src, backend="ucx"), worker(dst, backend="ucx", transfer_timeout=60)
meta = wire.decode_metadata(d.handshake()["metadata"])
bad = bytearray.fromhex(meta["transport"]["worker"])
bad[0] = (bad[0] & 0xF0) | 0x7  # a header version libucp asserts on (it aborts the process unchecked)
meta["transport"]["worker"] = bad.hex()
p.bind(StepPlan(peers={"EVIL": {0: wire.encode_metadata(meta)}}, sources=[source("p1", (1,))]))
p.wait_for_save()
p.bind(StepPlan(binds=[dest("p1", "s1", (2,), engine="EVIL")]))
deadline = time.monotonic() + 30
fails = []
while not fails and time.monotonic() < deadline:
    p.transfer_results()  # collects the pusher's failures for the scheduler
    fails = p.take_send_failures()
    time.sleep(0.05)
print("FAILURES", [(f.seq, f.engine, f.reason.split(":")[0]) for f in fails])
d.bind(StepPlan(recv_start={"s2": 60}))  # the process is alive and a genuine decode still gets its KV
p.bind(StepPlan(peers={"D": {0: d.handshake()["metadata"]}}, sources=[source("p2", (3,))]))
p.wait_for_save()
p.bind(StepPlan(binds=[dest("p2", "s2", (4,))]))
deadline = time.monotonic() + 30
while "s2" not in d.transfer_results().finished_recving and time.monotonic() < deadline:
    time.sleep(0.05)
print("STILL-WORKS", bool((dst["model.layers.0.self_attn.attn"][4] == src["model.layers.0.self_attn.attn"][3]).all()))
p.shutdown(); d.shutdown()
"""


def test_hostile_ucx_metadata_from_the_side_channel_never_reaches_libucp() -> None:
    """A decode's hello carries its workers' kvtransport metadata to the prefill, which hands it to ``connect``:
    ucx metadata whose worker address has a header version libucp asserts on fails that destination's pushes
    with IncompatiblePeer (reported to the scheduler) instead of aborting the prefill worker, which then serves
    a genuine decode. (A child process: unchecked, libucp would abort it.)"""
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("kvtransport_ucx", reason="the ucx backend is not installed")
    proc = subprocess.run([sys.executable, "-c", HOSTILE_PEER_CHILD, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert "FAILURES [('s1', 'EVIL', 'IncompatiblePeer')]" in proc.stdout, proc.stdout
    assert "STILL-WORKS True" in proc.stdout, proc.stdout


def test_every_layer_of_a_step_puts_the_same_runs_object(pd) -> None:
    """The pusher expands a planned push once for all the layers of a step: ``put_runs`` gets the same runs
    object for each layer (the CUDA IPC launcher caches a put's device table by that object's identity: a new
    object per layer would upload the table again for every layer, on the forward's time)."""
    p, d, src, _ = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"same": 60}))
    calls: list[tuple[tuple[int, ...], int]] = []
    real = p.cm.put_runs

    def spy(peer, seq, layers, runs):  # type: ignore[no-untyped-def]
        calls.append((tuple(layers), id(runs)))
        return real(peer, seq, layers, runs)

    p.cm.put_runs = spy  # type: ignore[method-assign]
    step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("ps", (1, 2, 3), 0, 2 * BS, 3 * BS)],
                     binds=[dest("ps", "same", (21, 22, 23))]), src)
    step(p, StepPlan(sources=[source("ps", (1, 2, 3), 2 * BS, 3 * BS, 3 * BS)]), src)
    poll(d, "finished_recving", "same", sender=p)
    assert [layers for layers, _ in calls] == [(i,) for i in range(LAYERS)] * 2
    first, second = {r for _, r in calls[:LAYERS]}, {r for _, r in calls[LAYERS:]}
    assert len(first) == 1 and len(second) == 1 and first != second, calls


def test_a_connect_the_decode_broke_off_is_tried_again(pd, monkeypatch) -> None:
    """An overloaded decode host drops a hello that came late (its worker closes the connection): the prefill
    worker connects again within connect_timeout instead of failing every push to that decode for a backoff."""
    import kvtransport

    p, d, src, dst = pd
    real = p.cm.connect
    tries: list[float] = []

    def flaky(meta, *, timeout):  # type: ignore[no-untyped-def]
        tries.append(timeout)
        if len(tries) < 3:
            raise kvtransport.PeerDisconnected("peer 127.0.0.1:1 closed the side channel")
        return real(meta, timeout=timeout)

    monkeypatch.setattr(p.cm, "connect", flaky)
    d.bind(StepPlan(recv_start={"again": 60}))
    step(p, StepPlan(peers={"D": {0: d.handshake()["metadata"]}}, sources=[source("pa", (1, 2))],
                     binds=[dest("pa", "again", (41, 42))]), src)
    poll(d, "finished_recving", "again", sender=p)
    assert len(tries) == 3 and all(0 < t <= 20 for t in tries)
    assert p.take_send_failures() == []
    for name in src:
        assert torch.equal(src[name][1], dst[name][41]) and torch.equal(src[name][2], dst[name][42])


def test_the_decodes_slots_come_back_after_every_landing_past_its_capacity() -> None:
    """Issue 32: a decode whose receiver has 4 sequence slots takes 10 requests one after another: every one
    lands byte-exact and, once reported, holds no slot (a leak would refuse the fifth)."""
    src, dst = vllm_like_cache(2), vllm_like_cache(None)
    p, d = worker(src), worker(dst, transfer_timeout=60, backend_options={"capacity": 4})
    try:
        meta = d.handshake()["metadata"]
        assert d.cm is not None and d.cm.stats()["capacity"] == 4
        for i in range(10):
            s_ids, d_ids = (1 + i % 5, 6 + i % 3), (20 + i, 40 + i)
            d.bind(StepPlan(recv_start={f"d{i}": 30}))
            peers = {"D": {0: meta}} if i == 0 else {}
            step(p, StepPlan(peers=peers, sources=[source(f"p{i}", s_ids)], binds=[dest(f"p{i}", f"d{i}", d_ids)]),
                 src)
            r = poll(d, "finished_recving", f"d{i}")
            assert f"d{i}" not in r.failed_recving
            for name in src:
                for s, t in zip(s_ids, d_ids, strict=True):
                    assert torch.equal(src[name][s], dst[name][t]), (i, name)
            p.bind(StepPlan(send_release=[f"p{i}"]))
            poll(p, "finished_sending", f"p{i}")
            assert d.cm.stats()["slots_in_use"] == 0, (i, d.cm.stats())
        assert d.stats_delta()["transfers_received"] == 10
    finally:
        p.shutdown()
        d.shutdown()


def test_finished_sending_waits_for_a_one_sided_links_completion() -> None:
    """Issue 32: over ucx (one-sided puts: a put returns before its bytes landed) the prefill may report a request
    "finished sending" (vLLM then frees and reuses its blocks) only after the link's flush returned. The flush is
    slowed by 0.5 s here: the report must come after it, never before."""
    src, dst = vllm_like_cache(3), vllm_like_cache(None)
    p, d = worker(src, backend="ucx"), worker(dst, backend="ucx", transfer_timeout=60)
    try:
        assert p.cm is not None and p.cm.capabilities.one_sided
        meta = d.handshake()["metadata"]
        d.bind(StepPlan(recv_start={"dreq": 30}))
        step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("preq", (1, 2))], binds=[dest("preq", "dreq", (5, 6))]),
             src)
        poll(d, "finished_recving", "dreq")
        flushed: list[float] = []
        real_flush = p.cm.flush

        def slow_flush(peer: object, timeout: float | None = None) -> None:
            time.sleep(0.5)
            real_flush(peer, timeout=timeout)
            flushed.append(time.monotonic())

        p.cm.flush = slow_flush  # type: ignore[method-assign]
        p.bind(StepPlan(send_release=["preq"]))
        poll(p, "finished_sending", "preq")
        reported = time.monotonic()
        assert len(flushed) == 1 and flushed[0] <= reported, (flushed, reported)
        for name in src:
            assert torch.equal(src[name][1], dst[name][5]) and torch.equal(src[name][2], dst[name][6])
    finally:
        p.shutdown()
        d.shutdown()


def test_a_release_while_the_connect_is_pending_waits_for_the_puts(pd, monkeypatch) -> None:
    """Issue 32: vLLM releases a prefill request (it would reuse its blocks) while the worker's connect to the
    decode is still pending and the request's puts wait for it. "Finished sending" must wait for the connect and
    the puts: reported before, vLLM could overwrite blocks not yet read. The connect is held for 1 s here."""
    import threading

    p, d, src, dst = pd
    real = p.cm.connect
    gate = threading.Event()

    def slow(meta, *, timeout):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return real(meta, timeout=timeout)

    monkeypatch.setattr(p.cm, "connect", slow)
    d.bind(StepPlan(recv_start={"late": 60}))
    step(p, StepPlan(peers={"D": {0: d.handshake()["metadata"]}}, sources=[source("pl", (3, 4))],
                     binds=[dest("pl", "late", (51, 52))]), src)
    p.bind(StepPlan(send_release=["pl"]))
    time.sleep(1.0)
    early = p.transfer_results()
    assert "pl" not in early.finished_sending, "reported finished while its connect was pending"
    gate.set()
    poll(p, "finished_sending", "pl")
    poll(d, "finished_recving", "late", sender=p)
    for name in src:
        assert torch.equal(src[name][3], dst[name][51]) and torch.equal(src[name][4], dst[name][52])


def test_a_push_step_that_raises_fails_its_destinations_at_once(pd, monkeypatch) -> None:
    """A bug of ours in the step's push path (the planner raising at the step's end): the step's destination
    fails now, with the reason, and its decode is told in the next report instead of waiting out its 60 s
    transfer timeout; nothing more is put to it. A destination channel message that raises fails nothing."""
    p, d, src, _ = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"dreq": 60}))

    def broken() -> list[Any]:
        raise RuntimeError("planted")

    monkeypatch.setattr(p.pusher.planner, "step_end", broken)
    t0 = time.monotonic()
    step(p, StepPlan(peers={"D": {0: meta}}, sources=[source("preq", (3, 4))], binds=[dest("preq", "dreq", (40, 41))]),
         src)
    fails: list[Any] = []
    while not fails and time.monotonic() < t0 + 10:
        p.transfer_results()
        fails = p.take_send_failures()
        time.sleep(0.01)
    assert [(f.seq, f.engine) for f in fails] == [("dreq", "D")]
    assert "step_end: RuntimeError: planted" in fails[0].reason and time.monotonic() - t0 < 10
    assert p.pusher.failed_seqs["dreq"] == fails[0].reason


def test_a_destination_channel_message_that_raises_fails_no_other_push(pd, monkeypatch) -> None:
    """Any decode can send the destination channel a message; one our code fails on (planted) fails nothing of
    the step in flight, whose KV still lands whole."""
    p, d, src, dst = pd
    meta = d.handshake()["metadata"]
    d.bind(StepPlan(recv_start={"dreq": 60}))

    def broken(engine: str, msg: Any) -> None:
        raise RuntimeError("planted")

    monkeypatch.setattr(p.pusher, "_direct", broken)
    p.bind(StepPlan(peers={"D": {0: meta}}, sources=[source("preq", (3, 4))], binds=[dest("preq", "dreq", (40, 41))]))
    names = list(src)
    p.save_kv_layer(names[0], src[names[0]])  # the step is in flight: its source is active
    p.pusher.submit("msg", "D", {"type": "dst"})
    for name in names[1:]:
        p.save_kv_layer(name, src[name])
    p.wait_for_save()
    poll(d, "finished_recving", "dreq", sender=p)
    p.transfer_results()
    assert p.take_send_failures() == [] and not p.pusher.failed_seqs
    for name in src:
        assert torch.equal(src[name][3], dst[name][40]) and torch.equal(src[name][4], dst[name][41])
