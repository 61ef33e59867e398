"""The pusher (kvtransport_vllm.pusher) alone: which puts, signals, flushes and disconnects it issues, with which
arguments, and what a failure, a cap or a delay leaves behind — exact values, against a CommManager that records
every call.

Each test stops the pusher's own thread first and runs its jobs on the test's thread (``Pusher._do`` and the
methods it calls), so every job happens exactly when the test says; a connect still runs on a connect thread of
its own, and the test hands its outcome to the pusher (``pump``). The transfers themselves are tested over real
backends in test_worker_connector.py; here the recording CommManager stands in for the transport so that the
pusher's bookkeeping can be asserted call by call. Pure Python (no vLLM engine, no torch tensors)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

pusher_mod = pytest.importorskip("kvtransport_vllm.pusher", reason="kvtransport-vllm is not installed")
from kvtransport_vllm.metadata import Bind, Push, SendFailure, SourceStep  # noqa: E402

import kvtransport  # noqa: E402

Pusher = pusher_mod.Pusher
TIMEOUT = 2.0  # the pusher's connect/flush timeout in these tests


class FakePeer:
    """A connected link as the recording CommManager hands it out: named after the metadata it was made from."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = "recorded"


class RecordingCM:
    """Records every sender call as a tuple (the peer by name, sequences as lists turned into tuples); ``fail``:
    call name -> the error that call raises (after being recorded); ``gate``: connects wait for it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, Exception] = {}
        self.gate = threading.Event()
        self.gate.set()

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        exc = self.fail.get(name)
        if exc is not None:
            raise exc

    def connect(self, meta: bytes, timeout: float) -> FakePeer:
        assert self.gate.wait(10)
        self._call("connect", meta.decode())
        return FakePeer(meta.decode())

    def put_layer(self, peer: FakePeer, seq: str, layer: int, src: Any, dst: Any) -> None:
        self._call("put_layer", peer.name, seq, layer, tuple(src), tuple(dst))

    def put_layers(self, peer: FakePeer, seq: str, layers: Any, src: Any, dst: Any) -> None:
        self._call("put_layers", peer.name, seq, tuple(layers), tuple(src), tuple(dst))

    def put_runs(self, peer: FakePeer, seq: str, layers: Any, runs: Any) -> None:
        self._call("put_runs", peer.name, seq, tuple(layers), tuple(runs))

    def signal_layer(self, peer: FakePeer, seq: str, layer: int) -> None:
        self._call("signal_layer", peer.name, seq, layer)

    def signal(self, peer: FakePeer, seq: str) -> None:
        self._call("signal", peer.name, seq)

    def flush(self, peer: FakePeer, timeout: float) -> None:
        self._call("flush", peer.name, timeout)

    def disconnect(self, peer: FakePeer) -> None:
        self._call("disconnect", peer.name)

    def sent(self) -> list[tuple[Any, ...]]:
        """The calls other than connects."""
        return [c for c in self.calls if c[0] != "connect"]


def stopped_pusher(cm: RecordingCM, layers: int = 4, timeout: float = TIMEOUT, **kw: Any) -> Any:
    """A pusher whose thread has stopped (the test runs its jobs): tp rank 0, 4-token blocks."""
    kw.setdefault("block_size", 4)
    p = Pusher(cm, 0, layers, timeout, **kw)
    p.close()
    assert not p.thread.is_alive()
    return p


def pump(p: Any, n: int = 1) -> None:
    """Run the next ``n`` jobs the pusher's queue receives (a connect thread's outcome) on this thread."""
    for _ in range(n):
        p._do(p.q.get(timeout=10))


def connected(p: Any, *engines: str) -> None:
    """Introduce ``engines`` (rank 0 each, metadata ``<engine>0``) and connect them, in this order."""
    for e in engines:
        p._peers({e: {0: f"{e}0".encode()}}, {e: [0]}, {}, {})
        pump(p)
    assert list(p.peers) == [(e, 0) for e in engines]


def source(req: str = "r", xfer: str = "x", prompt_len: int = 8, groups: tuple[tuple[int, ...], ...] = ((1, 2),),
           start: int = 0, stop: int | None = None, delay: float = 0.0) -> SourceStep:
    return SourceStep(req, xfer, prompt_len, groups, start, prompt_len if stop is None else stop, delay=delay)


def forward(p: Any, *sources: SourceStep, binds: tuple[Bind, ...] = ()) -> None:
    """One engine step of ``sources`` on the pusher: the plan (with ``binds``), every layer, the step's end."""
    p._do(("plan", list(sources), list(binds), [], []))
    for layer in range(p.num_layers):
        p._do(("layer", layer, None))
    p._do(("step_end", None))


def push(seq: str = "s", engine: str = "D", req: str = "r", delay: float = 0.0, base: str = "") -> Push:
    return Push(req, seq, engine, (1, 2), (5, 6), delay=delay, base=base)


# ---------------------------------------------------------------- what goes out, with which arguments
def test_a_late_destination_gets_each_groups_computed_layers_in_one_put_then_its_signal() -> None:
    """Two KV cache groups (layers 0, 2 and 1, 3), the prompt computed, then a decode's destination straight from
    it: one put_layers per group, with that group's blocks on both sides, then one "whole" signal."""
    cm = RecordingCM()
    p = stopped_pusher(cm, group_of=[0, 1, 0, 1], block_size=4)
    connected(p, "D")
    forward(p, source(groups=((1, 2), (11, 12))))
    p._do(("msg", "D", {"type": "dst", "xfer": "x",
                        "dsts": [{"seq": "s", "blocks": [5, 6], "offset": 0, "groups": [[15, 16]]}]}))
    assert cm.sent() == [("put_layers", "D0", "s", (0, 2), (1, 2), (5, 6)),
                         ("put_layers", "D0", "s", (1, 3), (11, 12), (15, 16)),
                         ("signal", "D0", "s")]
    assert (p.sent_whole, p.sent_layerwise, p.direct_unknown) == (1, 0, 0)


