"""The per-sequence semaphore table: unit tests and a hypothesis state machine."""

import threading
import time

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvtransport import CommClosed, PeerDisconnected, SequenceAborted, SlotsExhausted, TransferTimeout
from kvtransport.semaphores import SequenceTable


def test_wait_returns_after_complete_from_another_thread():
    t = SequenceTable(4, num_layers=3)
    threading.Timer(0.05, t.mark_layer, args=("a", 1)).start()
    threading.Timer(0.1, t.mark_complete, args=("a",)).start()
    t.wait_layer("a", 1, timeout=5)
    t.wait("a", timeout=5)
    assert t.poll() == ["a"]
    assert t.poll() == []


def test_timeout_is_bounded():
    t = SequenceTable(1, 1)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        t.wait("x", timeout=0.2)
    assert 0.19 <= time.monotonic() - t0 < 1.0


def test_exhaustion_is_immediate_and_release_reuses_slot():
    t = SequenceTable(2, 1)
    a, b = t.acquire("a"), t.acquire("b")
    assert {a.slot, b.slot} == {0, 1}
    with pytest.raises(SlotsExhausted, match="capacity"):
        t.acquire("c")
    t.release("a")
    c = t.acquire("c")
    assert c.slot == a.slot and c.generation == a.generation + 1


def test_release_wakes_waiter_with_aborted():
    t = SequenceTable(2, 1)
    t.acquire("a")
    threading.Timer(0.05, t.release, args=("a",)).start()
    with pytest.raises(SequenceAborted):
        t.wait("a", timeout=5)


def test_late_remote_event_after_release_is_dropped():
    t = SequenceTable(2, 1)
    t.acquire("a")
    t.release("a")
    assert t.acquire("a", remote=True) is None
    t.mark_complete("a")  # dropped, does not take a slot
    assert t.in_use == 0


def test_peer_failure_and_close():
    t = SequenceTable(4, 2)
    t.acquire("a", peer="p1")
    t.acquire("b", peer="p2")
    assert t.fail_peer("p1", PeerDisconnected("gone")) == ["a"]
    with pytest.raises(PeerDisconnected):
        t.wait("a", timeout=1)
    threading.Timer(0.05, t.close, args=(CommClosed("closed"),)).start()
    with pytest.raises(CommClosed):
        t.wait("b", timeout=5)


class TableMachine(RuleBasedStateMachine):
    """Model: a dict of seq -> (layers landed, complete, aborted); capacity bounded."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.capacity = 3
        self.layers = 3
        self.table = SequenceTable(self.capacity, self.layers)
        self.model: dict[str, dict] = {}

    @rule(target=seqs, name=st.sampled_from(["a", "b", "c", "d", "e"]))
    def acquire(self, name):
        if name not in self.model and len(self.model) >= self.capacity:
            with pytest.raises(SlotsExhausted):
                self.table.acquire(name)
        else:
            self.table.acquire(name)
            self.model.setdefault(name, {"layers": set(), "complete": False})
        return name

    @rule(name=seqs, layer=st.integers(0, 2))
    def signal_layer(self, name, layer):
        if name in self.model:
            self.table.mark_layer(name, layer)
            if not self.model[name]["complete"]:
                self.model[name]["layers"].add(layer)

    @rule(name=seqs)
    def signal_complete(self, name):
        if name in self.model:
            self.table.mark_complete(name)
            self.model[name]["complete"] = True

    @rule(name=seqs, layer=st.integers(0, 2))
    def wait_layer(self, name, layer):
        if name not in self.model:
            return
        m = self.model[name]
        if m["complete"] or layer in m["layers"]:
            self.table.wait_layer(name, layer, timeout=0.5)
        else:
            with pytest.raises(TransferTimeout):
                self.table.wait_layer(name, layer, timeout=0.01)

    @rule(name=seqs)
    def wait(self, name):
        if name not in self.model:
            return
        if self.model[name]["complete"]:
            self.table.wait(name, timeout=0.5)
        else:
            with pytest.raises(TransferTimeout):
                self.table.wait(name, timeout=0.01)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data):
        name = data.draw(st.sampled_from(sorted(self.model)))
        assert self.table.release(name)
        del self.model[name]

    @invariant()
    def slots_match_model(self):
        assert self.table.in_use == len(self.model)
        slots = [self.table.get(s).slot for s in self.model]
        assert len(set(slots)) == len(slots)
        assert all(0 <= s < self.capacity for s in slots)


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = __import__("hypothesis").settings(max_examples=100, stateful_step_count=30, deadline=None)


def test_landed_layer_survives_a_later_peer_failure():
    t = SequenceTable(2, 2)
    t.mark_layer("a", 0, peer="p")
    t.fail_peer("p", PeerDisconnected("gone"))
    t.wait_layer("a", 0, timeout=0.1)  # layer 0 landed before the peer left
    with pytest.raises(PeerDisconnected):
        t.wait_layer("a", 1, timeout=0.1)
    with pytest.raises(PeerDisconnected):
        t.wait("a", timeout=0.1)


def test_a_peer_alone_may_use_every_slot_but_gives_them_up_to_a_newcomer() -> None:
    """One sender connected: every slot is usable. A second one connects while the first holds them all
    (say, ids it made up that nobody waits for): the newcomer's first slot is taken from the first peer's
    oldest unclaimed sequence, which fails with SlotsExhausted; the first peer gets no more."""
    from kvtransport.errors import SlotsExhausted
    from kvtransport.semaphores import SequenceTable

    t = SequenceTable(8, 2)
    for i in range(8):
        t.acquire(f"junk-{i}", peer="A", remote=True)
    assert t.in_use == 8
    t.peers = 2  # the legitimate sender connects
    st = t.acquire("real", peer="L", remote=True)
    assert st is not None and st.peer == "L" and t.get("junk-0") is None and t.in_use == 8
    with pytest.raises(SlotsExhausted, match="its share"):
        t.acquire("junk-8", peer="A", remote=True)
    t.acquire("local-wait")  # a local claim finds a slot too (from A, which is still above its share)
    assert t.get("junk-1") is None


def test_claimed_slots_are_never_taken_for_the_share() -> None:
    from kvtransport.errors import SlotsExhausted
    from kvtransport.semaphores import SequenceTable

    t = SequenceTable(4, 1)
    for i in range(4):
        t.acquire(f"e{i}", peer="A")  # expected (claimed on this side) for A
    t.peers = 2
    with pytest.raises(SlotsExhausted):
        t.acquire("x", peer="L", remote=True)
    assert t.in_use == 4
