"""CommManager behaviour through the in-process reference backend (fast; no second process)."""

import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kvtransport as kt
from kvtransport import wire
from kvtransport.workload.caches import CacheSpec, HostCache, verify_transfer

SPEC = CacheSpec(num_layers=3, num_blocks=16, heads=2, block_size=4, head_dim=8, order="NHD")


@pytest.fixture
def pair():
    src, dst = HostCache(SPEC, fill_seed=11), HostCache(SPEC)
    with kt.open(src.layout, backend="inproc") as s, kt.open(dst.layout, backend="inproc") as r:
        yield s, r, src, dst


def test_layerwise_push_and_verify(pair):
    s, r, src, dst = pair
    peer = s.connect(r.metadata())
    pairs = [(3, 0), (4, 1), (5, 2), (9, 7), (0, 15)]
    for layer in range(SPEC.num_layers):
        s.put_layer(peer, "r1", layer, [a for a, _ in pairs], [b for _, b in pairs])
        s.signal_layer(peer, "r1", layer)
        r.wait_layer("r1", layer, timeout=5)
    s.signal(peer, "r1")
    r.wait("r1", timeout=5)
    assert verify_transfer(dst, src, {layer: pairs for layer in range(SPEC.num_layers)}) == []
    assert r.poll() == ["r1"]
    stats = s.stats()
    assert stats["runs"] == 3 * 3 and stats["bytes_sent"] == 3 * 5 * src.layout.layers[0].block_bytes
    assert stats["paths"] == ["inproc memmove"]
    r.release("r1")
    assert r.stats()["slots_in_use"] == 0


def test_put_layers_sends_a_whole_request_in_one_call(pair):
    s, r, src, dst = pair
    peer = s.connect(r.metadata())
    pairs = [(3, 0), (4, 1), (9, 7)]
    for bad in ([0, 3], [1, 1], [-1], ["0"]):
        with pytest.raises(kt.InvalidBlockIds):
            s.put_layers(peer, "r1", bad, [a for a, _ in pairs], [b for _, b in pairs])
    with pytest.raises(kt.InvalidSequenceId):
        s.put_layers(peer, None, None, [1], [1])
    assert not dst.backing.any()  # validation moved nothing
    s.put_layers(peer, "r1", [2, 0], [a for a, _ in pairs], [b for _, b in pairs])
    s.put_layers(peer, "r1", None, [5], [15])
    s.signal(peer, "r1")
    r.wait("r1", timeout=5)
    want = {layer: ([(5, 15)] if layer == 1 else [*pairs, (5, 15)]) for layer in range(SPEC.num_layers)}
    assert verify_transfer(dst, src, want) == []
    stats = s.stats()
    assert stats["puts"] == 2 + 3 and stats["bytes_sent"] == (2 * 3 + 3 * 1) * src.layout.layers[0].block_bytes


def test_invalid_block_ids_move_nothing(pair):
    s, r, _, dst = pair
    peer = s.connect(r.metadata())
    for src_ids, dst_ids in (([0, 1], [2, 2]), ([0], [16]), ([16], [0]), ([-1], [0]), ([0, 1], [1])):
        with pytest.raises(kt.InvalidBlockIds):
            s.put_layer(peer, "bad", 0, src_ids, dst_ids)
    with pytest.raises(kt.InvalidBlockIds):
        s.put_layer(peer, "bad", 3, [0], [0])
    s.flush(peer, timeout=5)
    assert not dst.backing.any()


def test_incompatible_layout_refused_at_connect():
    a = HostCache(SPEC)
    b = HostCache(CacheSpec(**{**SPEC.to_dict(), "order": "HND"}))
    c = HostCache(CacheSpec(**{**SPEC.to_dict(), "num_layers": 2}))
    with kt.open(a.layout, backend="inproc") as s, kt.open(b.layout, backend="inproc") as r, \
            kt.open(c.layout, backend="inproc") as r2:
        with pytest.raises(kt.IncompatiblePeer, match="VLLM_KV_CACHE_LAYOUT"):
            s.connect(r.metadata())
        with pytest.raises(kt.IncompatiblePeer, match="layer count"):
            s.connect(r2.metadata())
        with pytest.raises(kt.IncompatiblePeer, match="itself"):
            s.connect(s.metadata())


