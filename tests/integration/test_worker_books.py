"""A worker's books alone (kvtransport_vllm.worker.WorkerSide): the decode side's receives — which sequences it
expects from which sender, waits on, releases and aborts, what it reports and when, what it counts — and the
geometry checks of decode engines on the prefill side, with exact values.

The CommManager here records every call and lands what the test says (``DecodeCM``); the fence thread is the
worker's own. Real transfers between workers run in test_worker_connector.py; this file is for the bookkeeping
those cannot pin down (which sequence ids, which timeouts, which counters). Only the registration tests build
(small, CPU) tensors; ``kvtransport.open`` is replaced there by a recorder of what it was asked for."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import pytest

worker_mod = pytest.importorskip("kvtransport_vllm.worker", reason="kvtransport-vllm is not installed")
from kvtransport_vllm.config import resolve_settings  # noqa: E402
from kvtransport_vllm.geometry import Geometry, part_seq  # noqa: E402
from kvtransport_vllm.metadata import NULL_BLOCK, FailureKind, Push, SourceStep, StepPlan  # noqa: E402
from kvtransport_vllm.pusher import Pusher  # noqa: E402

import kvtransport  # noqa: E402
from kvtransport.coalesce import BlockRun  # noqa: E402
from kvtransport.reshard import Shard, reshard_runs  # noqa: E402

WorkerSide = worker_mod.WorkerSide
CONNECT_TIMEOUT = 5.0


class DecodeCM:
    """The receiving calls of a CommManager, recorded. ``landed``: what the next ``poll`` returns; ``wait_fail``:
    sequence -> outcomes of its next waits, in order (None: landed, an error: raised); ``abort_fail``: errors the
    next aborts raise, in order; ``stats_now``: what ``stats`` returns."""

    backend = "recorded"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.landed: list[str] = []
        self.wait_fail: dict[str, list[Exception | None]] = {}
        self.abort_fail: list[Exception] = []
        self.stats_now: dict[str, Any] = {}

    def poll(self) -> list[str]:
        out, self.landed = self.landed, []
        return out

    def wait(self, seq: str, timeout: float) -> None:
        self.calls.append(("wait", seq, timeout))
        outcomes = self.wait_fail.get(seq)
        exc = outcomes.pop(0) if outcomes else None
        if exc is not None:
            raise exc

    def expect(self, seq: str, sender: str) -> None:
        self.calls.append(("expect", seq, sender))

    def release(self, seq: str) -> None:
        self.calls.append(("release", seq))

    def abort(self, seq: str, timeout: float) -> None:
        self.calls.append(("abort", seq, timeout))
        if self.abort_fail:
            raise self.abort_fail.pop(0)

    def stats(self) -> dict[str, Any]:
        return dict(self.stats_now)

    def close(self) -> None:
        pass

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def made():
    workers: list[Any] = []
    yield workers
    for w in workers:
        w.shutdown()


def decode(made: list[Any], *, shard: Shard | None = None, tp_rank: int = 0, **extra: Any) -> Any:
    """A decode WorkerSide on a DecodeCM (its fence thread running): 30-s transfer timeout unless ``extra`` says."""
    w = WorkerSide(settings=resolve_settings({"transfer_timeout": 30, "connect_timeout": CONNECT_TIMEOUT, **extra}),
                   engine_id="d", tp_rank=tp_rank)
    w.cm = DecodeCM()
    w.shard = shard
    w._fencer = threading.Thread(target=w._fence_loop, name="kvt-fence", daemon=True)
    w._fencer.start()
    made.append(w)
    return w


def results_until(w: Any, pred: Any, timeout: float = 10.0) -> list[Any]:
    """Poll ``transfer_results`` until ``pred`` holds for the results so far (a fence ends on its own thread)."""
    seen: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen.append(w.transfer_results())
        if pred(seen):
            return seen
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout}s: {seen[-3:]}")


def recving(seen: list[Any]) -> set[str]:
    return set().union(*(r.finished_recving for r in seen))


def failed(seen: list[Any]) -> set[str]:
    return set().union(*(r.failed_recving for r in seen))


# ---------------------------------------------------------------- landing
def test_a_landed_receive_is_waited_on_at_once_reported_released_and_timed(made, monkeypatch) -> None:
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(worker_mod.trace, "event", lambda ev, key, **f: events.append((ev, key)))
    clock = [100.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_blocks={"r": [4, 5]}))
    clock[0] = 100.1234567
    w.cm.landed = ["r"]
    res = w.transfer_results()
    assert (res.finished_recving, res.failed_recving) == ({"r"}, set())
    assert w.cm.calls == [("wait", "r", 0), ("wait", "r", 0), ("release", "r")]
    assert events == [("d.landed", "r"), ("d.reported", "r")]
    assert list(w._reported) == ["r"] and w._recv_blocks == {} and w._waiting == {} and w._landed == {}
    assert w.blocks_of({"r"}) == set()
    assert w.stats_delta()["transfer_times"] == [0.123457]
    w.cm.landed = ["r"]  # a late poll result of an ended receive: not reported again
    assert w.transfer_results().finished_recving == set()


def test_a_receive_held_for_its_first_token_is_reported_when_released(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_hold={"r"}))
    w.cm.landed = ["r"]
    assert w.transfer_results().finished_recving == set()
    assert list(w._reported) == ["r"] and set(w._landed_held) == {"r"}
    w.cm.landed = ["r"]
    assert w.transfer_results().finished_recving == set()
    w.bind(StepPlan(recv_release={"r"}))
    assert w.transfer_results().finished_recving == {"r"}


def test_a_part_that_finds_its_prefill_gone_fails_the_receive_and_counts_a_disconnect(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}))
    w.cm.wait_fail["r"] = [kvtransport.PeerDisconnected("the prefill went away")]
    w.cm.landed = ["r"]
    seen = results_until(w, lambda s: failed(s))
    assert failed(seen) == {"r"} and recving(seen) == {"r"}
    assert w.cm.calls == [("wait", "r", 0), ("abort", "r", CONNECT_TIMEOUT)]
    assert w._waiting == {} and list(w._reported) == ["r"]
    stats = w.stats_delta()
    assert (stats["transfer_failures"], stats["prefill_disconnects"]) == (1, 1)


def test_every_receive_lost_with_its_prefill_counts(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r1": 30.0, "r2": 30.0}))
    for rid in ("r1", "r2"):
        w.cm.wait_fail[rid] = [kvtransport.PeerDisconnected("the prefill went away")]
    w.cm.landed = ["r1", "r2"]
    seen = results_until(w, lambda s: failed(s) == {"r1", "r2"})
    assert recving(seen) == {"r1", "r2"}
    stats = w.stats_delta()
    assert (stats["transfer_failures"], stats["prefill_disconnects"]) == (2, 2)


def test_a_part_that_failed_otherwise_fails_the_receive_without_a_disconnect(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}))
    w.cm.wait_fail["r"] = [kvtransport.SequenceAborted("the prefill aborted it")]
    w.cm.landed = ["r"]
    seen = results_until(w, lambda s: failed(s))
    assert failed(seen) == {"r"}
    stats = w.stats_delta()
    assert (stats["transfer_failures"], stats["prefill_disconnects"]) == (1, 0)


def test_a_receive_whose_final_wait_fails_is_fenced_and_counted_once(made) -> None:
    """The part's first wait says landed, the final check finds the prefill gone: failed (after its abort), one
    disconnect, nothing released."""
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}))
    w.cm.wait_fail["r"] = [None, kvtransport.PeerDisconnected("gone")]
    w.cm.landed = ["r"]
    seen = results_until(w, lambda s: failed(s))
    assert failed(seen) == {"r"}
    assert w.cm.calls == [("wait", "r", 0), ("wait", "r", 0), ("abort", "r", CONNECT_TIMEOUT)]
    assert list(w._reported) == ["r"] and w._parts == {} and w._landed == {}
    stats = w.stats_delta()
    assert (stats["transfer_failures"], stats["prefill_disconnects"]) == (1, 1)


# ---------------------------------------------------------------- senders and parts
def test_a_receive_is_bound_to_the_sender_of_this_rank_on_the_block_layout(made) -> None:
    """No shard (block layout: like-for-like): rank 1 expects its request from the prefill's rank 1 only."""
    w = decode(made, tp_rank=1)
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_from={"r": {0: "P0", 1: "P1"}}))
    assert w.cm.calls == [("expect", "r", "P1")] and w._parts == {"r": {"r": "P1"}}


