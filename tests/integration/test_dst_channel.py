"""Destinations straight to the prefill's workers: each prefill worker runs a destination channel (the side
channel's server without the compatibility check), the prefill's welcome names them (``worker_at``), and a decode
sends its destination blocks there as well as to the prefill's scheduler, so they reach the workers without the
prefill's engine loop. The channel proves KV_TRANSPORT_SECRET like every other; a welcome's list is bounded and
checked; a worker link that fails fails no request (the scheduler's channel carries the same blocks)."""

from __future__ import annotations

import queue
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import protocol as proto
from kvtransport_vllm.protocol import MAX_WORKER_LINKS, PROTOCOL_VERSION, check_worker_at
from kvtransport_vllm.sidechannel import PeerClient, SideChannelServer

from .test_scheduler_connector import Pair, _decode_admit
from .vllm_helpers import make_request, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

HELLO = {"type": "hello", "version": PROTOCOL_VERSION, "engine_id": "D", "compat": "c", "tp_size": 1, "workers": {}}


def events(q: queue.Queue, kind: str, timeout: float = 10) -> list[tuple]:
    """The events of ``kind`` that reach ``q`` within ``timeout`` (at least one, or an empty list)."""
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline and not out:
        try:
            ev = q.get(timeout=0.05)
        except queue.Empty:
            continue
        if ev is not None and ev[0] == kind:
            out.append(ev)
    return out


def test_worker_at_is_checked_and_bounded() -> None:
    raw = {"0": ["10.0.0.5", 4000], "1": ["host-1.example", 4001], "2": ["bad host", 4002], "3": ["10.0.0.5", 0],
           "4": ["10.0.0.5", True], "x": ["10.0.0.5", 4004], "5": "10.0.0.5:4005", "6": ["::1", 65535],
           "7": ["a" * 254, 4007], "99999": ["10.0.0.5", 4008]}
    assert check_worker_at(raw) == {0: ("10.0.0.5", 4000), 1: ("host-1.example", 4001), 6: ("::1", 65535)}
    many = {str(r): ["127.0.0.1", 1000 + r] for r in range(1024)}
    got = check_worker_at(many)
    assert len(got) == MAX_WORKER_LINKS == 64 and list(got) == list(range(64))
    assert check_worker_at(["127.0.0.1", 1]) == {} and check_worker_at(None) == {}


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_worker_link_delivers_destinations_and_proves_the_secret(secret: bytes | None) -> None:
    jobs: queue.Queue = queue.Queue()
    server = SideChannelServer("127.0.0.1", 0, "P-worker", None, jobs, 10, secret=secret)
    inbox: queue.Queue = queue.Queue()
    link = PeerClient(server.host, server.port, lambda: HELLO, lambda: ("c", {}), inbox, 10, secret=secret,
                      worker=True)
    try:
        dst = {"type": "dst", "xfer": "x1", "mode": "push", "dsts": [{"seq": "d1", "blocks": [4, 5], "offset": 1}]}
        link.send(dst)
        (msg,) = events(jobs, "msg")
        assert proto.as_lists(msg) == ["msg", "D", {"type": "dst", "xfer": "x1", "mode": "push",
                                                    "dsts": [{"seq": "d1", "blocks": [4, 5], "offset": 1}]}]
        if secret is not None:  # a peer without the secret is refused by the worker's channel too
            impostor = PeerClient(server.host, server.port, lambda: {**HELLO, "engine_id": "I"}, lambda: ("c", {}),
                                  inbox, 3, secret=b"wrong", worker=True)
            impostor.send(dst)
            wait_until(lambda: impostor.dead, timeout=10)
            assert "did not prove KV_TRANSPORT_SECRET" in str(impostor.error)
            assert events(jobs, "msg", timeout=0.5) == []
    finally:
        link.close()
        server.close()


def test_a_dead_worker_link_fails_nothing() -> None:
    """Unlike the scheduler's channel, a worker link that cannot connect turns no destination into a failure and
    reports no lost prefill: the scheduler's channel still carries every destination."""
    inbox: queue.Queue = queue.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens
    link = PeerClient("127.0.0.1", port, lambda: HELLO, lambda: ("c", {}), inbox, 0.5, worker=True)
    link.send({"type": "dst", "xfer": "x", "dsts": [{"seq": "d", "blocks": [1], "offset": 0}]})
    wait_until(lambda: link.dead, timeout=10)
    link.send({"type": "dst", "xfer": "y", "dsts": [{"seq": "e", "blocks": [1], "offset": 0}]})
    time.sleep(0.2)
    assert inbox.empty()


def test_a_decode_sends_its_destination_to_every_prefill_worker_named_in_the_welcome(tiny_model: str) -> None:
    """The prefill scheduler names its workers' destination channels (from their handshake); the decode's
    allocation goes to each of them, straight, as well as to the prefill scheduler."""
    pr = Pair(tiny_model)
    workers = [(queue.Queue(), None) for _ in range(2)]
    servers = [SideChannelServer("127.0.0.1", 0, f"P-w{r}", None, q, 10) for r, (q, _) in enumerate(workers)]
    try:
        import kvtransport
        from kvtransport.workload.caches import CacheSpec, HostCache

        with kvtransport.open(HostCache(CacheSpec(1, 4, 1, 2, 4)).layout, backend="inproc") as cm:
            meta = cm.metadata()
        pr.pc.set_worker_metadata({r: {"instance": f"p-w{r}", "metadata": meta, "dst_at": [s.host, s.port]}
                                   for r, s in enumerate(servers)})
        pr.dc.set_worker_metadata({0: {"instance": "d-w0", "metadata": meta}})  # equal compatibility fields
        _, dparams = pr.push_params("direct")
        dreq = make_request(list(range(40)), params=dparams)
        _decode_admit(pr, dreq)
        blocks = pr.d.kv_cache_manager.get_block_ids(dreq.request_id)[0]
        want = ("msg", pr.dc.engine_id, {"type": "dst", "xfer": "direct", "mode": "push",
                                         "dsts": [{"seq": dreq.request_id, "blocks": list(blocks), "offset": 0}]})
        # the first allocation may go out before the welcome named the workers: a second one must reach both
        for q, _ in workers:
            if not [e for e in events(q, "msg", timeout=2) if e == want]:
                dreq2 = make_request(list(range(100, 140)), params=pr.push_params("direct2")[1])
                _decode_admit(pr, dreq2)
                got = events(q, "msg")
                assert got and got[0][2]["xfer"] == "direct2", got
        assert set(pr.dc.decode.worker_at[(pr.pc.host, pr.pc.port)]) == {0, 1}
        pr.prefill_sees_dsts("direct")  # the scheduler got it too
    finally:
        for s in servers:
            s.close()
        pr.close()
