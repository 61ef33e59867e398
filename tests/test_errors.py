"""The exception tree's contract at its edges: a backend that lets its library's error through still gives
the caller a typed kvtransport error (one helper, ``map_errors``, does it everywhere), chained to the original,
and errors about one sequence or peer say which in fields, not only in text."""

import pytest

import kvtransport as kt
from kvtransport.errors import map_errors
from kvtransport.testing import inproc
from kvtransport.workload.caches import CacheSpec, HostCache

SPEC = CacheSpec(num_layers=2, num_blocks=8, heads=1, block_size=4, head_dim=8, order="NHD")


def test_map_errors_types_a_library_error_and_chains_it() -> None:
    with pytest.raises(kt.TransferError) as info:
        with map_errors(kt.TransferError, "ucx flush failed", peer="10.0.0.2:5000", seq_id="r7"):
            raise OSError(104, "Connection reset by peer")
    err = info.value
    assert str(err) == "ucx flush failed: ConnectionResetError: [Errno 104] Connection reset by peer"
    assert isinstance(err.__cause__, ConnectionResetError)
    assert (err.peer, err.seq_id) == ("10.0.0.2:5000", "r7")


def test_map_errors_lets_our_errors_and_interrupts_through_unchanged() -> None:
    ours = kt.SequenceAborted("released")
    with pytest.raises(kt.SequenceAborted) as info:
        with map_errors(kt.TransferError, "put failed"):
            raise ours
    assert info.value is ours
    with pytest.raises(KeyboardInterrupt):
        with map_errors(kt.TransferError, "put failed"):
            raise KeyboardInterrupt


def test_fields_default_to_none_and_fix_still_works() -> None:
    err = kt.TransferTimeout("no signal")
    assert (err.seq_id, err.peer) == (None, None)
    assert kt.UnknownBackend("x").fix.startswith("pick one")
    assert kt.InvalidArgument("x", fix="pass seconds").fix == "pass seconds"


def test_a_backend_that_cannot_start_with_a_library_error_is_backend_unavailable(monkeypatch) -> None:
    def broken(self, layout, settings):
        raise RuntimeError("libfoo.so: cannot open shared object file")

    monkeypatch.setattr(inproc.InprocSpec, "create", broken)
    with pytest.raises(kt.BackendUnavailable) as info:
        kt.open(HostCache(SPEC).layout, backend="inproc")
    assert str(info.value) == "backend inproc could not start: RuntimeError: libfoo.so: cannot open shared object file"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_link_set_up_that_leaks_a_library_error_is_peer_disconnected(monkeypatch) -> None:
    def broken(self, reply, timeout):
        raise ValueError("bad worker address")

    monkeypatch.setattr(inproc._Dialer, "complete", broken)
    with kt.open(HostCache(SPEC).layout, backend="inproc") as s, kt.open(HostCache(SPEC).layout, backend="inproc") as r:
        with pytest.raises(kt.PeerDisconnected) as info:
            s.connect(r.metadata(), timeout=5)
    assert "inproc could not link to" in str(info.value) and str(info.value).endswith("ValueError: bad worker address")
    assert isinstance(info.value.__cause__, ValueError)


def test_a_put_or_flush_that_leaks_a_library_error_is_a_transfer_error_and_fails_the_link(monkeypatch) -> None:
    src, dst = HostCache(SPEC, fill_seed=3), HostCache(SPEC)
    with kt.open(src.layout, backend="inproc") as s, kt.open(dst.layout, backend="inproc") as r:
        peer = s.connect(r.metadata())
        link = peer._state.link
        link.fail_next = MemoryError("cudaErrorMemoryAllocation")  # type: ignore[assignment]
        with pytest.raises(kt.TransferError) as info:
            s.put_layer(peer, "a", 0, [1], [1])
        assert str(info.value) == "inproc put failed: MemoryError: cudaErrorMemoryAllocation"
        assert isinstance(info.value.__cause__, MemoryError)
        with pytest.raises(kt.TransferError):  # the link failed with it: later calls say so at once
            s.put_layer(peer, "b", 0, [2], [2])

    with kt.open(src.layout, backend="inproc") as s, kt.open(dst.layout, backend="inproc") as r:
        peer = s.connect(r.metadata())

        def broken_flush(timeout):
            raise OSError("EIO")

        monkeypatch.setattr(peer._state.link, "flush", broken_flush)
        s.put_layer(peer, "c", 0, [1], [1])
        with pytest.raises(kt.TransferError) as info:
            s.flush(peer, timeout=5)
        assert str(info.value) == "inproc flush failed: OSError: EIO"


def test_a_wait_that_times_out_names_its_sequence_in_a_field() -> None:
    with kt.open(HostCache(SPEC).layout, backend="inproc") as r:
        with pytest.raises(kt.TransferTimeout) as info:
            r.wait("req-42", timeout=0.05)
        assert info.value.seq_id == "req-42" and info.value.peer is None
        with pytest.raises(kt.TransferTimeout) as info:
            r.wait_layer(7, 1, timeout=0.05)
        assert info.value.seq_id == 7