def test_a_rank_no_sender_serves_on_the_block_layout_expects_nothing(made) -> None:
    """A decode rank past the prefill's TP size on the block layout has no sender of its own: nothing to expect
    (and nothing raised inside vLLM's step)."""
    w = decode(made, tp_rank=1)
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_from={"r": {0: "P0"}}))
    assert w.cm.calls == [] and w._parts == {} and set(w._waiting) == {"r"}


def test_senders_of_a_request_not_waited_for_bind_nothing(made) -> None:
    w = decode(made, tp_rank=1)
    w.bind(StepPlan(recv_from={"r": {0: "P0", 1: "P1"}}))
    assert w.cm.calls == [] and w._parts == {}


def test_parts_from_two_senders_finish_when_the_last_lands_even_before_the_senders_are_known(made) -> None:
    """A decode of TP 1 (4 KV heads) fed by a prefill of TP 2: two parts. Both land before the welcome names the
    senders; the receive finishes as soon as they are known."""
    w = decode(made, shard=Shard(1, 0, 4, 16))
    w.bind(StepPlan(recv_start={"r": 30.0}))
    parts = [part_seq("r", 0, 2), part_seq("r", 1, 2)]
    w.cm.landed = parts
    assert w.transfer_results().finished_recving == set()
    w.bind(StepPlan(recv_from={"r": {0: "P0", 1: "P1"}}))
    assert w.cm.of("expect") == [("expect", parts[0], "P0"), ("expect", parts[1], "P1")]
    assert w.transfer_results().finished_recving == {"r"}
    assert sorted(w.cm.of("release")) == [("release", parts[0]), ("release", parts[1])]
    assert w._parts == {} and w._landed == {}


def test_senders_that_do_not_split_the_models_heads_fail_the_receive_with_the_fix(made, caplog) -> None:
    """4 KV heads cannot be split over 3 prefill ranks: the receive fails (fenced), logged with what to do."""
    w = decode(made, shard=Shard(1, 0, 4, 16))
    w.bind(StepPlan(recv_start={"r": 30.0}))
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        w.bind(StepPlan(recv_from={"r": {0: "P0", 1: "P1", 2: "P2"}}))
    seen = results_until(w, lambda s: failed(s))
    assert failed(seen) == {"r"} and w.cm.of("expect") == []
    msgs = [r.getMessage() for r in caplog.records if "do not fit" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].startswith(
        "kvtransport: r fails: its prefill's workers do not fit this decode (") and msgs[0].endswith(
        "); run the prefill at a TP size that splits the model's KV heads")
    assert "3" in msgs[0]