def test_a_destination_known_before_the_forward_gets_each_layer_by_put_layer_and_its_layer_signal() -> None:
    """Bound with the plan, before the last (only) chunk: each layer goes by put_layer as the forward reaches it,
    followed by that layer's signal; the sequence's signal after the last layer ("layerwise")."""
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=2)
    connected(p, "D")
    forward(p, source(), binds=(Bind("x", "D", "s", (5, 6)),))
    assert cm.sent() == [("put_layer", "D0", "s", 0, (1, 2), (5, 6)), ("signal_layer", "D0", "s", 0),
                         ("put_layer", "D0", "s", 1, (1, 2), (5, 6)), ("signal_layer", "D0", "s", 1),
                         ("signal", "D0", "s")]
    assert (p.sent_whole, p.sent_layerwise) == (0, 1)


def test_puts_and_signals_that_waited_for_the_connect_go_in_order_as_they_were_asked() -> None:
    """The destination's link is still connecting when the forward runs: its layer puts (with their layer
    signals) and the final signal wait in its backlog and go in that order, unchanged, once connected."""
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm, layers=2)
    p._peers({"D": {0: b"D0"}}, {}, {}, {})  # introduced, not connected yet
    forward(p, source(), binds=(Bind("x", "D", "s", (5, 6)),))
    assert cm.calls == [] and len(p.connecting[("D", 0)]) == 3  # two layer puts, the signal
    cm.gate.set()
    pump(p)
    assert cm.calls == [("connect", "D0"),
                        ("put_layer", "D0", "s", 0, (1, 2), (5, 6)), ("signal_layer", "D0", "s", 0),
                        ("put_layer", "D0", "s", 1, (1, 2), (5, 6)), ("signal_layer", "D0", "s", 1),
                        ("signal", "D0", "s")]
    assert (p.sent_whole, p.sent_layerwise) == (0, 1)


def test_a_whole_signal_that_waited_for_the_connect_is_counted_whole() -> None:
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    p._peers({"D": {0: b"D0"}}, {}, {}, {})
    p._signal(push(), "whole")
    cm.gate.set()
    pump(p)
    assert cm.sent() == [("signal", "D0", "s")]
    assert (p.sent_whole, p.sent_layerwise) == (1, 0)


def test_signals_are_counted_by_kind_and_traced_with_their_request(monkeypatch) -> None:
    events: list[tuple[Any, ...]] = []
    monkeypatch.setattr(pusher_mod.trace, "event", lambda ev, key, **f: events.append((ev, key, f)))
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "D")
    for i, kind in enumerate(["whole", "layerwise", "whole", "layerwise", "layerwise"]):
        p._signal(push(f"s{i}", req=f"r{i}"), kind)
    assert (p.sent_whole, p.sent_layerwise) == (2, 3)
    assert events == [("p.signal", "s0", {"req": "r0", "kind": "whole"}),
                      ("p.signal", "s1", {"req": "r1", "kind": "layerwise"}),
                      ("p.signal", "s2", {"req": "r2", "kind": "whole"}),
                      ("p.signal", "s3", {"req": "r3", "kind": "layerwise"}),
                      ("p.signal", "s4", {"req": "r4", "kind": "layerwise"})]


def test_a_held_back_signal_waits_its_delay_while_an_undelayed_one_goes_at_once(monkeypatch) -> None:
    """debug_push_delay: a signal with a delay (here half a second) is held back until it is due; one without
    goes now."""
    clock = [100.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "D")
    held, now = push("held", delay=0.5), push("now")
    p._signal_later("layerwise", [held, now])
    assert cm.sent() == [("signal", "D0", "now")]
    assert p.delayed == [(100.5, "layerwise", [held])] and p._idle_timeout() == 0.5
    clock[0] = 100.49
    p._housekeeping()
    assert cm.sent() == [("signal", "D0", "now")]
    clock[0] = 100.5
    p._housekeeping()
    assert cm.sent() == [("signal", "D0", "now"), ("signal", "D0", "held")] and p.delayed == []


# ---------------------------------------------------------------- failures
def test_a_push_that_cannot_be_mapped_fails_its_destination_with_the_reason_and_the_next_goes_on() -> None:
    """``expand`` cannot map s1's push (an unlike decode's geometry it cannot serve): s1's destination fails with
    the reason, once per op that needed it; s2's push in the same ops still goes."""
    cm = RecordingCM()

    def expand(p: Push, geo: Any) -> list[Push]:
        if p.seq == "s1":
            raise ValueError("no such rank")
        return [p]

    p = stopped_pusher(cm, layers=1, expand=expand)
    connected(p, "D")
    forward(p, source())
    p._do(("plan", [], [Bind("x", "D", "s1", (5, 6)), Bind("x", "D", "s2", (7, 8))], [], []))
    reason = "cannot map the KV of r onto decode engine D: no such rank"
    assert p.take() == (set(), [SendFailure("s1", "D", reason), SendFailure("s1", "D", reason)])
    assert cm.sent() == [("put_layer", "D0", "s2", 0, (1, 2), (7, 8)), ("signal", "D0", "s2")]


