"""Doorbells (kvtransport.doorbell): the shared ring and completion word, and the manager's use of them.

On a GPU host the completion word is stored by the sender's stream after its copies (cudacopy's doorbell
kernel); here a stand-in link stores it from the host when the test says the puts "landed", through the
same manager code, so ordering, de-duplication against SIGNAL frames and slot accounting are checked on CPU.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtransport as kt
from kvtransport import doorbell
from kvtransport.workload.caches import CacheSpec, HostCache, verify_transfer

SPEC = CacheSpec(num_layers=2, num_blocks=16, heads=1, block_size=4, head_dim=8, order="NHD")


def _pair():
    w = doorbell.BellWriter()
    r = doorbell.BellReader(w.path)
    return w, r


def _complete(w: doorbell.BellWriter, ticket: int) -> None:
    ctypes.c_uint64.from_address(w.address + doorbell.WORD_OFFSET).value = ticket


def test_ring_round_trip_and_the_reader_unlinks_the_file():
    w, r = _pair()
    assert not os.path.exists(w.path)  # mapped by the receiver: nothing left in /dev/shm
    assert w.announce("req-1", 0) == 1 and w.announce("req-1", None) == 2 and w.announce(7, 1) == 3
    assert r.landed() == [] and r.in_flight()  # announced, not landed: its copies run
    _complete(w, 2)
    assert r.landed() == [("req-1", 0), ("req-1", None)]
    _complete(w, 3)
    assert r.landed() == [(7, 1)] and r.landed() == [] and not r.in_flight()
    w.close()
    r.close()


def test_frames_and_ring_apply_each_ticket_once_in_any_order():
    w, r = _pair()
    for i in range(1, 6):
        w.announce(f"s{i}", None)
    assert r.frame_applies(2)  # frames of two signalling threads can arrive out of ticket order
    assert r.frame_applies(1) and not r.frame_applies(2) and not r.frame_applies(1)
    _complete(w, 4)
    assert r.landed() == [("s3", None), ("s4", None)]
    assert not r.frame_applies(3) and not r.frame_applies(4)
    assert r.frame_applies(5)
    _complete(w, 5)
    assert r.landed() == []


def test_an_overwritten_or_torn_entry_is_never_applied():
    w, r = _pair()
    for i in range(doorbell.ENTRIES + 1):  # ticket ENTRIES + 1 overwrote ticket 1's entry
        w.announce(f"s{i + 1}", None)
    _complete(w, 3)
    assert r.landed() == []  # stops at ticket 1: its frame will apply it
    assert r.frame_applies(1)
    assert r.landed() == [("s2", None), ("s3", None)]
    off = doorbell.ENTRIES_OFFSET + 3 * doorbell.ENTRY  # ticket 4's slot, half rewritten
    ctypes.c_uint64.from_address(w.address + off + doorbell.ENTRY - 8).value = 99
    _complete(w, 4)
    assert r.landed() == []


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=doorbell.ENTRY, max_size=doorbell.ENTRY), st.integers(1, 3 * doorbell.ENTRIES))
def test_a_hostile_ring_entry_reads_as_nothing_or_a_valid_signal(garbage, ticket):
    """The page is written by the peer: whatever bytes an entry holds, reading it gives None or a well-formed
    (sequence id, layer) — never an exception (layers are range-checked by the manager)."""
    w, r = _pair()
    off = doorbell.ENTRIES_OFFSET + ((ticket - 1) % doorbell.ENTRIES) * doorbell.ENTRY
    m = w._map
    m[off : off + doorbell.ENTRY] = garbage
    if garbage[0] & 1:  # half the time, make the ticket fields match so the body is parsed
        m[off : off + 8] = ticket.to_bytes(8, "little")
        m[off + doorbell.ENTRY - 8 : off + doorbell.ENTRY] = ticket.to_bytes(8, "little")
    got = r.entry(ticket)
    assert got is None or (isinstance(got[0], str | int) and (got[1] is None or isinstance(got[1], int)))
    w.close()
    r.close()


def test_an_entry_whose_sequence_id_is_not_a_str_or_int_is_refused():
    w, r = _pair()
    w.announce("x", None)
    off = doorbell.ENTRIES_OFFSET
    w._map[off + 12 : off + 14] = (3).to_bytes(2, "little")
    w._map[off + 14 : off + 17] = b"[1]"  # valid JSON, not a sequence id
    assert r.entry(1) is None


def test_sequence_ids_too_long_for_an_entry_go_by_frame_only():
    w, _ = _pair()
    assert w.announce("x" * 300, None) == 0
    assert w.announce("short", None) == 1


def test_the_reader_refuses_files_that_are_not_doorbells(tmp_path):
    with pytest.raises(kt.ProtocolError, match="not a kvtransport doorbell"):
        doorbell.BellReader(str(tmp_path / "kvtransport-bell-x"))
    with pytest.raises(kt.ProtocolError, match="not a kvtransport doorbell"):
        doorbell.BellReader("/etc/passwd")


class HostBell:
    """A link's ``doorbell`` on host memory: stores the ticket when the test releases the puts."""

    def __init__(self) -> None:
        self.held = False
        self.pending: list[tuple[int, int]] = []
        self.unmapped: list[int] = []

    def doorbell_map(self, address, size):
        return address  # "device" address == host address

    def doorbell_write(self, device_address, value):
        self.pending.append((device_address, value))
        if not self.held:
            self.release()

    def release(self):
        for addr, value in self.pending:
            ctypes.c_uint64.from_address(addr).value = value
        self.pending.clear()

    def doorbell_unmap(self, address):
        self.unmapped.append(address)