def test_shared_secret_refuses_strangers():
    a, b = HostCache(SPEC), HostCache(SPEC)
    with kt.open(b.layout, backend="inproc", secret="s3cret") as r:
        with kt.open(a.layout, backend="inproc") as stranger:
            with pytest.raises(kt.ProtocolError, match="authentication failed"):
                stranger.connect(r.metadata())
        with kt.open(a.layout, backend="inproc", secret="wrong") as wrong:
            # the metadata is sealed with the receiver's secret: refused before any connection is made
            with pytest.raises(kt.ProtocolError, match="not sealed with our KV_TRANSPORT_SECRET"):
                wrong.connect(r.metadata())
        with kt.open(a.layout, backend="inproc", secret="s3cret") as friend:
            friend.connect(r.metadata())
        assert r.stats()["refused_peers"] == 1  # the stranger; the wrong secret never reached the receiver


def test_garbage_on_the_side_channel_does_not_hurt(pair):
    s, r, _, _ = pair
    meta = wire.decode_metadata(r.metadata())
    for junk in (b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 64, wire.frame(wire.FrameType.HELLO, b"[1,2]"),
                 wire.frame(wire.FrameType.HELLO, b'{"body": "{\\"metadata\\": 5}"}')):
        with socket.create_connection((meta["host"], meta["port"]), timeout=5) as c:
            c.sendall(junk)
            c.settimeout(5)
            try:
                while c.recv(4096):
                    pass
            except OSError:
                pass
    peer = s.connect(r.metadata())  # still serving
    s.put_layer(peer, 1, 0, [0], [0])
    s.signal(peer, 1)
    r.wait(1, timeout=5)


def test_close_wakes_waiters_and_returns(pair):
    _, r, _, _ = pair
    errors = []

    def waiter():
        try:
            r.wait("never", timeout=30)
        except kt.KVTransportError as exc:
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    r.close()
    t.join(5)
    assert time.monotonic() - t0 < 5
    assert errors and isinstance(errors[0], kt.CommClosed)
    with pytest.raises(kt.CommClosed):
        r.poll()
    r.close()  # idempotent


def test_receiver_closing_fails_sender_link(pair):
    s, r, _, _ = pair
    peer = s.connect(r.metadata())
    r.close()
    deadline = time.monotonic() + 5
    with pytest.raises((kt.PeerDisconnected, kt.CommClosed)):
        while time.monotonic() < deadline:
            s.signal(peer, "x")
            s.flush(peer, timeout=1)
            time.sleep(0.02)


def test_backend_failure_surfaces_on_sender(pair):
    s, r, _, _ = pair
    peer = s.connect(r.metadata())
    peer._state.link.fail_next = kt.PeerDisconnected("injected")
    with pytest.raises(kt.PeerDisconnected, match="injected"):
        s.put_layer(peer, "q", 0, [0], [0])
    with pytest.raises(kt.PeerDisconnected):
        s.signal(peer, "q")


def test_slots_exhausted_reported_to_both_sides():
    a, b = HostCache(SPEC, fill_seed=1), HostCache(SPEC)
    with kt.open(a.layout, backend="inproc") as s, kt.open(b.layout, backend="inproc", capacity=1) as r:
        peer = s.connect(r.metadata())
        s.signal(peer, "one")
        r.wait("one", timeout=5)
        s.signal(peer, "two")
        s.flush(peer, timeout=5)
        with pytest.raises(kt.SlotsExhausted):
            r.wait("two", timeout=1)
        deadline = time.monotonic() + 5
        with pytest.raises(kt.SlotsExhausted):
            while time.monotonic() < deadline:
                s.signal(peer, "two")
                time.sleep(0.01)