def test_a_signal_that_finds_the_peer_gone_fails_its_sequence_once_and_drops_the_link() -> None:
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "D")
    gone = kvtransport.PeerDisconnected("the decode went away")
    cm.fail["signal"] = gone
    p._signal(push(base="dreq"), "whole")
    reason = "PeerDisconnected: the decode went away"
    assert p.take() == (set(), [SendFailure("dreq", "D", reason)])
    assert p.failed_seqs == {"s": reason}
    assert cm.sent() == [("signal", "D0", "s"), ("disconnect", "D0")] and ("D", 0) not in p.peers
    p._signal(push(base="dreq"), "whole")  # failed already: nothing more to it, nothing reported again
    p._put(push(), (0,))
    assert cm.sent() == [("signal", "D0", "s"), ("disconnect", "D0")] and p.take() == (set(), [])
    assert (p.sent_whole, p.sent_layerwise) == (0, 0)


def test_a_put_refused_by_the_receiver_fails_its_sequence_but_keeps_the_link() -> None:
    """An error of one sequence (the decode has no free slot) is not the link's: other sequences still go."""
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "D")
    cm.fail["put_layer"] = kvtransport.SlotsExhausted("no free slot")
    p._put(push("s1"), (0,))
    del cm.fail["put_layer"]
    p._put(push("s2"), (0,))
    assert p.take() == (set(), [SendFailure("s1", "D", "SlotsExhausted: no free slot")])
    assert cm.sent() == [("put_layer", "D0", "s1", 0, (1, 2), (5, 6)), ("put_layer", "D0", "s2", 0, (1, 2), (5, 6))]
    assert list(p.peers) == [("D", 0)]


def test_failed_sequences_are_remembered_up_to_4096_the_oldest_forgotten_first() -> None:
    p = stopped_pusher(RecordingCM())
    for i in range(4097):
        p._failed(f"s{i}", f"why {i}")
    assert len(p.failed_seqs) == 4096
    assert next(iter(p.failed_seqs.items())) == ("s1", "why 1") and p.failed_seqs["s4096"] == "why 4096"


def test_a_refused_decode_engines_pushes_fail_once_with_the_refusal() -> None:
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=1)
    why = "refused: its block size 3 does not divide ours"
    p._peers({"D": {0: b"D0"}}, {"D": [0]}, {}, {"D": why})
    forward(p, source(), binds=(Bind("x", "D", "s", (5, 6)),))
    assert p.take() == (set(), [SendFailure("s", "D", why)]) and p.failed_seqs == {"s": why}
    assert cm.calls == []


def test_a_failed_step_fails_every_live_destination_of_every_source_once() -> None:
    """A job of the step's push path raised: the destinations of each of the step's sources fail, except one the
    decode cancelled and one failed already (each told once)."""
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=1)
    connected(p, "D")
    binds = [Bind("x1", "D", "cancelled", (5, 6)), Bind("x1", "D", "a", (7, 8)), Bind("x2", "D", "b", (9, 10)),
             Bind("x2", "D", "failed", (11, 12))]
    p._do(("plan", [source("r1", "x1"), source("r2", "x2")], binds, [], []))
    p.planner.cancel("x1", "cancelled")
    p._failed("failed", "earlier")
    p._fail_step(list(p.planner.active), "the step broke")
    assert p.take() == (set(), [SendFailure("a", "D", "the step broke"), SendFailure("b", "D", "the step broke")])
    assert p.failed_seqs == {"failed": "earlier", "a": "the step broke", "b": "the step broke"}