def test_a_failed_receive_aborts_its_own_sequence_and_every_part_known_or_landed(made) -> None:
    w = decode(made, shard=Shard(1, 0, 4, 16))
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_from={"r": {0: "P0", 1: "P1"}}))
    p0, p1 = part_seq("r", 0, 2), part_seq("r", 1, 2)
    w.cm.landed = [p0]
    w.transfer_results()
    w.bind(StepPlan(recv_fail={"r": "its prefill failed"}, recv_fail_kind={"r": FailureKind.PREFILL_LOST}))
    seen = results_until(w, lambda s: failed(s))
    assert failed(seen) == {"r"}
    assert w.cm.of("abort") == [("abort", s, CONNECT_TIMEOUT) for s in sorted({"r", p0, p1})]
    assert list(w._reported) == ["r"]
    assert w.stats_delta()["prefill_disconnects"] == 1


# ---------------------------------------------------------------- counters
def test_stats_are_deltas_since_the_last_call_exactly(made) -> None:
    w = decode(made)
    w.pusher = Pusher(w.cm, 0, 1, 1.0)
    w.pusher.close()
    w.cm.stats_now = {"bytes_sent": 100, "bytes_received": 50, "puts": 7, "puts_received": 3, "failures": 2,
                      "paths": ["loopback"]}
    w.pusher.sent_layerwise, w.pusher.sent_whole = 3, 2
    w._times = [0.25, 0.1234567]
    w._failures, w._lost = 4, 1
    first = w.stats_delta()
    assert first == {"bytes_sent": 100, "bytes_received": 50, "puts": 7, "puts_received": 3, "failures": 2,
                     "transfers_layerwise": 3, "transfers_whole": 2, "dst_bound_before": 0, "dst_bound_during": 0,
                     "dst_bound_after": 0, "transfers_sent": 5, "transfers_received": 2,
                     "transfer_times": [0.25, 0.123457], "transfer_failures": 4, "prefill_disconnects": 1,
                     "backend": ["recorded"], "paths": ["loopback"]}
    w.cm.stats_now = {"bytes_sent": 160, "bytes_received": 50, "puts": 9}  # counters it lacks count as 0
    w.pusher.sent_layerwise = 4
    second = w.stats_delta()
    assert second == {"bytes_sent": 60, "bytes_received": 0, "puts": 2, "puts_received": -3, "failures": -2,
                      "transfers_layerwise": 1, "transfers_whole": 0, "dst_bound_before": 0, "dst_bound_during": 0,
                      "dst_bound_after": 0, "transfers_sent": 1, "transfers_received": 0, "transfer_times": [],
                      "transfer_failures": 0, "prefill_disconnects": 0, "backend": ["recorded"], "paths": []}


# ---------------------------------------------------------------- a decode engine's geometry, prefill side
def prefill(made: list[Any], tp_size: int = 2, tp_rank: int = 0) -> Any:
    """A prefill worker of 4 KV heads at TP ``tp_size`` (HN order, 16-token blocks), geometry set by hand."""
    w = WorkerSide(settings=resolve_settings({}), engine_id="p", tp_rank=tp_rank, tp_size=tp_size)
    w.geometry = Geometry("HN", 4 // tp_size, 16, 64, 100)
    w.shard = w.geometry.shard(tp_size, tp_rank, 4)
    made.append(w)
    return w


def test_a_decode_geometry_unlike_ours_only_in_head_order_is_unlike(made) -> None:
    w = prefill(made)
    assert w._unlike({"tp_size": 2, "block_size": 16, "kv_order": "NH"}) is True
    assert w._unlike({"tp_size": 2, "block_size": 16, "kv_order": "HN"}) is False
    assert w._unlike({"tp_size": 1, "block_size": 16, "kv_order": "HN"}) is True
    assert w._unlike({"tp_size": 2, "block_size": 32, "kv_order": "HN"}) is True


def test_a_like_decode_is_served_on_our_rank_and_an_unlike_one_on_the_ranks_we_hold_heads_for(made) -> None:
    w = prefill(made, tp_size=2, tp_rank=1)
    assert w._take_geometry("like", {"tp_size": 2, "block_size": 16, "kv_order": "HN"}) is None
    assert w._take_geometry("wide", {"tp_size": 4, "block_size": 16, "kv_order": "HN"}) is None
    assert w._serve == {"like": [1], "wide": [2, 3]}
    assert w.peer_geometry["wide"] == {"tp_size": 4, "block_size": 16, "kv_order": "HN"}


def test_a_block_layout_worker_serves_every_decode_on_its_own_rank(made) -> None:
    """No shard (the block layout): even a geometry unlike ours is served on our rank (like-for-like only)."""
    w = WorkerSide(settings=resolve_settings({}), engine_id="p", tp_rank=1, tp_size=2)
    made.append(w)
    assert w._take_geometry("D", {"tp_size": 4, "block_size": 16, "kv_order": "HN"}) is None
    assert w._serve == {"D": [1]}


def test_a_decode_refused_after_it_was_accepted_is_forgotten_and_logged_once_as_an_error(made, caplog) -> None:
    w = prefill(made)
    assert w._take_geometry("D", {"tp_size": 2, "block_size": 16, "kv_order": "HN"}) is None
    with caplog.at_level(logging.ERROR, logger="vllm.kvtransport"):
        why = w._take_geometry("D", {"tp_size": 3, "block_size": 16, "kv_order": "HN"})
    assert why is not None and why.startswith("decode engine D is refused: ")
    assert "D" not in w.peer_geometry and "D" not in w._serve
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.ERROR, f"kvtransport: {why}")]