@pytest.fixture
def bell_pair(monkeypatch):
    from kvtransport.testing import inproc

    bell = HostBell()
    monkeypatch.setattr(inproc._OutLink, "doorbell", bell, raising=False)
    src, dst = HostCache(SPEC, fill_seed=4), HostCache(SPEC)
    with kt.open(src.layout, backend="inproc") as s, kt.open(dst.layout, backend="inproc") as r:
        yield s, r, src, dst, bell


def _hold_frames(peer):
    """Keep the sender's SIGNAL frames from leaving until the returned function is called."""
    st = peer._state
    gate = threading.Event()
    orig = st.conn.send_many

    def send_many(frames):
        gate.wait(10)
        return orig(frames)

    st.conn.send_many = send_many
    st._landed = None  # frames leave from the signaller thread (which the gate holds)
    return gate.set


def test_a_receiver_sees_completion_by_doorbell_before_the_frame(bell_pair):
    s, r, src, dst, bell = bell_pair
    peer = s.connect(r.metadata())
    deadline = time.monotonic() + 5
    while not r._receiver.bells and time.monotonic() < deadline:  # the DOORBELL frame is read by the receiver thread
        time.sleep(0.01)
    assert r._receiver.bells, "the receiver did not map the sender's doorbell"
    release_frames = _hold_frames(peer)
    bell.held = True
    s.put_layer(peer, "a", 0, [1, 2], [3, 4])
    s.put_layer(peer, "a", 1, [5], [6])
    s.signal(peer, "a")
    with pytest.raises(kt.TransferTimeout):
        r.wait("a", timeout=0.2)  # frames held, puts not "landed": nothing may complete
    bell.release()  # the device's store after the copies
    r.wait("a", timeout=5)
    assert r.stats()["doorbell_signals"] == 1
    assert verify_transfer(dst, src, {0: [(1, 3), (2, 4)], 1: [(5, 6)]}) == []
    r.release("a")
    release_frames()  # the late SIGNAL frame must neither re-open the slot nor count twice
    s.flush(peer, timeout=5)
    time.sleep(0.2)
    st = r.stats()
    assert st["slots_in_use"] == 0 and st["sequences_completed"] == 1
    assert r.poll() == []


def test_layer_signals_by_doorbell_and_many_requests(bell_pair):
    s, r, _, _, _ = bell_pair
    peer = s.connect(r.metadata())
    for i in range(50):
        seq = f"q{i}"
        s.put_layer(peer, seq, 0, [i % 16], [i % 16])
        s.signal_layer(peer, seq, 0)
        r.wait_layer(seq, 0, timeout=5)
        s.put_layer(peer, seq, 1, [i % 16], [i % 16])
        s.signal(peer, seq)
        r.wait(seq, timeout=5)
        r.release(seq)
    s.flush(peer, timeout=5)
    assert r.stats()["slots_in_use"] == 0


def test_no_doorbell_when_disabled_or_with_checksums(monkeypatch):
    from kvtransport.testing import inproc

    monkeypatch.setattr(inproc._OutLink, "doorbell", HostBell(), raising=False)
    for opts in ({"doorbell": False}, {"checksum": True}):
        src, dst = HostCache(SPEC, fill_seed=4), HostCache(SPEC)
        with kt.open(src.layout, backend="inproc", **opts) as s, kt.open(dst.layout, backend="inproc") as r:
            peer = s.connect(r.metadata())
            assert peer._state._bell is None
            s.put_layer(peer, "a", 0, [1], [1])
            s.signal(peer, "a")
            r.wait("a", timeout=5)
            assert r.stats()["doorbell_signals"] == 0


def test_closing_the_sender_unmaps_its_doorbell(bell_pair):
    s, r, _, _, bell = bell_pair
    peer = s.connect(r.metadata())
    host = peer._state._bell_host
    s.close()
    assert bell.unmapped == [host]


def test_a_failed_doorbell_store_leaves_no_waiter_spinning(bell_pair, monkeypatch):
    s, r, _, _, bell = bell_pair
    peer = s.connect(r.metadata())
    deadline = time.monotonic() + 5
    while not r._receiver.bells and time.monotonic() < deadline:
        time.sleep(0.01)

    def broken(device_address, value):
        raise RuntimeError("store refused")

    monkeypatch.setattr(bell, "doorbell_write", broken)
    s.put_layer(peer, "a", 0, [1], [1])
    s.signal(peer, "a")  # announced on the ring, but no store will come: the frame carries the ticket
    r.wait("a", timeout=5)
    assert peer._state._bell is None  # later signals go by frame only
    (inbound,) = r._receiver.bells
    assert not inbound.bell.in_flight()  # else every waiter would spin on a store that never comes
    s.put_layer(peer, "b", 0, [2], [2])
    s.signal(peer, "b")
    r.wait("b", timeout=5)


def test_no_doorbell_store_after_close_unmapped_the_page(bell_pair):
    """A signal whose store is being enqueued when another thread closes: the page is unmapped only after."""
    s, r, _, _, bell = bell_pair
    peer = s.connect(r.metadata())
    order: list[str] = []
    inside = threading.Event()
    orig_write, orig_unmap = bell.doorbell_write, bell.doorbell_unmap

    def slow_write(address, value):
        order.append("write-begin")
        inside.set()
        time.sleep(0.2)  # a store being enqueued while close() runs on another thread
        orig_write(address, value)
        order.append("write-end")

    bell.doorbell_write = slow_write
    bell.doorbell_unmap = lambda a: (order.append("unmap"), orig_unmap(a))
    t = threading.Thread(target=s.signal, args=(peer, "x"))
    t.start()
    assert inside.wait(5)
    s.close()
    t.join(5)
    assert order == ["write-begin", "write-end", "unmap"]