# ---------------------------------------------------------------- links: backoff, backlog, caps
def test_a_reconnect_backoff_is_remembered_with_why_until_ten_seconds_on(monkeypatch) -> None:
    clock = [50.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    p = stopped_pusher(RecordingCM())
    p.peer_meta["D"] = {0: b"D0"}
    p._backoff(("D", 0), "refused")
    assert p.broken == {("D", 0): (60.0, "refused")}
    clock[0] = 59.99
    assert p._start_connect(("D", 0)) == "decode engine D unreachable: refused"
    clock[0] = 60.0
    assert p._start_connect(("D", 0)) is None and ("D", 0) in p.connecting


def test_reconnect_backoffs_are_bounded_expired_first_then_the_oldest(monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pusher_mod, "MAX_BROKEN", 3)
    p = stopped_pusher(RecordingCM())
    for i, e in enumerate("abc"):
        clock[0] = float(i)
        p._backoff((e, 0), e)
    assert list(p.broken) == [("a", 0), ("b", 0), ("c", 0)]  # exactly MAX_BROKEN kept
    p._backoff(("a", 0), "again")  # a backoff renewed goes last
    clock[0] = 3.0
    p._backoff(("d", 0), "d")  # none expired: the oldest (b) goes
    assert list(p.broken) == [("c", 0), ("a", 0), ("d", 0)]
    assert p.broken[("a", 0)] == (12.0, "again")
    clock[0] = 12.0  # c (until 12) and a (until 12) expire now, exactly
    p._backoff(("e", 0), "e")
    assert list(p.broken) == [("d", 0), ("e", 0)]


def test_expired_backoffs_go_once_MAX_BROKEN_are_held(monkeypatch) -> None:
    """Expired backoffs are swept when the books are full (MAX_BROKEN, 3 here), not before."""
    clock = [0.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pusher_mod, "MAX_BROKEN", 3)
    p = stopped_pusher(RecordingCM())
    p._backoff(("a", 0), "a")  # until 10
    clock[0] = 11.0
    p._backoff(("b", 0), "b")
    p._backoff(("c", 0), "c")
    assert list(p.broken) == [("a", 0), ("b", 0), ("c", 0)]
    p._backoff(("d", 0), "d")
    assert list(p.broken) == [("b", 0), ("c", 0), ("d", 0)]


def test_a_connect_the_decode_keeps_breaking_off_fails_the_puts_that_waited_for_it() -> None:
    """Every connect attempt breaks off (PeerDisconnected) until the connect timeout: the puts that waited fail
    with that error, the link backs off and no link is left behind."""
    cm = RecordingCM()
    cm.fail["connect"] = kvtransport.PeerDisconnected("the decode hung up")
    p = stopped_pusher(cm, timeout=0.3)
    p._peers({"D": {0: b"D0"}}, {}, {}, {})
    p._put(push("s1"), (0,))
    pump(p)
    assert p.take() == (set(), [SendFailure("s1", "D", "PeerDisconnected: the decode hung up")])
    assert not p.peers and not p.connecting and set(p.broken) == {("D", 0)}
    assert set(cm.calls) == {("connect", "D0")} and len(cm.calls) >= 2  # tried again before giving up


def test_a_connecting_destination_holds_at_most_MAX_BACKLOG_puts(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_BACKLOG", 2)
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    p._peers({"D": {0: b"D0"}}, {}, {}, {})
    for seq in ("s1", "s2", "s3"):
        p._put(push(seq), (0,))
    assert p.take() == (set(), [SendFailure("s3", "D", "KVTransportError: decode engine D: 2 puts wait for its "
                                                        "connect")])
    cm.gate.set()
    pump(p)
    assert cm.sent() == [("put_layer", "D0", "s1", 0, (1, 2), (5, 6)), ("put_layer", "D0", "s2", 0, (1, 2), (5, 6))]


def test_a_put_that_needs_a_link_closes_the_least_recently_used_idle_one(monkeypatch, caplog) -> None:
    """MAX_LINKS (3 here) links held: a put to a fourth decode closes the least recently used link no unreleased
    request put through — not A (least recently used, but an unreleased request put through it), not B (used
    since) — and opens its own."""
    monkeypatch.setattr(pusher_mod, "MAX_LINKS", 3)
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "A", "C", "B")
    p.touched["ra"].add(("A", 0))  # ra is not released: A is busy
    p._put(push("b", engine="B", req="rb"), (0,))
    p.touched.pop("rb")  # rb released: B idle, but used after C
    p.peer_meta["E"] = {0: b"E0"}
    with caplog.at_level(logging.INFO, logger="vllm.kvtransport"):
        p._put(push("e", engine="E", req="re"), (0,))
    assert [r.getMessage() for r in caplog.records if "idle link" in r.getMessage()] == [
        "kvtransport: closed the idle link to decode engine C rank 0 (MAX_LINKS links held)"]
    assert [r.levelno for r in caplog.records if "idle link" in r.getMessage()] == [logging.INFO]
    assert cm.sent()[-1] == ("disconnect", "C0") and list(p.peers) == [("A", 0), ("B", 0)]
    assert ("E", 0) in p.connecting and p.take() == (set(), [])
    pump(p)
    assert cm.sent()[-1] == ("put_layer", "E0", "e", 0, (1, 2), (5, 6)) and ("E", 0) in p.peers


def test_a_put_that_needs_a_link_when_every_link_is_busy_fails_with_the_cap(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_LINKS", 2)
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "A", "B")
    p._put(push("a", engine="A", req="ra"), (0,))
    p._put(push("b", engine="B", req="rb"), (0,))
    p.peer_meta["E"] = {0: b"E0"}
    p._put(push("e", engine="E", req="re"), (0,))
    assert p.take() == (set(), [SendFailure("e", "E", "KVTransportError: capped: this prefill worker holds 2 links "
                                                      "to decode workers, none idle (MAX_LINKS: serve fewer decode "
                                                      "engines per prefill, or run them like-for-like, one link "
                                                      "each)")])
    assert list(p.peers) == [("A", 0), ("B", 0)] and not p.connecting
    assert [c[0] for c in cm.sent()] == ["put_layer", "put_layer"]


# ---------------------------------------------------------------- releases
def test_a_release_flushes_every_link_its_request_put_through_then_finishes() -> None:
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=1)
    connected(p, "A", "B")
    forward(p, source(), binds=(Bind("x", "A", "sa", (5, 6)), Bind("x", "B", "sb", (7, 8))))
    p._do(("release", "r"))
    p._housekeeping()
    flushes = sorted(c for c in cm.sent() if c[0] == "flush")
    assert flushes == [("flush", "A0", TIMEOUT), ("flush", "B0", TIMEOUT)]
    assert p.take() == ({"r"}, []) and p.releasing == [] and "r" not in p.touched
    assert "r" not in p.planner.by_req and "x" not in p.planner.sources


def test_a_flush_that_fails_drops_its_link_and_the_request_still_finishes() -> None:
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=1)
    connected(p, "A", "B")
    forward(p, source(), binds=(Bind("x", "A", "sa", (5, 6)),))
    cm.fail["flush"] = kvtransport.PeerDisconnected("gone")
    p._do(("release", "r"))
    p._housekeeping()
    assert list(p.peers) == [("B", 0)] and p.take() == ({"r"}, [])