@pytest.mark.parametrize(("groups", "hybrid"), [({}, False), ({"a": 0, "b": 0}, False), ({"a": 0, "b": 1}, True),
                                                ({"a": 0, "b": 1, "c": 2}, True)])
def test_a_worker_is_hybrid_with_two_kv_cache_groups_or_more(made, groups: dict[str, int], hybrid: bool) -> None:
    w = WorkerSide(settings=resolve_settings({}), engine_id="p", layer_groups=groups)
    made.append(w)
    assert w._hybrid() is hybrid


# ---------------------------------------------------------------- more of the decode's receives
def test_a_receive_of_two_parts_finishes_only_when_both_landed(made) -> None:
    w = decode(made, shard=Shard(1, 0, 4, 16))
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_from={"r": {0: "P0", 1: "P1"}}))
    p0, p1 = part_seq("r", 0, 2), part_seq("r", 1, 2)
    w.cm.landed = [p0]
    assert w.transfer_results().finished_recving == set() and set(w._waiting) == {"r"}
    w.cm.landed = [p1]
    assert w.transfer_results().finished_recving == {"r"}


def test_a_sequence_that_landed_before_its_receive_started_lands_with_the_next_poll(made) -> None:
    """The KV can land before the plan that starts the receive reaches the worker: kept as early, then reported
    as soon as the receive starts."""
    w = decode(made)
    w.cm.landed = ["r"]
    assert w.transfer_results().finished_recving == set() and list(w._early) == ["r"]
    w.bind(StepPlan(recv_start={"r": 30.0}))
    assert w.transfer_results().finished_recving == {"r"}
    assert w._early == {} and w.cm.calls == [("wait", "r", 0), ("wait", "r", 0), ("release", "r")]


def test_a_poll_goes_on_past_a_sequence_already_reported(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"a": 30.0, "b": 30.0}))
    w.cm.landed = ["a"]
    assert w.transfer_results().finished_recving == {"a"}
    w.cm.landed = ["a", "b"]
    assert w.transfer_results().finished_recving == {"b"}


def test_a_receive_times_out_at_its_deadline_exactly(made, monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 2.0}))
    clock[0] = 101.999
    assert w.transfer_results().failed_recving == set() and set(w._waiting) == {"r"}
    clock[0] = 102.0
    w.transfer_results()
    assert w._waiting == {} and w.cm.calls == []
    seen = results_until(w, lambda s: failed(s))
    assert failed(seen) == {"r"} and w.cm.of("abort") == [("abort", "r", CONNECT_TIMEOUT)]


def test_landed_receives_whose_first_token_never_comes_fail_at_their_deadline(made, monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    w = decode(made)
    w.bind(StepPlan(recv_start={"a": 2.0, "b": 2.0}, recv_hold={"a", "b"}))
    w.cm.landed = ["a", "b"]
    assert w.transfer_results().finished_recving == set()
    clock[0] = 101.999
    assert w.transfer_results().failed_recving == set()
    clock[0] = 102.0
    res = w.transfer_results()
    assert (res.finished_recving, res.failed_recving) == ({"a", "b"}, {"a", "b"})
    assert w._held == set() and w._landed_held == {} and w.stats_delta()["transfer_failures"] == 2


def test_ended_receives_are_remembered_up_to_4096_the_oldest_forgotten_first(made) -> None:
    w = decode(made)
    for i in range(4097):
        w._ended(f"r{i}")
    assert len(w._reported) == 4096 and next(iter(w._reported)) == "r1" and "r4096" in w._reported


def test_results_without_a_pusher_or_a_transport_are_empty_sets(made) -> None:
    w = decode(made)
    res = w.transfer_results()
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), set(), set())
    w.cm = None
    res = w.transfer_results()
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), set(), set())


# ---------------------------------------------------------------- the prefill worker's per-step hand-offs
class FakeLayout:
    num_layers = 3
    is_cuda = False

    def compat_hash(self) -> str:
        return "layout-hash"


class CudaLike:
    is_cuda = True


def prefill_steps(made: list[Any]) -> Any:
    """A prefill worker of three layers whose pusher is stopped (what it hands the pusher stays in the pusher's
    queue: ``handed`` drains it). ``_forward_event`` answers "EVENT" (a CUDA event on a GPU)."""
    w = WorkerSide(settings=resolve_settings({}), engine_id="p")
    w.layout = FakeLayout()
    w.layer_index = {"L0": 0, "L1": 1, "L2": 2}
    w.pusher = Pusher(DecodeCM(), 0, 3, 1.0)
    w.pusher.close()
    w._forward_event = lambda: "EVENT"  # type: ignore[method-assign]
    made.append(w)
    return w


def handed(w: Any) -> list[tuple[Any, ...]]:
    out = []
    while not w.pusher.q.empty():
        out.append(w.pusher.q.get_nowait())
    return out


def step_of(layerwise: bool) -> StepPlan:
    return StepPlan(sources=[SourceStep("r", "x", 32, ((1, 2),), 0, 32, layerwise=layerwise)])


def test_a_layerwise_step_hands_each_computed_layer_once_then_the_missed_ones_and_the_end(made) -> None:
    w = prefill_steps(made)
    plan = step_of(True)
    w.bind(plan)
    assert handed(w) == [("plan", plan.sources, [], [], [])]
    w.save_kv_layer("L1", CudaLike())
    w.save_kv_layer("L1", CudaLike())  # a layer seen twice (vLLM calls per attention module) goes once
    w.save_kv_layer("L0", object())  # host memory: no event
    w.save_kv_layer("unknown", object())
    assert handed(w) == [("layer", 1, "EVENT"), ("layer", 0, None)]
    w.wait_for_save()
    assert handed(w) == [("layer", 2, "EVENT"), ("step_end", "EVENT")]
    w.wait_for_save()  # once per step
    w.save_kv_layer("L2", object())
    assert handed(w) == []