def test_configuration_errors_name_the_fix(monkeypatch):
    layout = HostCache(SPEC).layout
    with pytest.raises(kt.UnknownBackend, match=r"^backend 'nope' is not installed \(installed: ") as info:
        kt.open(layout, backend="nope")
    assert "kvtransport backends" in info.value.fix
    if "mscclpp" not in kt.registry.specs():
        with pytest.raises(kt.UnknownBackend) as info:
            kt.open(layout, backend="mscclpp")
        assert "build MSCCL++ from upstream source" in info.value.fix
    with pytest.raises(kt.InterfaceNotFound, match=r"NET_IFNAME=eth9 not found; interfaces: .*lo"):
        kt.open(layout, backend="inproc", ifname="eth9")
    monkeypatch.setenv("NET_IFNAME", "eth9")
    with pytest.raises(kt.InterfaceNotFound):
        kt.open(layout, backend="inproc")
    monkeypatch.setenv("NET_IFNAME", "lo")
    monkeypatch.setenv("KV_TRANSPORT", "inproc")
    with kt.open(layout) as cm:
        assert cm.backend == "inproc" and cm.host == "127.0.0.1"
    monkeypatch.setenv("KV_TRANSPORT_TIMEOUT", "abc")
    with pytest.raises(kt.ConfigurationError, match="KV_TRANSPORT_TIMEOUT"):
        kt.open(layout)
    with pytest.raises(kt.LayoutError):
        kt.open(np.zeros(4))


def test_auto_never_picks_the_test_backend():
    rows = kt.available_backends(include_test_only=True)
    assert "inproc" in {r.name for r in rows}
    assert all(str(r).startswith(r.name) for r in rows)  # each row prints its name first
    spec = kt.registry.choose("auto", "cpu") if any(
        r.available and r.name != "inproc" for r in kt.available_backends()) else None
    assert spec is None or spec.name != "inproc"


def test_core_import_is_light():
    code = "import sys, kvtransport, kvtransport.manager; print(sorted(m for m in ('torch','numpy','cupy','mscclpp','ucxx') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_environment_writes_at_import():
    code = "import os; before=dict(os.environ); import kvtransport, kvtransport.registry; kvtransport.available_backends(); print(before == dict(os.environ))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


def test_abort_fences_the_sender(pair):
    s, r, _, dst = pair
    peer = s.connect(r.metadata())
    s.put_layer(peer, "a", 0, [1, 2], [3, 4])
    s.signal_layer(peer, "a", 0)
    r.wait_layer("a", 0, timeout=5)
    r.abort("a", timeout=5)  # returns once the sender confirmed
    with pytest.raises(kt.SequenceAborted):
        s.put_layer(peer, "a", 1, [1, 2], [3, 4])
    with pytest.raises(kt.SequenceAborted):
        s.signal(peer, "a")
    dst.backing[:] = 0  # the receiver reuses the blocks: nothing of "a" may land any more
    s.flush(peer, timeout=5)
    assert not dst.backing.any()
    assert r.stats()["slots_in_use"] == 0 and r.stats()["aborted"] == 1
    s.release("a")  # the sender forgets it; the id can be used again later
    s.put_layer(peer, "b", 1, [5], [6])
    s.signal(peer, "b")
    r.wait("b", timeout=5)


def test_abort_with_no_sender_returns_at_once(pair):
    _, r, _, _ = pair
    t0 = time.monotonic()
    r.abort("nobody", timeout=5)
    assert time.monotonic() - t0 < 1