def test_a_release_flushes_the_connected_links_even_when_others_never_connected(monkeypatch) -> None:
    """A request that put through 64 links, 63 of which failed to connect: the one connected is still flushed
    (whatever the order of the request's links)."""
    cm = RecordingCM()
    cm.fail["connect"] = kvtransport.KVTransportError("refused")
    p = stopped_pusher(cm, layers=1)
    connected_link = ("D", 0)
    p.peers[connected_link] = FakePeer("D0")
    for i in range(63):
        p.peer_meta[f"X{i}"] = {0: f"X{i}".encode()}
        p._put(push(f"x{i}", engine=f"X{i}"), (0,))
        pump(p)
    p._put(push("d"), (0,))
    assert len(p.touched["r"]) == 64
    p._do(("release", "r"))
    p._housekeeping()
    assert [c for c in cm.sent() if c[0] == "flush"] == [("flush", "D0", TIMEOUT)] and p.take()[0] == {"r"}


# ---------------------------------------------------------------- the destination channel
def test_direct_destinations_from_an_engine_not_introduced_yet_are_counted_and_ignored() -> None:
    cm = RecordingCM()
    p = stopped_pusher(cm)
    msg = {"type": "dst", "xfer": "x", "dsts": [{"seq": "s", "blocks": [5, 6], "offset": 0}]}
    p._direct("U", msg)
    p._direct("U", msg)
    assert p.direct_unknown == 2 and not p.planner.pending and cm.calls == []


def test_a_direct_message_without_destinations_or_of_another_type_binds_nothing() -> None:
    p = stopped_pusher(RecordingCM())
    p.peer_meta["D"] = {0: b"D0"}
    p._direct("D", {"type": "dst", "xfer": "x"})
    p._direct("D", {"type": "hello", "xfer": "x", "dsts": [{"seq": "s", "blocks": [5], "offset": 0}]})
    assert not p.planner.pending and p.planner.counts["before"] == 0