def test_a_step_that_puts_only_once_complete_hands_no_layer(made) -> None:
    w = prefill_steps(made)
    w.bind(step_of(False))
    handed(w)
    w.save_kv_layer("L0", object())
    w.wait_for_save()
    assert handed(w) == [("step_end", "EVENT")]


def test_a_step_without_prefill_sources_hands_the_pusher_nothing(made) -> None:
    w = prefill_steps(made)
    w.bind(StepPlan())
    w.save_kv_layer("L0", object())
    w.wait_for_save()
    assert handed(w) == []


def test_a_step_whose_forward_visited_every_layer_ends_with_no_missed_layer(made) -> None:
    w = prefill_steps(made)
    w.bind(step_of(True))
    handed(w)
    for name in ("L0", "L1", "L2"):
        w.save_kv_layer(name, object())
    w._forward_event = lambda: None  # type: ignore[method-assign]
    w.wait_for_save()
    assert handed(w) == [("layer", 0, None), ("layer", 1, None), ("layer", 2, None), ("step_end", None)]


def test_no_forward_event_without_a_cuda_layout(made) -> None:
    w = WorkerSide(settings=resolve_settings({}), engine_id="p")
    made.append(w)
    assert w._forward_event() is None
    w.layout = FakeLayout()
    assert w._forward_event() is None


def test_the_handshake_names_metadata_backend_instance_layout_layers_and_head_order(made) -> None:
    w = WorkerSide(settings=resolve_settings({}), engine_id="p")
    made.append(w)
    cm = DecodeCM()
    cm.metadata = lambda: b"meta"  # type: ignore[attr-defined]
    cm.instance = "inst-1"  # type: ignore[attr-defined]
    w.cm, w.layout, w.layer_index = cm, FakeLayout(), {"L0": 0, "L1": 1}
    base = {"metadata": b"meta", "backend": "recorded", "instance": "inst-1", "layout_hash": "layout-hash",
            "layer_names": ["L0", "L1"]}
    assert w.handshake() == {**base, "kv_order": None}
    w.geometry = Geometry("NH", 2, 16, 64, 100)
    assert w.handshake() == {**base, "kv_order": "NH"}


def test_a_decode_engine_not_checked_yet_is_served_on_our_rank(made) -> None:
    w = prefill(made, tp_size=2, tp_rank=1)
    assert w._dst_ranks("unknown") == [1]
    w._take_geometry("wide", {"tp_size": 4, "block_size": 16, "kv_order": "HN"})
    assert w._dst_ranks("wide") == [2, 3]


# ---------------------------------------------------------------- what a planned push becomes
def test_a_like_for_like_push_becomes_unit_runs_and_an_empty_one_stays_as_it_is(made) -> None:
    w = prefill(made)  # 2 heads of 16-token blocks here: 32 units a block
    p = Push("r", "s", "D", (1, 2, 3, 9), (7, 8, 9, 4))
    assert w._expand_one(p) == [Push("r", "s", "D", (1, 2, 3, 9), (7, 8, 9, 4),
                                     runs=(BlockRun(32, 224, 96), BlockRun(288, 128, 32)))]
    empty = Push("r", "s", "D", (), ())
    assert w._expand_one(empty) == [empty]


@pytest.mark.parametrize("hybrid", [False, True], ids=["one_group", "hybrid"])
def test_an_unlike_push_from_token_0_becomes_one_push_per_destination_rank_we_send_to(made, hybrid: bool) -> None:
    """A decode of TP 1 (all 4 heads) fed by our rank 0 of 2 (heads 0, 1): one part of the decode request,
    its runs as kvtransport.reshard maps them; a hybrid worker leaves vLLM's null block out."""
    w = prefill(made)
    if hybrid:
        w.layer_groups = {"full": 0, "window": 1}
    geo = {"tp_size": 1, "block_size": 16, "kv_order": "HN"}
    p = Push("r", "s", "D", (NULL_BLOCK, 5), (6, 7), start=0, stop=32)
    dst = Shard(1, 0, 4, 16, "HN")
    want = reshard_runs(w.shard, dst, (NULL_BLOCK, 5), (6, 7), 0, 32, skip_block=NULL_BLOCK if hybrid else None)
    assert len(want) == (1 if hybrid else 2)
    out = w._expand_one(p, geo)
    assert out == [Push("r", part_seq("s", 0, 2), "D", (NULL_BLOCK, 5), (6, 7), start=0, stop=32, rank=0,
                        runs=tuple(want), base="s")]
    empty = Push("r", "s", "D", (), (), start=0, stop=32)
    assert w._expand_one(empty, geo) == [Push("r", part_seq("s", 0, 2), "D", (), (), start=0, stop=32, rank=0,
                                              runs=(), base="s")]


def test_receives_whose_final_wait_finds_the_prefill_gone_count_each(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"a": 30.0, "b": 30.0}))
    for rid in ("a", "b"):
        w.cm.wait_fail[rid] = [None, kvtransport.PeerDisconnected("gone")]
    w.cm.landed = ["a", "b"]
    seen = results_until(w, lambda s: failed(s) == {"a", "b"})
    assert recving(seen) == {"a", "b"} and w.stats_delta()["prefill_disconnects"] == 2


