"""Per-sequence semaphores: a bounded table of sequence slots with per-layer progress.

The receiving side of a :class:`~kvtransport.CommManager` owns one :class:`SequenceTable`. A sequence takes a
slot when it is first seen (a put/signal from a peer, or a local ``wait``) and keeps it until ``release``.
Each slot records which layers have landed, whether the whole sequence has, and a failure if any. Slot
numbers are reused; a per-slot *generation* counts reuses so late events for an old occupant can be fenced.

Thread-safe. Every wait takes a timeout. A full table raises :class:`SlotsExhausted` at once, never blocks.

Ownership: a sequence belongs to the peer that first claims it (a remote event, or ``expect``); events for it
from another peer raise :class:`ForeignSequence` and change nothing. Share, while two or more senders are
connected (one alone may use every slot): once no more than ``reserve`` (capacity/4) slots are free, a peer
that already holds its share, ``(capacity - reserve) / peers``, gets no new slot (SlotsExhausted); and when the
table is full, a slot asked for locally or by a peer below its share is taken from the peer holding the most,
if that one is above its share: its oldest slot that nobody on this side claimed (``wait``/``expect``) fails
with SlotsExhausted and is freed. So one sender, or a peer making up ids, cannot keep every slot from others.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import (
    CommClosed,
    ConfigurationError,
    ForeignSequence,
    InvalidBlockIds,
    KVTransportError,
    SequenceAborted,
    SlotsExhausted,
    TransferTimeout,
)

SeqId = str | int
"""A sequence (request) id: a string (vLLM request ids) or an integer."""

TOMBSTONES = 4096
BELL_SPIN_S = 0.002
"""A waiter on doorbell completions looks again without sleeping this long from the start of its wait..."""
BELL_POLL_S = 50e-6
"""... then sleeps this long between looks (or less, when a side-channel signal wakes it), doubling while
nothing changes up to BELL_POLL_MAX_S."""
BELL_POLL_MAX_S = 1e-3
BELL_RUNNING_SPIN_S = 0.05
"""A waiter spins while an announced signal's copies run, for at most this long per wait (a store that never
comes, e.g. a sender killed mid-request, must not keep a core busy until the timeout)."""
"""How many released sequence ids are remembered so late remote events for them are dropped."""


@dataclass
class SequenceSlot:
    """State of one sequence on the receiving side (read under the table's lock)."""

    seq_id: SeqId
    slot: int
    generation: int
    peer: str | None = None
    layers: set[int] = field(default_factory=set)
    complete: bool = False
    error: KVTransportError | None = None
    reported: bool = False
    expected: bool = False
    """Claimed on this side (``wait``/``expect``): never taken away from its peer for the share rule."""

    @property
    def finished(self) -> bool:
        return self.complete or self.error is not None


class SequenceTable:
    """Bounded map from sequence id to slot; see the module docstring for the contract."""

    def __init__(self, capacity: int, num_layers: int) -> None:
        if capacity < 1:
            raise ConfigurationError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._by_seq: dict[SeqId, SequenceSlot] = {}
        self._free = list(range(capacity - 1, -1, -1))  # pop() gives the lowest slot
        self._generations = [0] * capacity
        self._tombstones: OrderedDict[SeqId, None] = OrderedDict()
        self._held: dict[str, int] = {}  # remote peer -> slots it owns
        self.reserve = capacity // 4
        self.peers = 1
        """Connected senders (the manager keeps it current): a peer's share is (capacity - reserve) / peers."""
        self._closed: KVTransportError | None = None
        self.poller: Callable[[], int] | None = None
        """Set while some completions arrive by doorbell (kvtransport.doorbell): waiters call it between
        checks, without the table's lock. It returns 2 when it applied something, 1 while an announced
        signal's copies still run (the waiter looks again at once, yielding the GIL), else 0 (the waiter
        sleeps BELL_POLL_S; it also looks again at once during the first BELL_SPIN_S of a wait)."""

    # ---------------------------------------------------------------- slot lifecycle
    def acquire(self, seq_id: SeqId, *, peer: str | None = None, remote: bool = False) -> SequenceSlot | None:
        """Return the slot of ``seq_id``, taking a free one if it has none. Non-blocking.

        ``remote=True`` marks an event from a peer: for a recently released id it returns ``None`` (the
        event must be dropped) instead of reviving the sequence; for an id another peer owns it raises
        :class:`ForeignSequence`. Raises :class:`SlotsExhausted` when full, or when ``peer`` holds its share
        and the free slots are down to the reserve (module docstring).
        """
        with self._cond:
            self._check_open()
            st = self._by_seq.get(seq_id)
            if st is not None:
                if not remote:
                    st.expected = True
                if peer is not None:
                    if st.peer is None:
                        if remote:
                            self._check_share(peer)
                        st.peer = peer
                        self._held[peer] = self._held.get(peer, 0) + 1
                    elif remote and st.peer != peer:
                        raise ForeignSequence(f"sequence {seq_id!r} belongs to another sender", seq_id=seq_id)
                return st
            if remote and seq_id in self._tombstones:
                return None
            if peer is not None and remote:
                self._check_share(peer)
            if not self._free:
                self._evict_for(peer if remote else None)
            if not self._free:
                raise SlotsExhausted(
                    f"all {self.capacity} sequence slots are in use; release() finished sequences or raise "
                    "the capacity (open(..., capacity=N))"
                )
            self._tombstones.pop(seq_id, None)
            slot = self._free.pop()
            self._generations[slot] += 1
            st = SequenceSlot(seq_id, slot, self._generations[slot], peer, expected=not remote)
            self._by_seq[seq_id] = st
            if peer is not None:
                self._held[peer] = self._held.get(peer, 0) + 1
            return st

    def _share(self) -> int:
        return max(1, (self.capacity - self.reserve) // max(1, self.peers))

    def _check_share(self, peer: str) -> None:
        """Under the lock: SlotsExhausted if ``peer`` may not take one more slot now."""
        if self.peers < 2 or len(self._free) > self.reserve:
            return
        held = self._held.get(peer, 0)
        if held >= self._share():
            raise SlotsExhausted(
                f"this sender holds {held} of the receiver's {self.capacity} sequence slots, its share while "
                f"slots are short ({len(self._free)} free); release() finished sequences or raise the capacity"
            )

    def _evict_for(self, requester: str | None) -> None:
        """Under the lock, the table full: free one slot for a local claim (``requester`` None) or for a peer
        below its share, from the peer holding the most if it is above its share (module docstring)."""
        if self.peers < 2 or not self._held:
            return
        share = self._share()
        if requester is not None and self._held.get(requester, 0) >= share:
            return
        hog, held = max(self._held.items(), key=lambda kv: kv[1])
        if held <= share or hog == requester:
            return
        victim = next((st for st in self._by_seq.values() if st.peer == hog and not st.expected), None)
        if victim is None:
            return
        victim.error = SlotsExhausted(f"sequence {victim.seq_id!r} was dropped: its sender held {held} of the "
                                      f"receiver's {self.capacity} slots, more than its share ({share}), and "
                                      "another needed one")
        self._cond.notify_all()
        self._remove(victim.seq_id)

    def release(self, seq_id: SeqId) -> bool:
        """Free the slot of ``seq_id`` (waiters get :class:`SequenceAborted` if it had not finished).

        Returns whether the id held a slot. Late remote events for it are dropped afterwards.
        """
        with self._cond:
            st = self._remove(seq_id)
            if st is None:
                return False
            if not st.finished:
                st.error = SequenceAborted(f"sequence {seq_id!r} was released before it completed")
            self._cond.notify_all()
            return True

    def _remove(self, seq_id: SeqId) -> SequenceSlot | None:
        """Under the lock: forget ``seq_id`` (tombstoned: late remote events are dropped), free its slot."""
        st = self._by_seq.pop(seq_id, None)
        if st is not None and st.peer is not None:
            left = self._held.get(st.peer, 0) - 1
            if left > 0:
                self._held[st.peer] = left
            else:
                self._held.pop(st.peer, None)
        self._tombstones[seq_id] = None
        self._tombstones.move_to_end(seq_id)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        if st is not None:
            self._free.append(st.slot)
            self._free.sort(reverse=True)
        return st

    # ---------------------------------------------------------------- progress
    def mark_layer(self, seq_id: SeqId, layer: int, *, peer: str | None = None) -> None:
        """Record that ``layer`` of ``seq_id`` has landed (from the receive path)."""
        with self._cond:
            st = self._remote_slot(seq_id, peer)
            if st is not None and not st.finished:
                st.layers.add(layer)
                self._cond.notify_all()

    def mark_complete(self, seq_id: SeqId, *, peer: str | None = None) -> None:
        """Record that every put of ``seq_id`` has landed."""
        with self._cond:
            st = self._remote_slot(seq_id, peer)
            if st is not None and not st.finished:
                st.complete = True
                st.layers.update(range(self.num_layers))
                self._cond.notify_all()

    def mark_many(
        self, events: list[tuple[SeqId, int | None]], *, peer: str | None = None
    ) -> list[tuple[SeqId, int | None, SlotsExhausted | ForeignSequence]]:
        """Apply several landed events in order: ``(seq_id, layer)`` as :meth:`mark_layer`, ``(seq_id, None)``
        as :meth:`mark_complete`; one lock round and one wake-up for all. Returns the events refused (no slot
        for them, or a sequence that another peer owns), with their error; the others are applied."""
        refused: list[tuple[SeqId, int | None, SlotsExhausted | ForeignSequence]] = []
        changed = False
        with self._cond:
            for seq_id, layer in events:
                try:
                    st = self._remote_slot(seq_id, peer)
                except (SlotsExhausted, ForeignSequence) as exc:
                    refused.append((seq_id, layer, exc))
                    continue
                if st is None or st.finished:
                    continue
                if layer is None:
                    st.complete = True
                    st.layers.update(range(self.num_layers))
                else:
                    st.layers.add(layer)
                changed = True
            if changed:
                self._cond.notify_all()
        return refused

    def fail(self, seq_id: SeqId, error: KVTransportError) -> None:
        """Fail ``seq_id`` if it is in the table and not finished."""
        with self._cond:
            st = self._by_seq.get(seq_id)
            if st is not None and not st.finished:
                st.error = error
                self._cond.notify_all()

    def fail_peer(self, peer: str, error: KVTransportError) -> list[SeqId]:
        """Fail every unfinished sequence that came from ``peer``; returns their ids."""
        with self._cond:
            failed = [s.seq_id for s in self._by_seq.values() if s.peer == peer and not s.finished]
            for seq in failed:
                self._by_seq[seq].error = error
            if failed:
                self._cond.notify_all()
            return failed

    def _remote_slot(self, seq_id: SeqId, peer: str | None) -> SequenceSlot | None:
        try:
            return self.acquire(seq_id, peer=peer, remote=True)
        except CommClosed:
            return None

    # ---------------------------------------------------------------- waiting
    def wait(self, seq_id: SeqId, timeout: float) -> None:
        """Block until every put of ``seq_id`` has landed. Raises TransferTimeout or the sequence's error."""
        self._wait(seq_id, None, timeout)

    def wait_layer(self, seq_id: SeqId, layer: int, timeout: float) -> None:
        """Block until ``layer`` of ``seq_id`` has landed (or the whole sequence). Same errors as wait."""
        if not 0 <= layer < self.num_layers:
            raise InvalidBlockIds(f"layer {layer} out of range [0, {self.num_layers})")
        self._wait(seq_id, layer, timeout)

    def _wait(self, seq_id: SeqId, layer: int | None, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        spin_until = start + BELL_SPIN_S
        running_until = start + BELL_RUNNING_SPIN_S
        interval = BELL_POLL_S
        with self._cond:
            st = self.acquire(seq_id)
            assert st is not None
            while True:
                # what landed stays landed: a later failure (e.g. the peer leaving) does not undo it
                if st.complete or (layer is not None and layer in st.layers):
                    return
                if st.error is not None:
                    raise st.error
                self._check_open()
                left = deadline - time.monotonic()
                if left <= 0:
                    what = f"layer {layer} of sequence" if layer is not None else "sequence"
                    raise TransferTimeout(
                        f"{what} {seq_id!r} did not land within {timeout:.3g}s "
                        f"(layers landed: {len(st.layers)}/{self.num_layers})", seq_id=seq_id
                    )
                poller = self.poller
                if poller is None:
                    self._cond.wait(left)
                    continue
                self._cond.release()  # held once (``with``): the poller takes the table's lock to apply
                try:
                    state = poller()
                    now = time.monotonic()
                    spin = (state == 1 and now < running_until) or (state == 0 and now < spin_until)
                    if spin:
                        os.sched_yield()  # lets other threads run (time.sleep(0) would sleep ~55 µs of timer slack)
                finally:
                    self._cond.acquire()
                if state == 2 or spin:
                    interval = BELL_POLL_S
                else:
                    self._cond.wait(min(left, interval))
                    interval = min(2 * interval, BELL_POLL_MAX_S)

    def poll(self) -> list[SeqId]:
        """Ids that reached a final state (complete or failed) since the last poll. Non-blocking."""
        with self._cond:
            out = [s.seq_id for s in self._by_seq.values() if s.finished and not s.reported]
            for seq in out:
                self._by_seq[seq].reported = True
            return out

    def get(self, seq_id: SeqId) -> SequenceSlot | None:
        with self._cond:
            return self._by_seq.get(seq_id)

    @property
    def in_use(self) -> int:
        with self._cond:
            return len(self._by_seq)

    def close(self, error: KVTransportError) -> None:
        """Wake every waiter with ``error``; further calls raise it. Idempotent."""
        with self._cond:
            if self._closed is None:
                self._closed = error
            self._cond.notify_all()

    def _check_open(self) -> None:
        if self._closed is not None:
            raise self._closed