def test_an_early_direct_destination_expires_after_the_lease(monkeypatch, caplog) -> None:
    """A destination whose prefill request never reaches this worker waits ``lease`` seconds, then is dropped with
    a warning naming it."""
    clock = [10.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    p = stopped_pusher(RecordingCM(), lease=5.0)
    p.peer_meta["D"] = {0: b"D0"}
    p._direct("D", {"type": "dst", "xfer": "x", "dsts": [{"seq": "s", "blocks": [5, 6], "offset": 0}]})
    assert list(p.planner.pending) == ["x"]
    clock[0] = 15.0
    p._housekeeping()
    assert list(p.planner.pending) == ["x"]
    clock[0] = 15.01
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        p._housekeeping()
    assert not p.planner.pending
    assert [r.getMessage() for r in caplog.records] == [
        "kvtransport: destination s of transfer x (decode engine D) dropped: its prefill request did not reach "
        "this worker within 5s"]


# ---------------------------------------------------------------- the thread's idle wait, defaults, events
def test_a_pusher_built_with_defaults() -> None:
    p = stopped_pusher(RecordingCM(), layers=3, block_size=16)
    assert (p.cuda, p.stream, p.device, p.lease, p.group_of, p.groups, p.num_layers) == (
        False, None, None, 30.0, [0, 0, 0], 1, 3)
    assert (p.planner.block_size, p.direct_unknown, p.thread.name, p.thread.daemon) == (16, 0, "kvt-pusher", True)
    one = push()
    assert p.expand(one, None) == [one] and p.is_unlike({"tp_size": 2}) is False
    bare = Pusher(RecordingCM(), 0, 2, 1.0)
    bare.close()
    assert (bare.planner.block_size, bare.lease, bare.cuda, bare.group_of) == (16, 30.0, False, [0, 0])


def test_the_idle_wait_is_as_long_as_the_earliest_thing_due(monkeypatch) -> None:
    """Releases to flush: 20 ms; a held-back signal: until it is due (0 when overdue); early destinations
    waiting: at most a second; nothing: no bound."""
    clock = [10.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    p = stopped_pusher(RecordingCM())
    assert p._idle_timeout() is None
    p.releasing = ["r"]
    assert p._idle_timeout() == 0.02
    p.delayed = [(10.5, "whole", [push(req="r")])]  # r's release waits for its held-back signal
    assert p._idle_timeout() == 0.5
    p.releasing = ["r", "other"]
    assert p._idle_timeout() == 0.02
    p.releasing = []
    clock[0] = 11.0
    assert p._idle_timeout() == 0.0
    p.delayed = [(13.0, "whole", [push()])]
    p.peer_meta["D"] = {0: b"D0"}
    p._direct("D", {"type": "dst", "xfer": "x", "dsts": [{"seq": "s", "blocks": [5], "offset": 0}]})
    assert p._idle_timeout() == 1.0
    p.delayed = [(11.25, "whole", [push()])]
    assert p._idle_timeout() == 0.25
    p.delayed = []
    assert p._idle_timeout() == 1.0


def test_held_back_signals_go_when_due_exactly_and_keep_their_kind(monkeypatch) -> None:
    clock = [10.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    cm = RecordingCM()
    p = stopped_pusher(cm)
    connected(p, "D")
    p._signal_later("whole", [push("a", delay=1.0)])
    p._signal_later("layerwise", [push("b", delay=2.0)])
    clock[0] = 11.0
    p._housekeeping()
    assert cm.sent() == [("signal", "D0", "a")] and (p.sent_whole, p.sent_layerwise) == (1, 0)
    assert [d[0] for d in p.delayed] == [12.0]


class Recorded:
    """A CUDA event or stream stand-in that records what the pusher asks of it."""

    def __init__(self, log: list[tuple[str, Any]], name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait_event", event.name))


def test_puts_wait_for_the_forwards_event_on_the_host_or_on_the_pushers_stream() -> None:
    log: list[tuple[str, Any]] = []
    p = stopped_pusher(RecordingCM(), layers=1)
    p._do(("plan", [source()], [], [], []))
    p._do(("layer", 0, Recorded(log, "e0")))
    p._do(("step_end", Recorded(log, "end")))
    p._do(("layer", 0, None))
    assert log == [("synchronize", "e0"), ("synchronize", "end")]
    p.stream = Recorded(log, "stream")
    p._do(("step_end", Recorded(log, "end2")))
    assert log[2:] == [("wait_event", "end2")]


# ---------------------------------------------------------------- plans
def test_a_plan_with_destinations_only_keeps_the_steps_sources(monkeypatch) -> None:
    """A plan carrying only binds (no sources) in the middle of a step: the step's sources stay active, so the
    next layers are still put; cancels in a plan go before its binds."""
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=2)
    connected(p, "D")
    p._do(("plan", [source()], [Bind("x", "D", "s", (5, 6))], [], []))
    p._do(("layer", 0, None))
    p._do(("plan", [], [Bind("x", "D", "gone", (7, 8)), Bind("x", "D", "t", (9, 10))], [("x", "gone")], []))
    p._do(("layer", 1, None))
    p._do(("step_end", None))
    seqs = [c[2] for c in cm.sent() if c[0] in ("put_layer", "put_layers")]
    assert seqs.count("s") == 2 and "gone" not in seqs and "t" in seqs
    assert [c for c in cm.sent() if c[0] == "signal"] == [("signal", "D0", "s"), ("signal", "D0", "t")]


def test_each_bind_is_traced_with_its_phase_and_a_refused_one_logged(monkeypatch, caplog) -> None:
    events: list[tuple[Any, ...]] = []
    monkeypatch.setattr(pusher_mod.trace, "event", lambda ev, key, **f: events.append((ev, key, f)))
    cm = RecordingCM()
    p = stopped_pusher(cm, layers=1)
    connected(p, "D", "E")
    p._do(("plan", [source()], [Bind("x", "D", "b", (5, 6))], [], []))
    p._do(("layer", 0, None))
    p._do(("plan", [], [Bind("x", "D", "d", (7, 8))], [], []))
    p._do(("step_end", None))
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        p._do(("plan", [], [Bind("x", "D", "a", (9, 10)), Bind("x", "E", "a", (1, 1))], [], []))
    assert [(k, f) for ev, k, f in events if ev == "w.bind"] == [
        ("x", {"seq": "b", "phase": "before"}), ("x", {"seq": "d", "phase": "during"}),
        ("x", {"seq": "a", "phase": "after"})]
    assert [r.getMessage() for r in caplog.records] == [
        "kvtransport: destination a of transfer x from decode engine E refused: request a of transfer x belongs to "
        "decode engine D"]


def test_a_planned_push_is_expanded_once_and_the_last_EXPANDED_are_kept(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "EXPANDED", 2)
    calls: list[str] = []

    def expand(p: Push, geo: Any) -> list[Push]:
        calls.append(p.seq)
        return [p]

    p = stopped_pusher(RecordingCM(), expand=expand)
    a, b, c = push("a"), push("b"), push("c")
    for one in (a, a, b, c):
        p._expand(one)
    assert calls == ["a", "b", "c"] and [v[0].seq for v in p._expanded.values()] == ["b", "c"]
    p._expand(b)
    p._expand(a)
    assert calls == ["a", "b", "c", "a"]


# ---------------------------------------------------------------- introductions and links
def test_introductions_keep_the_ranks_a_decode_may_have_and_connect_those_we_serve(monkeypatch) -> None:
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    limit = pusher_mod.MAX_PEER_TP
    p._peers({"D": {0: b"D0", limit - 1: b"Dlast", limit: b"Dover", limit + 6: b"Dfar"}}, {"D": [0]}, {}, {})
    assert set(p.peer_meta["D"]) == {0, limit - 1} and list(p.connecting) == [("D", 0)]
    cm.gate.set()
    pump(p)


def test_a_refusal_and_a_geometry_replace_each_other_and_refusals_are_bounded(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_REFUSED", 2)
    p = stopped_pusher(RecordingCM())
    geo = {"tp_size": 2, "block_size": 16, "kv_order": "HN"}
    p._peers({"A": {0: b"A0"}}, {}, {"A": geo}, {})
    p._peers({}, {}, {}, {"A": "no"})
    assert "A" not in p.peer_geometry and p.refused == {"A": "no"}
    p._peers({}, {}, {"A": geo}, {})
    assert p.peer_geometry == {"A": geo} and p.refused == {}
    p._peers({"B": {0: b"B0"}, "C": {0: b"C0"}}, {}, {}, {"A": "a", "B": "b", "C": "c"})
    assert list(p.refused.items()) == [("B", "b"), ("C", "c")] and set(p.peer_meta) == {"B", "C"}


def test_an_introduction_skips_refused_engines_and_stops_at_a_cap_for_that_engine_only(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_LINKS_PER_PEER", 1)
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    p._peers({"R": {0: b"R0"}, "A": {0: b"A0", 1: b"A1"}, "B": {0: b"B0"}}, {"R": [0], "A": [0, 1], "B": [0]}, {},
             {"R": "refused"})
    assert sorted(p.connecting) == [("A", 0), ("B", 0)]
    cm.gate.set()
    pump(p, 2)


def test_why_a_link_is_not_started_connected_unreachable_or_without_metadata(monkeypatch) -> None:
    clock = [5.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    p = stopped_pusher(RecordingCM())
    p.peers[("D", 0)] = FakePeer("D0")
    assert p._start_connect(("D", 0)) == "connected"
    assert p._start_connect(("D", 3)) == "no kvtransport metadata for decode engine D rank 3"
    p.peer_meta["E"] = {1: b"E1"}
    p.broken[("E", 1)] = (6.0, "refused by its worker")
    assert p._start_connect(("E", 1)) == "decode engine E unreachable: refused by its worker"
    clock[0] = 6.0
    assert p._start_connect(("E", 1)) is None


def test_links_per_decode_engine_count_connected_and_connecting_links(monkeypatch, caplog) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_LINKS_PER_PEER", 2)
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    p.peers[("D", 0)] = FakePeer("D0")
    p.peers[("O", 0)] = FakePeer("O0")
    p.peer_meta["D"] = {0: b"D0", 1: b"D1", 2: b"D2"}
    assert p._start_connect(("D", 1)) is None
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        why = p._start_connect(("D", 2))
    assert why == ("capped: decode engine D has 2 links already (MAX_LINKS_PER_PEER: a decode of more than "
                   f"{pusher_mod.MAX_PEER_TP} ranks is not supported)")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"kvtransport: link to decode engine D rank 2 refused: {why}")]
    cm.gate.set()
    pump(p)


def test_a_link_refused_for_the_total_cap_is_logged_with_its_engine_and_rank(monkeypatch, caplog) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_LINKS", 1)
    p = stopped_pusher(RecordingCM())
    p.peers[("A", 0)] = FakePeer("A0")
    p.touched["r"].add(("A", 0))
    p.peer_meta["B"] = {3: b"B3"}
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        assert p._start_connect(("B", 3), evict=False).startswith("capped: this prefill worker holds 1 links")
        assert p._start_connect(("B", 3), evict=True).startswith("capped: this prefill worker holds 1 links")
    assert [r.getMessage() for r in caplog.records] == [  # rate-limited: once per interval
        "kvtransport: link to decode engine B rank 3 refused: capped: this prefill worker holds 1 links to decode "
        "workers, none idle (MAX_LINKS: serve fewer decode engines per prefill, or run them like-for-like, one link "
        "each)"]
    p.touched.clear()
    assert p._start_connect(("B", 3), evict=False).startswith("capped:")  # an idle link is closed only for a put
    assert list(p.peers) == [("A", 0)]


def test_connect_threads_run_at_most_MAX_CONNECTS_at_once_named_after_their_link(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_CONNECTS", 1)
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    p._peers({"engine-with-a-long-name-0123": {0: b"A0"}, "B": {0: b"B0"}},
             {"engine-with-a-long-name-0123": [0], "B": [0]}, {}, {})
    assert [t.name for t in p._connect_threads.values()] == ["kvt-connect-engine-with-a-lo-0"]
    assert all(t.daemon for t in p._connect_threads.values()) and len(p._to_connect) == 1
    cm.gate.set()
    pump(p)
    assert list(p._connect_threads) == [("B", 0)] and not p._to_connect
    pump(p)
    assert not p._connect_threads and list(p.peers) == [("engine-with-a-long-name-0123", 0), ("B", 0)]


def test_a_connect_that_breaks_off_is_tried_again_backing_off_within_its_timeout(monkeypatch) -> None:
    """Two attempts time out, the third connects: waits of 0.1 then 0.2 s between them, each attempt bounded by
    what is left of the connect timeout (never below 0.1 s)."""
    cm = RecordingCM()
    timeouts: list[float] = []
    outcomes: list[Exception | None] = [kvtransport.TransferTimeout("slow"), kvtransport.PeerDisconnected("closed"),
                                        None]

    def connect(meta: bytes, timeout: float) -> FakePeer:
        timeouts.append(timeout)
        exc = outcomes.pop(0)
        if exc is not None:
            raise exc
        return FakePeer(meta.decode())

    clock = [0.0]
    sleeps: list[float] = []

    def sleep(t: float) -> None:
        sleeps.append(t)
        clock[0] += t

    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pusher_mod.time, "sleep", sleep)
    cm.connect = connect  # type: ignore[method-assign]
    p = stopped_pusher(cm, timeout=1.0)
    p._connect(("D", 0), b"D0")
    job = p.q.get(timeout=5)
    assert job[:2] == ("connected", ("D", 0)) and job[2].name == "D0"
    assert sleeps == [0.1, 0.2] and timeouts == [1.0, 0.9, pytest.approx(0.7)]


def fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The pusher's clock from 0.0, advanced only by its sleeps; returns the sleeps, in order."""
    clock = [0.0]
    sleeps: list[float] = []
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pusher_mod.time, "sleep", lambda t: (sleeps.append(t), clock.__setitem__(0, clock[0] + t)))
    return sleeps


def test_a_connect_gives_up_when_the_next_wait_would_reach_its_deadline(monkeypatch) -> None:
    sleeps = fake_clock(monkeypatch)
    cm = RecordingCM()
    cm.fail["connect"] = kvtransport.TransferTimeout("slow")
    p = stopped_pusher(cm, timeout=1.6)
    p._connect(("D", 0), b"D0")
    job = p.q.get(timeout=5)
    assert isinstance(job[2], kvtransport.TransferTimeout)
    assert sleeps == [0.1, 0.2, 0.4, 0.8]  # 1.5 s waited: the next wait (1.0) would pass 1.6


def test_a_connect_gives_up_when_the_next_wait_would_end_exactly_at_its_deadline(monkeypatch) -> None:
    sleeps = fake_clock(monkeypatch)
    cm = RecordingCM()
    cm.fail["connect"] = kvtransport.TransferTimeout("slow")
    p = stopped_pusher(cm, timeout=0.1 + 0.2 + 0.4)  # the clock after two waits plus the third, to the last bit
    p._connect(("D", 0), b"D0")
    assert isinstance(p.q.get(timeout=5)[2], kvtransport.TransferTimeout)
    assert sleeps == [0.1, 0.2]


def test_a_connects_waits_double_up_to_one_second(monkeypatch) -> None:
    sleeps = fake_clock(monkeypatch)
    cm = RecordingCM()
    cm.fail["connect"] = kvtransport.PeerDisconnected("closed")
    p = stopped_pusher(cm, timeout=4.0)
    p._connect(("D", 0), b"D0")
    assert isinstance(p.q.get(timeout=5)[2], kvtransport.PeerDisconnected)
    assert sleeps == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]  # 3.5 s waited: the next wait (1.0) would pass 4.0


class JoinRecorder:
    """A connect thread as ``_connected`` sees it: its joins recorded."""

    def __init__(self) -> None:
        self.joins: list[float | None] = []

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)


def test_a_connect_thread_is_joined_for_at_most_a_second_once_it_handed_over_its_outcome() -> None:
    """The thread ends right after it queued its outcome: joined (bounded) before the next connect starts, so at
    most MAX_CONNECTS connect threads ever run."""
    p = stopped_pusher(RecordingCM())
    thread = JoinRecorder()
    p._connect_threads[("D", 0)] = thread
    p.connecting[("D", 0)] = []
    p._connected(("D", 0), FakePeer("D0"))
    assert thread.joins == [1.0] and not p._connect_threads and list(p.peers) == [("D", 0)]


def test_a_connect_that_raises_something_unexpected_fails_its_waiting_puts_with_the_error() -> None:
    cm = RecordingCM()
    cm.fail["connect"] = RuntimeError("boom")
    p = stopped_pusher(cm)
    p._peers({"D": {0: b"D0"}}, {}, {}, {})
    p._put(push(), (0,))
    pump(p)
    reason = "KVTransportError: connect to decode engine D rank 0 failed: RuntimeError: boom"
    assert p.take() == (set(), [SendFailure("s", "D", reason)])
    assert p.broken[("D", 0)][1] == "connect to decode engine D rank 0 failed: RuntimeError: boom"
    assert not p._connect_threads and not p.connecting


def test_a_connect_refused_fails_its_backlog_in_order_once_per_sequence_and_backs_off() -> None:
    cm = RecordingCM()
    cm.gate.clear()
    p = stopped_pusher(cm)
    p._peers({"D": {0: b"D0"}}, {}, {}, {})
    p._put(push("s1"), (0,))
    p._put(push("s1"), (1,))
    p._signal(push("s2"), "whole")
    cm.fail["connect"] = kvtransport.KVTransportError("refused: wrong secret")
    cm.gate.set()
    pump(p)
    why = "KVTransportError: refused: wrong secret"
    assert p.take() == (set(), [SendFailure("s1", "D", why), SendFailure("s2", "D", why)])
    assert p.broken[("D", 0)][1] == "refused: wrong secret" and not p.connecting


def test_a_plans_destination_for_a_source_this_worker_does_not_know_expires_after_the_lease(monkeypatch) -> None:
    clock = [10.0]
    monkeypatch.setattr(pusher_mod.time, "monotonic", lambda: clock[0])
    p = stopped_pusher(RecordingCM(), lease=5.0)
    p._do(("plan", [], [Bind("x", "D", "s", (5, 6))], [], []))
    assert list(p.planner.pending) == ["x"]
    clock[0] = 15.01
    p._housekeeping()
    assert not p.planner.pending


def test_a_refused_engine_never_introduced_is_forgotten_past_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(pusher_mod, "MAX_REFUSED", 1)
    p = stopped_pusher(RecordingCM())
    p._peers({}, {}, {}, {"A": "a"})
    p._peers({}, {}, {}, {"B": "b"})
    assert p.refused == {"B": "b"}


def test_a_decode_geometry_is_handed_to_the_planner_only_when_unlike_ours() -> None:
    geo = {"tp_size": 1, "block_size": 16, "kv_order": "HN"}
    like = stopped_pusher(RecordingCM())
    like._peers({}, {}, {"D": geo}, {})
    assert like._geometry_if_unlike("D") is None and like._geometry_if_unlike("unknown") is None
    unlike = stopped_pusher(RecordingCM(), unlike=lambda g: g["tp_size"] != 2)
    unlike._peers({}, {}, {"D": geo}, {})
    assert unlike._geometry_if_unlike("D") == geo


def test_close_returns_within_its_bound_while_the_thread_is_stuck_in_a_flush() -> None:
    """A flush that never returns (a wedged transport) holds the pusher's thread: close gives up after 5 s
    instead of hanging the worker's shutdown."""
    cm = RecordingCM()
    stuck = threading.Event()
    cm.flush = lambda peer, timeout: stuck.wait(30)  # type: ignore[method-assign]
    p = Pusher(cm, 0, 1, 1.0)
    p.peers[("D", 0)] = FakePeer("D0")
    p.touched["r"].add(("D", 0))
    p.submit("release", "r")
    deadline = time.monotonic() + 5
    while not p.q.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # the thread is in the flush now
    start = time.monotonic()
    p.close()
    took = time.monotonic() - start
    stuck.set()
    assert 4.9 <= took < 5.9 and p.take() == (set(), [])