def test_destination_blocks_are_remembered_for_65536_receives_and_the_oldest_still_lands(made) -> None:
    """The blocks of receives never reported are bounded (65,536, the oldest forgotten); a receive whose blocks
    were forgotten still lands and is reported."""
    w = decode(made)
    w.bind(StepPlan(recv_start={f"r{i}": 30.0 for i in range(65537)}, recv_blocks={"r0": [1], "r1": [2]}))
    assert len(w._recv_blocks) == 65536 and "r0" not in w._recv_blocks and w._recv_blocks["r1"] == [2]
    w.cm.landed = ["r0"]
    assert w.transfer_results().finished_recving == {"r0"}


def test_a_worker_side_before_its_caches_are_registered(monkeypatch) -> None:
    """What a worker side holds before ``register_kv_caches``: the defaults (TP 1, 16-token blocks), what it was
    given, nothing registered; its trace file is named after its rank."""
    roles: list[Any] = []
    monkeypatch.setattr(worker_mod.trace, "set_role", roles.append)
    w = WorkerSide(settings=resolve_settings({}), engine_id="eng", tp_rank=3, num_blocks=77)
    assert (w.engine_id, w.tp_rank, w.tp_size, w.block_size, w.num_blocks) == ("eng", 3, 1, 16, 77)
    assert (w.cm, w.layout, w.pusher, w.layer_index, w._layers_done) == (None, None, None, {}, set())
    assert roles == ["worker3"]
    w.save_kv_layer("L0", object())  # before any plan: nothing to hand over, nothing raised
    w.shutdown()


# ---------------------------------------------------------------- registration: what the transport is opened with
class OpenedCM(DecodeCM):
    """What ``kvtransport.open`` returns in the registration tests (records its arguments)."""

    def __init__(self, layout: Any, **kw: Any) -> None:
        super().__init__()
        self.layout, self.kw = layout, kw


def registered(made: list[Any], monkeypatch: pytest.MonkeyPatch, caches: dict[str, Any],
               settings: dict[str, Any] | None = None, **kw: Any) -> Any:
    torch = pytest.importorskip("torch")
    assert torch is not None
    monkeypatch.setattr(worker_mod.kvtransport, "open", lambda layout, **o: OpenedCM(layout, **o))
    w = WorkerSide(settings=resolve_settings({"backend": "auto", "connect_timeout": 7, "lease": 12,
                                              "ifname": "lo", **(settings or {})}), engine_id="eng", **kw)
    made.append(w)
    w.register_kv_caches(caches)
    return w


def test_registration_opens_the_transport_with_the_settings_and_starts_a_pusher_of_the_unit_geometry(
        made, monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    caches = {f"L{i}": torch.zeros(8, 2, 16, 16) for i in range(3)}  # [blocks, heads, block, 2*head]: unit layout
    w = registered(made, monkeypatch, caches, layer_groups={"L0": 0, "L1": 1, "L2": 1}, block_size=32)
    assert w.cm.kw == {"backend": None, "ifname": "lo", "timeout": 7.0} and w.cm.layout is w.layout
    assert w.geometry is not None and w.geometry.block_size == 16
    p = w.pusher
    assert (p.num_layers, p.cuda, p.group_of, p.planner.block_size, p.lease, p.timeout) == (3, False, [0, 1, 1], 16,
                                                                                            12.0, 7.0)
    assert w.dst_channel is not None and w.dst_channel.engine_id == "eng"
    assert p.is_unlike({"tp_size": 1, "block_size": 16, "kv_order": "HN"}) is False
    assert p.is_unlike({"tp_size": 1, "block_size": 32, "kv_order": "HN"}) is True


def test_registration_of_a_cache_that_is_not_a_unit_layout_keeps_vllms_blocks(made, monkeypatch) -> None:
    """K and V split first (``[2, blocks, ...]``, FlashAttention before vLLM 0.32): the block layout, vLLM's block
    size for the pusher, every decode like-for-like."""
    torch = pytest.importorskip("torch")
    caches = {f"L{i}": torch.zeros(2, 8, 16, 2, 8) for i in range(2)}
    w = registered(made, monkeypatch, caches, num_blocks=8, block_size=32)
    assert w.geometry is None and w.shard is None
    assert w.layout.num_blocks == 8 and w.pusher.planner.block_size == 32
    assert w.pusher.is_unlike({"tp_size": 4, "block_size": 1, "kv_order": "NH"}) is False


# ---------------------------------------------------------------- a plan's receive orders
def test_an_aborted_receive_is_fenced_and_reported_done_without_its_blocks(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"a": 30.0, "b": 30.0}, recv_blocks={"a": [1], "b": [2]}, recv_hold={"b"}))
    w.cm.landed = ["b"]
    w.transfer_results()  # b landed, held for its first token
    plan = StepPlan(recv_abort=["b", "a"], send_release=[])
    w.bind(plan)
    seen = results_until(w, lambda s: recving(s) == {"a", "b"})
    assert failed(seen) == set() and w.cm.of("abort") == [("abort", "a", CONNECT_TIMEOUT)]
    assert w._recv_blocks == {"b": [2]} and w._held == set() and w.blocks_of({"a"}) == set()


def test_an_aborted_receive_whose_parts_landed_early_is_fenced_and_forgets_them(made) -> None:
    w = decode(made, shard=Shard(1, 0, 4, 16))
    p0 = part_seq("r", 0, 2)
    w.cm.landed = [p0, part_seq("q", 0, 2)]
    w.transfer_results()
    w.bind(StepPlan(recv_abort=["r"]))
    seen = results_until(w, lambda s: recving(s) == {"r"})
    assert failed(seen) == set() and list(w._early) == [part_seq("q", 0, 2)]
    assert w.cm.of("abort") == [("abort", "r", CONNECT_TIMEOUT)]
    w.bind(StepPlan(recv_abort=["r"]))  # reported already: not again
    assert w.transfer_results().finished_recving == set()
    # "r" had no destination blocks to forget (it never started): the fence thread goes on to the next receive
    w.bind(StepPlan(recv_start={"z": 30.0}))
    w.bind(StepPlan(recv_fail={"z": "its prefill failed"}))
    assert failed(results_until(w, lambda s: failed(s))) == {"z"}