def test_sender_cancel_fails_receiver_wait(pair):
    s, r, _, _ = pair
    peer = s.connect(r.metadata())
    s.put_layer(peer, "c", 0, [0], [0])
    s.signal_layer(peer, "c", 0)
    r.wait_layer("c", 0, timeout=5)
    s.cancel(peer, "c")
    t0 = time.monotonic()
    with pytest.raises(kt.SequenceAborted, match="cancelled by the sender"):
        r.wait("c", timeout=10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(kt.SequenceAborted):
        s.signal(peer, "c")


def test_checksum_option_catches_silent_corruption():
    src, dst = HostCache(SPEC, fill_seed=5), HostCache(SPEC)
    with kt.open(src.layout, backend="inproc", checksum=True) as s, \
            kt.open(dst.layout, backend="inproc", checksum=True) as r:
        peer = s.connect(r.metadata())
        s.put_layer(peer, "good", 0, [1, 2, 3], [4, 5, 6])
        s.signal_layer(peer, "good", 0)
        r.wait_layer("good", 0, timeout=5)
        # corrupt the path: the backend flips a byte after copying
        orig = peer._state.link.put

        def corrupting_put(layer, runs):
            orig(layer, runs)
            p = dst.layout.layers[layer].planes[0]
            import ctypes

            ctypes.memset(p.address(runs[0].dst) + 7, 0xAB, 1)

        peer._state.link.put = corrupting_put
        s.put_layer(peer, "bad", 1, [7, 8], [9, 10])
        s.signal(peer, "bad")
        with pytest.raises(kt.TransferError, match="integrity check failed"):
            r.wait("bad", timeout=5)
    cuda_layout = kt.KVLayout.from_regions(4, [[(4096, 64, 64)]], device="cuda:0")
    with pytest.raises(kt.ConfigurationError, match="host memory only"):
        kt.open(cuda_layout, backend="inproc", checksum=True)


def test_runs_of_a_request_are_one_object_and_follow_the_ids(pair):
    """Backends cache per-request plans by the identity of the runs tuple: every layer of a request must get
    the same object, also when two requests interleave; other ids (or the same list mutated) get other runs."""
    s, _, _, _ = pair
    a_src, a_dst = [1, 2, 3, 9], [4, 5, 6, 0]
    b_src, b_dst = [7, 8], [10, 11]
    ra = s._runs(a_src, a_dst, SPEC.num_blocks)
    rb = s._runs(b_src, b_dst, SPEC.num_blocks)
    assert s._runs(list(a_src), tuple(a_dst), SPEC.num_blocks) is ra  # by content, not by list identity
    assert s._runs(b_src, b_dst, SPEC.num_blocks) is rb
    assert ra == ((1, 4, 3), (9, 0, 1)) and rb == ((7, 10, 2),)
    a_src[3] = 12  # the caller reuses its list: new ids, new runs
    assert s._runs(a_src, a_dst, SPEC.num_blocks) == ((1, 4, 3), (12, 0, 1))
    assert s._runs([1, 2, 3, 9], a_dst, SPEC.num_blocks) is ra  # the earlier request's entry is still cached
    with pytest.raises(kt.InvalidBlockIds):
        s._runs([[1]], [2], SPEC.num_blocks)  # unhashable ids
    with pytest.raises(kt.InvalidBlockIds):
        s._runs([1], [SPEC.num_blocks], SPEC.num_blocks)  # out of range on the receiver


def test_bad_sequence_ids_and_layers_are_typed_errors_before_any_byte_moves(pair):
    s, r, src, dst = pair
    peer = s.connect(r.metadata())
    too_long = "x" * 5000
    for bad in (too_long, 1.5, True, None):
        with pytest.raises(kt.InvalidSequenceId):
            s.put_layer(peer, bad, 0, [1], [1])
        with pytest.raises(kt.InvalidSequenceId):
            s.signal_layer(peer, bad, 0)
        with pytest.raises(kt.InvalidSequenceId):
            s.signal(peer, bad)
        with pytest.raises(kt.InvalidSequenceId):
            s.cancel(peer, bad)
        with pytest.raises(kt.InvalidSequenceId):
            r.expect(bad, sender=s.instance)
    assert isinstance(kt.InvalidSequenceId("x"), ValueError)  # also what plain-Python callers catch
    assert verify_transfer(dst, src, {}) == []  # nothing written
    with pytest.raises(kt.InvalidBlockIds, match="layer"):
        r.wait_layer("q", SPEC.num_layers, timeout=0.1)


def test_a_busy_side_channel_port_is_a_configuration_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(kt.ConfigurationError, match=f"cannot listen on 127.0.0.1:{port}.*KV_TRANSPORT_PORT"):
            kt.open(HostCache(SPEC).layout, backend="inproc", port=port)


def test_a_receiver_failing_after_welcome_reports_its_reason_to_the_sender(pair, monkeypatch):
    """The receiver's side of a link can fail after it sent WELCOME (e.g. its half of a rendezvous timed
    out): it sends REFUSE, and the sender's link fails with the receiver's reason, not an opaque one."""
    from kvtransport.testing import inproc

    s, r, _, _ = pair

    class FailingAnswer(inproc._Answer):
        def complete(self, timeout):
            raise kt.TransferError("rendezvous half timed out")

    monkeypatch.setattr(inproc, "_Answer", FailingAnswer)
    peer = s.connect(r.metadata())
    deadline = time.monotonic() + 10
    while True:
        try:
            s.put_layer(peer, "q", 0, [1], [1])
            s.flush(peer, timeout=1)
        except kt.PeerDisconnected as exc:
            assert "refused the link after the handshake" in str(exc) and "rendezvous half timed out" in str(exc)
            break
        assert time.monotonic() < deadline, "the sender never learned that the receiver refused the link"
        time.sleep(0.05)


def test_a_receiver_refusal_ends_a_sender_blocked_in_link_set_up_at_once(pair, monkeypatch):
    """A backend's link set-up may block until its deadline (a rendezvous whose other half will never come).
    When the receiver's half fails it sends REFUSE; the sender's connect ends at once with that reason instead
    of waiting out its timeout, and its blocked set-up is abandoned (closed when it finally returns)."""
    from kvtransport.testing import inproc

    s, r, _, _ = pair
    released = threading.Event()
    closed = []

    class FailingAnswer(inproc._Answer):
        def complete(self, timeout):
            raise kt.TransferError("the receiver's rendezvous half failed: bad port")

    class BlockingDialer(inproc._Dialer):
        def complete(self, reply, timeout):
            released.wait(timeout)  # a rendezvous nobody joins: blocks (GIL released) until its deadline
            link = super().complete(reply, timeout)
            link.close = lambda: closed.append(True)
            return link

    monkeypatch.setattr(inproc, "_Answer", FailingAnswer)
    monkeypatch.setattr(inproc, "_Dialer", BlockingDialer)
    t0 = time.monotonic()
    with pytest.raises(kt.TransferError, match="rendezvous half failed: bad port"):
        s.connect(r.metadata(), timeout=20)
    assert time.monotonic() - t0 < 5  # not the 20 s timeout
    released.set()
    deadline = time.monotonic() + 5
    while not closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closed == [True]  # the abandoned link was closed, not leaked


def test_side_channel_sockets_probe_a_silent_peer_within_bounds():
    """A peer host that vanishes without closing is noticed in ~25 s (TCP keepalive), not the system's 2 h."""
    from kvtransport.sidechannel import KEEPALIVE_IDLE_S, KEEPALIVE_PROBES, FramedSocket

    with socket.create_server(("127.0.0.1", 0)) as server:
        b = socket.create_connection(server.getsockname()[:2], timeout=5)
        a, _ = server.accept()
    try:
        FramedSocket(a, "peer", send_timeout=1.0)
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
    finally:
        a.close()
        b.close()


def test_put_runs_moves_exactly_the_runs_given(pair):
    s, r, src, dst = pair
    peer = s.connect(r.metadata())
    for bad in ([(0, 0, 0)], [(-1, 0, 1)], [(15, 0, 2)], [(0, 15, 2)], [(0, 0, 2), (5, 1, 1)], [(0, 0, True)],
                [(0, 0)], "abc", [(0.5, 1, 1)]):
        with pytest.raises(kt.InvalidBlockIds):
            s.put_runs(peer, "r1", None, bad)
    assert not dst.backing.any()  # validation moved nothing
    s.put_runs(peer, "r1", [1], [kt.BlockRun(3, 0, 2), (np.int64(9), 5, 1)])
    s.signal(peer, "r1")
    r.wait("r1", timeout=5)
    assert verify_transfer(dst, src, {0: [], 1: [(3, 0), (4, 1), (9, 5)], 2: []}) == []
    assert s.stats()["bytes_sent"] == 3 * src.layout.layers[1].block_bytes
