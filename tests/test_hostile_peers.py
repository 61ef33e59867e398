"""Hostile peers and transient shortages, with real processes over ucx and nccl (gloo): a receiver that runs
out of descriptors or threads keeps serving; a flood of unauthenticated connections costs bounded memory and
no threads, and a legitimate peer is served during it."""

from __future__ import annotations

import pytest

from kvtransport import registry
from kvtransport.admission import MAX_PENDING_BYTES
from kvtransport.testing.harness import run_pair

BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not registry.probe(b).ok, reason=f"{b}: {registry.probe(b).reason}"))
            for b in ("ucx", "nccl")]
H = "kvtransport.testing.hostile"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receiver_out_of_descriptors_and_threads_keeps_serving(backend: str) -> None:
    """Its accept() hits a real EMFILE (RLIMIT_NOFILE exhausted by 200 plain connections), then its first
    connections get no thread: a real sender still connects (after as many refusals as threads failed) and
    its transfer verifies byte for byte."""
    r, s = run_pair(f"{H}.shortage_receiver", f"{H}.shortage_sender",
                    {"backend": backend, "spare_fds": 24, "flood": 200, "thread_failures": 3}, timeout=200)
    assert s["flooded"] == 200
    assert s["connected"], s
    assert r["accept_errors"] >= 1, "the flood never exhausted the receiver's descriptors"
    assert r["injected"] == 3
    assert len(s["errors"]) == 3, s  # one refused connect per failed thread, then served
    assert r["problems"] == [], r["problems"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_flood_of_unauthenticated_connections_costs_bounded_memory_and_no_thread(backend: str) -> None:
    """300 connections each announce an 8 MiB HELLO, send 64 KiB of it and stall (with KV_TRANSPORT_SECRET
    set). During the flood the receiver holds at most its pre-handshake budget and starts no thread for them;
    a sender with the secret is served meanwhile; after the flood memory and threads are back."""
    cfg = {"backend": backend, "secret": "s3cret", "flood": 300, "announce": 8 << 20, "send": 64 << 10,
           "settle_s": 1.5}
    r, s = run_pair(f"{H}.flood_receiver", f"{H}.flood_sender", cfg, timeout=200)
    assert s["flood"] == 300 and s["connected"] and s["errors"] == [], (s, r)
    assert s["legit_s"] < 10, (s, r)
    assert r["problems"] == [], r["problems"]
    (rss0, th0), (rss1, th1) = r["samples"]["baseline"], r["samples"]["flooding"]
    rss2, th2 = r["samples"]["after"]
    print(f"\n[flood] {backend}: RSS {rss0:.0f} -> {rss1:.0f} (flood) -> {rss2:.0f} MiB; threads {th0} -> {th1} -> {th2}")
    kvt = {k: [n for n in v if n.startswith("kvt-")] for k, v in r["names"].items()}
    assert kvt["flooding"] == kvt["baseline"], f"the flood started threads of ours: {kvt}"
    assert th1 <= th0 + 2, f"the flood started threads: {r['names']}"  # (a library may start one of its own)
    assert rss1 - rss0 < MAX_PENDING_BYTES / 2**20 + 32, "the flood cost more memory than the pre-handshake budget"
    assert rss2 - rss0 < 48, "memory did not come back after the flood"
    assert r["pending_after"] == 0, r
    assert r["dropped_crowded"] >= 300 - 256, r  # beyond MAX_PENDING the oldest went first


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sequences_belong_to_their_sender(backend: str) -> None:
    """Another connected peer cannot complete or cancel a legitimate sender's sequences, cannot connect under
    its instance id, and cannot take every slot with made-up ids: its events are refused (NACK) and counted,
    and the legitimate sender's transfers complete and verify."""
    r, s = run_pair(f"{H}.owner_receiver", f"{H}.owner_senders", {"backend": backend}, timeout=200)
    assert r["s"] == "TransferTimeout", "another peer's SIGNAL completed a sequence whose blocks were never written"
    assert r["s2"] == "TransferTimeout", "another peer's CANCEL failed a sequence it does not own"
    assert r["e"] == "TransferTimeout", "another peer completed a sequence the receiver expects from L"
    assert s["attacker_after_nack"] == "ForeignSequence", s
    assert s["impersonation"] == "IncompatiblePeer", s
    assert r["inbound"] == 2
    assert s["made_up_sent"] >= 1
    # A took slots only down to the reserve (a quarter of 16): 3 of L's + 9 made-up ones, not all 13 left
    assert r["slots_at_filled"] == 3 + 9, r
    assert r["problems"] == [], r["problems"]
    assert r["foreign_refused"] >= 3


def test_checksums_for_sequences_never_signalled_are_bounded() -> None:
    """A sender (debug checksums on) that puts into thousands of sequences without ever signalling them does
    not make the receiver hold their checksums without bound: past MAX_PENDING_CHECKSUMS its link is dropped
    (the sender sees PeerDisconnected), and the receiver keeps serving others."""
    import time

    import kvtransport as kt
    from kvtransport.manager import MAX_PENDING_CHECKSUMS
    from kvtransport.testing.cache import CacheSpec, HostCache

    spec = CacheSpec(num_layers=1, num_blocks=4, heads=1, block_size=2, head_dim=4, order="NHD")
    src, dst = HostCache(spec, fill_seed=1), HostCache(spec)
    with kt.open(dst.layout, backend="inproc", checksum=True) as r, \
            kt.open(src.layout, backend="inproc", checksum=True) as s, \
            kt.open(src.layout, backend="inproc", checksum=True) as other:
        peer = s.connect(r.metadata())
        with pytest.raises(kt.PeerDisconnected):
            for i in range(MAX_PENDING_CHECKSUMS + 100):
                s.put_layer(peer, f"never-{i}", 0, [0], [1])
            s.flush(peer, timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                s.put_layer(peer, "one-more", 0, [0], [1])
                time.sleep(0.05)
        t0 = time.monotonic()
        while s.instance in r.inbound_peers() and time.monotonic() - t0 < 5:
            time.sleep(0.02)  # the receiver's reader thread ends the link as the sender sees it
        assert s.instance not in r.inbound_peers()
        p2 = other.connect(r.metadata())
        other.put_layer(p2, "fine", 0, [2], [3])
        other.signal(p2, "fine")
        r.wait("fine", timeout=10)


@pytest.mark.parametrize("bad_run", [(0, 31, 2), (0, 10**6, 1), (31, 0, 2)], ids=["dst-end", "dst-far", "src-end"])
def test_a_two_sided_put_beyond_the_block_range_drops_the_link_and_writes_nothing(bad_run: tuple[int, int, int]) -> None:
    """A connected (authenticated) sender whose PUT frame names blocks beyond either side's range: the
    receiver checks every run before receiving a byte (the only guard on two-sided writes), drops that link,
    writes nothing, and keeps serving others."""
    import time

    import kvtransport as kt
    from kvtransport import BlockRun, wire
    from kvtransport.testing.cache import CacheSpec, HostCache

    if not registry.probe("nccl").ok:
        pytest.skip(f"nccl: {registry.probe('nccl').reason}")
    spec = CacheSpec(num_layers=1, num_blocks=32, heads=1, block_size=2, head_dim=4, order="NHD")
    src, dst = HostCache(spec, fill_seed=1), HostCache(spec)
    with kt.open(dst.layout, backend="nccl") as r, kt.open(src.layout, backend="nccl") as s:
        peer = s.connect(r.metadata())
        peer._state.conn.send(wire.FrameType.PUT, wire.encode_put("evil", 0, [BlockRun(*bad_run)]))
        t0 = time.monotonic()
        while s.instance in r.inbound_peers() and time.monotonic() - t0 < 10:
            time.sleep(0.02)
        assert s.instance not in r.inbound_peers(), "the link with the bad PUT is still up"
        assert not dst.backing.any(), "a byte landed"
        with kt.open(src.layout, backend="nccl") as s2:  # the receiver serves the next sender
            p2 = s2.connect(r.metadata())
            s2.put_layer(p2, "fine", 0, [1], [2])
            s2.signal(p2, "fine")
            r.wait("fine", timeout=20)
        assert dst.piece(0, 0, 2) == src.piece(0, 0, 1)