def test_holds_add_up_over_plans_and_a_release_reports_with_the_receives_start(made, monkeypatch) -> None:
    clock = [50.0]
    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: clock[0])
    w = decode(made)
    w.bind(StepPlan(recv_start={"a": 30.0}, recv_hold={"a"}))
    clock[0] = 51.0
    w.bind(StepPlan(recv_start={"b": 30.0}, recv_hold={"b"}))
    assert w._held == {"a", "b"}
    w.cm.landed = ["a", "b"]
    clock[0] = 52.0
    assert w.transfer_results().finished_recving == set()
    clock[0] = 53.5
    w.bind(StepPlan(recv_release={"a"}))
    assert w.transfer_results().finished_recving == {"a"} and w._held == {"b"}
    assert w.stats_delta()["transfer_times"] == [3.5]


def test_a_plans_pushes_peers_and_releases_reach_the_pusher(made) -> None:
    w = prefill_steps(made)
    w.shard = Shard(2, 1, 4, 16, "HN")
    w.geometry = Geometry("HN", 2, 16, 64, 100)
    w.tp_size, w.tp_rank = 2, 1
    wide = {"tp_size": 4, "block_size": 16, "kv_order": "HN"}
    plan = StepPlan(peers={"D": {0: b"m"}}, peer_geometry={"D": wide}, dropped=["gone"], send_release=["r1"])
    w.bind(plan)
    assert handed(w) == [("peers", {"D": {0: b"m"}}, {"D": [2, 3]}, {"D": wide}, {}),
                         ("plan", [], [], [], ["gone"]), ("release", "r1")]
    assert plan.send_release == []


# ---------------------------------------------------------------- the fence thread, shutdown, what registration sets
class RecordedSleepTime:
    """``worker.time`` with ``sleep`` recorded, not slept (the fence thread's pause before it retries an abort)."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self.slept: list[Any] = []

    def sleep(self, seconds: Any) -> None:
        self.slept.append(seconds)


def test_an_abort_that_times_out_is_retried_after_one_second_and_the_receive_still_reported(made, monkeypatch) -> None:
    """The prefill did not confirm an abort in time: its blocks stay held, the abort is tried again after 1 s,
    then the receive is reported failed; the fence thread goes on with the next one."""
    recorded = RecordedSleepTime()
    monkeypatch.setattr(worker_mod, "time", recorded)
    w = decode(made)
    w.cm.abort_fail = [kvtransport.TransferTimeout("the prefill did not confirm the abort")]
    w.bind(StepPlan(recv_start={"a": 30.0, "b": 30.0}))
    w.bind(StepPlan(recv_fail={"a": "its prefill failed"}))
    assert failed(results_until(w, lambda s: failed(s))) == {"a"}
    assert recorded.slept == [1.0]
    assert w.cm.of("abort") == [("abort", "a", CONNECT_TIMEOUT), ("abort", "a", CONNECT_TIMEOUT)]
    w.bind(StepPlan(recv_fail={"b": "its prefill failed"}))
    assert failed(results_until(w, lambda s: failed(s))) == {"b"}


def test_a_receive_failed_before_its_senders_are_known_aborts_the_part_that_landed_and_forgets_it(made) -> None:
    w = decode(made, shard=Shard(1, 0, 4, 16))
    w.bind(StepPlan(recv_start={"r": 30.0}))
    p0 = part_seq("r", 0, 2)
    w.cm.landed = [p0]
    assert w.transfer_results().finished_recving == set()
    assert w._landed == {"r": {p0}} and w._parts == {}
    w.bind(StepPlan(recv_fail={"r": "its prefill failed"}))
    assert failed(results_until(w, lambda s: failed(s))) == {"r"}
    assert w.cm.of("abort") == [("abort", s, CONNECT_TIMEOUT) for s in sorted({"r", p0})]
    assert w._landed == {} and w._parts == {}


def test_a_shut_down_worker_reports_and_counts_nothing(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}))
    w.shutdown()
    assert w.cm is None
    res = w.transfer_results()
    assert (res.finished_sending, res.finished_recving, res.failed_recving) == (set(), set(), set())
    assert w.stats_delta() == {}


def test_a_worker_without_a_pusher_counts_no_transfer_sent(made) -> None:
    w = decode(made)
    assert w.stats_delta() == {"bytes_sent": 0, "bytes_received": 0, "puts": 0, "puts_received": 0, "failures": 0,
                               "transfers_sent": 0, "transfers_received": 0, "transfer_times": [],
                               "transfer_failures": 0, "prefill_disconnects": 0, "backend": ["recorded"],
                               "paths": []}


def test_a_registered_worker_before_its_first_plan_hands_the_pusher_nothing(made) -> None:
    w = prefill_steps(made)
    w.save_kv_layer("L0", object())
    w.wait_for_save()
    assert handed(w) == []


def test_registration_whose_heads_do_not_match_the_model_keeps_vllms_blocks(made, monkeypatch, caplog) -> None:
    """2 KV heads in the cache at TP 1 of a 4-head model: not a shard of it; the block layout (like-for-like
    peers only), said once."""
    torch = pytest.importorskip("torch")
    caches = {f"L{i}": torch.zeros(8, 2, 16, 16) for i in range(2)}
    with caplog.at_level(logging.WARNING, logger="vllm.kvtransport"):
        w = registered(made, monkeypatch, caches, num_kv_heads=4, num_blocks=8)
    assert w.geometry is None and w.shard is None and w.layout.num_blocks == 8
    msgs = [r.getMessage() for r in caplog.records if "keeps the block layout" in r.getMessage()]
    assert msgs == ["kvtransport: worker 0 keeps the block layout (like-for-like peers only): "
                    "2 KV heads in the cache, 4 expected"]


def test_registration_guards_the_destination_channel_with_the_secret_and_fences_on_a_daemon_thread(
        made, monkeypatch) -> None:
    """Destinations straight from decodes are admitted only with the connector's secret; the fence thread must
    not keep a worker process alive at exit."""
    torch = pytest.importorskip("torch")
    caches = {f"L{i}": torch.zeros(8, 2, 16, 16) for i in range(2)}
    w = registered(made, monkeypatch, caches, settings={"backend_options": {"secret": "s3cret"}})
    assert w.dst_channel is not None and w.dst_channel._secret == b"s3cret"
    assert w._fencer is not None and w._fencer.daemon is True and w._fencer.is_alive()


class RecordedPusher:
    """What registration starts the pusher with (no thread)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.args, self.kw = args, kw
        self.q: queue.Queue[Any] = queue.Queue()
        self.groups = 1

    def close(self) -> None:
        pass


def test_registration_of_a_cuda_cache_makes_the_pusher_wait_for_the_forward(made, monkeypatch) -> None:
    """A GPU cache (here: a host cache described as on cuda:0): the pusher orders its puts after the forward's
    CUDA events (``cuda=True``); without it a put could read a layer the forward is still writing."""
    torch = pytest.importorskip("torch")
    real_unit_layout = worker_mod.unit_layout
    monkeypatch.setattr(worker_mod, "unit_layout",
                        lambda caches, geo: dataclasses.replace(real_unit_layout(caches, geo), device="cuda:0"))
    monkeypatch.setattr(worker_mod, "Pusher", RecordedPusher)
    caches = {f"L{i}": torch.zeros(8, 2, 16, 16) for i in range(2)}
    w = registered(made, monkeypatch, caches)
    assert w.layout.is_cuda and w.pusher.kw["cuda"] is True


# ---------------------------------------------------------------- a plan's receive orders, edge cases
def test_a_release_that_comes_before_the_kv_reports_it_as_soon_as_it_lands(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_hold={"r"}))
    w.bind(StepPlan(recv_release={"r"}))
    assert w._held == set() and w._landed_held == {}
    w.cm.landed = ["r"]
    assert w.transfer_results().finished_recving == {"r"}


def test_an_abort_or_a_failure_of_a_receive_never_started_reports_nothing(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_abort=["ghost"], recv_fail={"phantom": "its prefill failed"}))
    assert list(w._reported) == [] and w.cm.calls == []
    res = w.transfer_results()
    assert (res.finished_recving, res.failed_recving) == (set(), set())
    assert w.stats_delta()["transfer_failures"] == 0


def test_a_failed_receive_held_for_its_first_token_is_no_longer_held(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"r": 30.0}, recv_hold={"r"}))
    w.bind(StepPlan(recv_fail={"r": "its prefill failed"}))
    assert w._held == set()
    assert failed(results_until(w, lambda s: failed(s))) == {"r"}


def test_every_failure_of_a_plan_is_counted_once_a_landed_one_among_them(made) -> None:
    """Three failures in one plan: one waiting, one landed and held for its first token (nothing to abort: failed
    at once), one waiting again; each counted once, all reported failed."""
    w = decode(made)
    w.bind(StepPlan(recv_start={"b": 30.0, "a": 30.0, "c": 30.0}, recv_hold={"a"}))
    w.cm.landed = ["a"]
    assert w.transfer_results().finished_recving == set()
    w.bind(StepPlan(recv_fail={"b": "its prefill failed", "a": "its first token will not come",
                               "c": "its prefill failed"}))
    assert failed(results_until(w, lambda s: failed(s) == {"a", "b", "c"})) == {"a", "b", "c"}
    assert w._landed_held == {} and w._held == set()
    assert w.stats_delta()["transfer_failures"] == 3
    assert w.cm.of("abort") == [("abort", "b", CONNECT_TIMEOUT), ("abort", "c", CONNECT_TIMEOUT)]


def test_receives_failed_with_their_prefill_lost_in_one_plan_count_each(made) -> None:
    w = decode(made)
    w.bind(StepPlan(recv_start={"a": 30.0, "b": 30.0}))
    w.bind(StepPlan(recv_fail={"a": "gone", "b": "gone"},
                    recv_fail_kind={"a": FailureKind.PREFILL_LOST, "b": FailureKind.PREFILL_LOST}))
    assert w.stats_delta()["prefill_disconnects"] == 2


def test_a_failed_receive_forgets_its_parts_that_landed_early_and_only_those(made) -> None:
    w = decode(made, shard=Shard(1, 0, 4, 16))
    r0, q0 = part_seq("r", 0, 2), part_seq("q", 0, 2)
    w.cm.landed = [r0, q0]
    w.transfer_results()  # neither is waited for yet
    w.bind(StepPlan(recv_start={"r": 30.0}))
    w.bind(StepPlan(recv_fail={"r": "its prefill failed"}))
    assert list(w._early) == [q0]
    assert failed(results_until(w, lambda s: failed(s))) == {"r"}
