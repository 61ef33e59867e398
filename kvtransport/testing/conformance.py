"""The conformance suite every backend adopts: two real processes, random vLLM-shaped layouts,
fragmented block ids, bytes verified on the receiver (and every other block checked untouched).

Adopt it with::

    from kvtransport.testing.conformance import ConformanceSuite

    class TestMyBackend(ConformanceSuite):
        backend = "mine"
        device = "cpu"            # or "cuda"; two-GPU runs put the receiver on cuda:1

Each test spawns a receiver and a sender process (see :mod:`kvtransport.workload.harness`); the role
functions below are the scenarios, usable on their own (``run_pair``) for GPU scripts too.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any, ClassVar

import pytest

from .. import (
    CommClosed,
    IncompatiblePeer,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    SlotsExhausted,
    TransferTimeout,
)
from .. import open as kv_open
from ..workload.caches import ORDERS, CacheSpec, host_copy, make_cache, verify_transfer
from ..workload.harness import RoleLink, run_pair
from . import pair_devices
from .faults import KILL_SPEC

WAIT = 60.0


def random_spec(rng: random.Random, *, order: str | None = None, blocks: tuple[int, int] = (24, 96)) -> CacheSpec:
    return CacheSpec(
        num_layers=rng.randint(1, 4),
        num_blocks=rng.randint(*blocks),
        heads=rng.choice([1, 2, 4]),
        block_size=rng.choice([1, 4, 16]),
        head_dim=rng.choice([8, 32, 64]),
        itemsize=rng.choice([1, 2]),
        order=order or rng.choice(ORDERS),
    )


def plan_transfers(
    seed: int, sender: CacheSpec, receiver: CacheSpec, n_seqs: int
) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """Per sequence, per layer: fragmented (src, dst) pairs; destinations disjoint across sequences."""
    rng = random.Random(seed)
    dst_pool = list(range(receiver.num_blocks))
    rng.shuffle(dst_pool)
    per_seq = max(1, min(len(dst_pool) // n_seqs, 24))
    plans: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for s in range(n_seqs):
        dsts = dst_pool[s * per_seq : (s + 1) * per_seq]
        if rng.random() < 0.3:
            dsts.sort()  # some sequences get contiguous-ish runs
        srcs = rng.sample(range(sender.num_blocks), len(dsts))
        if rng.random() < 0.3:
            start = rng.randrange(0, max(1, sender.num_blocks - len(dsts)))
            srcs = list(range(start, start + len(dsts)))
        plans[f"seq-{s}"] = {layer: list(zip(srcs, dsts, strict=True)) for layer in range(sender.num_layers)}
    return plans



def _open(cfg: dict[str, Any], layout: Any, **extra: Any) -> Any:
    opts = dict(cfg.get("options", {}))
    opts.update(extra)
    return kv_open(layout, backend=cfg["backend"], **opts)


# ============================================================== scenario: fragmented transfer
def fragmented_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = CacheSpec(**cfg["receiver_spec"])
    sender_spec = CacheSpec(**cfg["sender_spec"])
    cache = make_cache(spec, pair_devices(cfg)[1])
    plans = plan_transfers(cfg["seed"], sender_spec, spec, cfg["n_seqs"])
    with _open(cfg, cache.layout, capacity=max(cfg["n_seqs"], 1)) as cm:
        link.publish(cm.metadata())
        for seq in plans:  # layer by layer, as a decode worker would
            for layer in range(spec.num_layers):
                cm.wait_layer(seq, layer, timeout=WAIT)
            cm.wait(seq, timeout=WAIT)
        finished = set(cm.poll())
        missing = set(plans) - finished
        merged: dict[int, list[tuple[int, int]]] = {}
        for plan in plans.values():
            for layer, pairs in plan.items():
                merged.setdefault(layer, []).extend(pairs)
        problems = verify_transfer(host_copy(cache), host_copy(make_cache(sender_spec, "cpu", cfg["seed"])), merged)
        for seq in plans:
            cm.release(seq)
        stats = cm.stats()
        link.barrier("verified")
    return {"problems": problems, "missing": sorted(missing), "slots_in_use": stats["slots_in_use"],
            "bytes_received": stats["bytes_received"], "puts_received": stats["puts_received"]}


def fragmented_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = CacheSpec(**cfg["sender_spec"])
    receiver_spec = CacheSpec(**cfg["receiver_spec"])
    cache = make_cache(spec, pair_devices(cfg)[0], fill_seed=cfg["seed"])
    plans = plan_transfers(cfg["seed"], spec, receiver_spec, cfg["n_seqs"])
    with _open(cfg, cache.layout) as cm:
        peer = cm.connect(link.peer_metadata())
        if cfg.get("api") == "put_layers":  # whole requests: one call each, every layer (some in reverse order)
            for i, (seq, plan) in enumerate(plans.items()):
                src, dst = zip(*plan[0], strict=True)
                layers = None if i % 2 == 0 else list(reversed(range(spec.num_layers)))
                cm.put_layers(peer, seq, layers, list(src), list(dst))
        else:
            for layer in range(spec.num_layers):  # layer-wise push, sequences interleaved
                for seq, plan in plans.items():
                    src, dst = zip(*plan[layer], strict=True)
                    cm.put_layer(peer, seq, layer, list(src), list(dst))
                    cm.signal_layer(peer, seq, layer)
        for seq in plans:
            cm.signal(peer, seq)
        cm.flush(peer, timeout=WAIT)
        stats = cm.stats()
        link.barrier("verified")
    return {"bytes_sent": stats["bytes_sent"], "puts": stats["puts"], "path": peer.path}


# ============================================================== scenario: timeouts
def timeout_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["receiver_spec"]), pair_devices(cfg)[1])
    out: dict[str, Any] = {}
    with _open(cfg, cache.layout) as cm:
        link.publish(cm.metadata())
        link.barrier("connected")
        for what in ("wait", "wait_layer"):
            t0 = time.monotonic()
            try:
                if what == "wait":
                    cm.wait("never", timeout=0.5)
                else:
                    cm.wait_layer("never", 0, timeout=0.5)
                out[what] = "returned"
            except TransferTimeout:
                out[what] = time.monotonic() - t0
        link.barrier("done")
    return out


def timeout_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["sender_spec"]), pair_devices(cfg)[0], fill_seed=1)
    with _open(cfg, cache.layout) as cm:
        cm.connect(link.peer_metadata())
        link.barrier("connected")
        link.barrier("done")
    return {}


# ============================================================== scenario: sender goes away mid-sequence
def dropout_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["receiver_spec"]), pair_devices(cfg)[1])
    with _open(cfg, cache.layout) as cm:
        link.publish(cm.metadata())
        cm.wait_layer("s", 0, timeout=WAIT)
        t0 = time.monotonic()
        try:
            cm.wait("s", timeout=WAIT)
            outcome = "returned"
        except PeerDisconnected:
            outcome = "PeerDisconnected"
        detected = time.monotonic() - t0
        t1 = time.monotonic()
    return {"outcome": outcome, "detected_s": detected, "close_s": time.monotonic() - t1}


def dropout_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = CacheSpec(**cfg["sender_spec"])
    cache = make_cache(spec, pair_devices(cfg)[0], fill_seed=2)
    cm = _open(cfg, cache.layout)
    peer = cm.connect(link.peer_metadata())
    cm.put_layer(peer, "s", 0, [0, 1, 2], [3, 4, 5])
    cm.signal_layer(peer, "s", 0)
    cm.put_layer(peer, "s", 0, [5], [9])  # a put in flight, never signalled
    cm.flush(peer, timeout=WAIT)
    if cfg.get("hard_exit"):
        link.conn.send(("result", {"close_s": 0.0}))
        os._exit(0)  # the process vanishes: no goodbye, sockets closed by the kernel
    t0 = time.monotonic()
    cm.close()
    return {"close_s": time.monotonic() - t0}


# ============================================================== scenario: receiver goes away
def vanish_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["receiver_spec"]), pair_devices(cfg)[1])
    cm = _open(cfg, cache.layout)
    link.publish(cm.metadata())
    link.barrier("connected")
    cm.close()
    link.barrier("closed")
    return {}


def vanish_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["sender_spec"]), pair_devices(cfg)[0], fill_seed=3)
    with _open(cfg, cache.layout, timeout=10.0) as cm:
        peer = cm.connect(link.peer_metadata())
        link.barrier("connected")
        link.barrier("closed")
        t0 = time.monotonic()
        outcome = "no error"
        for i in range(200):
            try:
                cm.put_layer(peer, "x", 0, [0], [i % 4])
                cm.signal(peer, "x")
                cm.flush(peer, timeout=10.0)
                time.sleep(0.01)
            except (PeerDisconnected, TransferTimeout, CommClosed) as exc:
                outcome = type(exc).__name__
                break
        return {"outcome": outcome, "detected_s": time.monotonic() - t0}


# ============================================================== scenario: incompatible layouts
def mismatch_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["receiver_spec"]), pair_devices(cfg)[1])
    with _open(cfg, cache.layout) as cm:
        link.publish(cm.metadata())
        link.barrier("tried")
        untouched = not any(host_copy(cache).backing)
        stats = cm.stats()
    return {"untouched": untouched, "bytes_received": stats["bytes_received"]}


def mismatch_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["sender_spec"]), pair_devices(cfg)[0], fill_seed=4)
    with _open(cfg, cache.layout) as cm:
        try:
            cm.connect(link.peer_metadata())
            outcome, message = "connected", ""
        except IncompatiblePeer as exc:
            outcome, message = "IncompatiblePeer", str(exc)
        link.barrier("tried")
    return {"outcome": outcome, "message": message}


# ============================================================== scenario: slot exhaustion and release
def slots_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["receiver_spec"]), pair_devices(cfg)[1])
    out: dict[str, Any] = {}
    with _open(cfg, cache.layout, capacity=2) as cm:
        link.publish(cm.metadata())
        cm.wait("a", timeout=WAIT)
        cm.wait("b", timeout=WAIT)
        link.barrier("two-done")
        link.barrier("third-sent")
        try:
            cm.wait("c", timeout=5)
            out["third"] = "returned"
        except SlotsExhausted:
            out["third"] = "SlotsExhausted"
        cm.release("a")
        try:
            cm.wait("a", timeout=0.2)
            out["released_wait"] = "returned"
        except (TransferTimeout, SequenceAborted) as exc:
            out["released_wait"] = type(exc).__name__
        cm.release("a")
        link.barrier("released")
        cm.wait("d", timeout=WAIT)
        out["fourth"] = "returned"
        out["slots_in_use"] = cm.stats()["slots_in_use"]
        link.barrier("end")
    return out


def slots_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["sender_spec"]), pair_devices(cfg)[0], fill_seed=5)
    out: dict[str, Any] = {}
    with _open(cfg, cache.layout) as cm:
        peer = cm.connect(link.peer_metadata())
        for i, seq in enumerate("ab"):
            cm.put_layer(peer, seq, 0, [i], [i])
            cm.signal(peer, seq)
        link.barrier("two-done")
        cm.put_layer(peer, "c", 0, [2], [2])
        out["third"] = "no error"
        try:  # the receiver's refusal of the put may already be back (two-sided links refuse the put itself)
            cm.signal(peer, "c")
            cm.flush(peer, timeout=WAIT)
        except SlotsExhausted:
            out["third"] = "SlotsExhausted"
        link.barrier("third-sent")
        deadline = time.monotonic() + 10
        while out["third"] != "SlotsExhausted" and time.monotonic() < deadline:  # or it arrives asynchronously
            try:
                cm.signal(peer, "c")
            except SlotsExhausted:
                out["third"] = "SlotsExhausted"
                break
            time.sleep(0.05)
        cm.release("c")
        link.barrier("released")
        cm.put_layer(peer, "d", 0, [3], [3])
        cm.signal(peer, "d")
        cm.flush(peer, timeout=WAIT)
        link.barrier("end")
    return out


# ============================================================== scenario: shared secret
def secret_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["receiver_spec"]), pair_devices(cfg)[1])
    with _open(cfg, cache.layout, secret="s3cret") as cm:
        link.publish(cm.metadata())
        cm.wait("friend", timeout=WAIT)
        stats = cm.stats()
    return {"refused": stats["refused_peers"]}


def secret_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(CacheSpec(**cfg["sender_spec"]), pair_devices(cfg)[0], fill_seed=8)
    meta = link.peer_metadata()
    outcomes = []
    for secret in (None, "wrong"):
        with _open(cfg, cache.layout, **({"secret": secret} if secret else {})) as stranger:
            try:
                stranger.connect(meta)
                outcomes.append("connected")
            except ProtocolError as exc:
                outcomes.append("refused" if "KV_TRANSPORT_SECRET" in str(exc) else str(exc))
    with _open(cfg, cache.layout, secret="s3cret") as cm:
        peer = cm.connect(meta)
        cm.put_layer(peer, "friend", 0, [1], [1])
        cm.signal(peer, "friend")
        cm.flush(peer, timeout=WAIT)
    return {"outcomes": outcomes}


# ============================================================== the suite
_SMALL = CacheSpec(num_layers=2, num_blocks=16, heads=2, block_size=4, head_dim=16, itemsize=2, order="NHD")


class ConformanceSuite:
    """Subclass with ``backend`` (and ``device``) set; pytest collects every test below."""

    backend: ClassVar[str] = ""
    device: ClassVar[str] = "cpu"
    options: ClassVar[dict[str, Any]] = {}
    pair_timeout: ClassVar[float] = 120.0

    def cfg(self, **kw: Any) -> dict[str, Any]:
        base = {"backend": self.backend, "device": self.device, "options": dict(self.options), "seed": 0,
                "receiver_spec": _SMALL.to_dict(), "sender_spec": _SMALL.to_dict()}
        base.update(kw)
        return base

    def pair(self, name: str, cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        mod = __name__
        return run_pair(f"{mod}.{name}_receiver", f"{mod}.{name}_sender", cfg, timeout=self.pair_timeout)

    @pytest.mark.parametrize("seed", [1, 2, 3])
    def test_fragmented_random_layouts(self, seed: int) -> None:
        rng = random.Random(seed)
        spec = random_spec(rng)
        # the peer may have a different number of blocks, never a different block geometry
        receiver = CacheSpec(**{**spec.to_dict(), "num_blocks": rng.randint(24, 96)})
        r, s = self.pair("fragmented", self.cfg(seed=seed, sender_spec=spec.to_dict(),
                                                receiver_spec=receiver.to_dict(), n_seqs=rng.randint(1, 4)))
        assert r["problems"] == [], r["problems"]
        assert r["missing"] == []
        assert r["slots_in_use"] == 0
        # two-sided backends count PUT frames, one-sided ones the counts each SIGNAL carries: exact either way
        assert (r["bytes_received"], r["puts_received"]) == (s["bytes_sent"], s["puts"]) != (0, 0)

    @pytest.mark.parametrize("seed", [4, 5])
    def test_whole_requests_in_one_call(self, seed: int) -> None:
        """``put_layers``: every layer of a request in one call (one launch on device paths)."""
        rng = random.Random(seed)
        spec = CacheSpec(**{**random_spec(rng).to_dict(), "num_layers": rng.randint(2, 5)})
        receiver = CacheSpec(**{**spec.to_dict(), "num_blocks": rng.randint(24, 96)})
        r, s = self.pair("fragmented", self.cfg(seed=seed, sender_spec=spec.to_dict(), receiver_spec=receiver.to_dict(),
                                                n_seqs=rng.randint(2, 4), api="put_layers"))
        assert r["problems"] == [], r["problems"]
        assert r["missing"] == [] and r["slots_in_use"] == 0
        assert (r["bytes_received"], r["puts_received"]) == (s["bytes_sent"], s["puts"]) != (0, 0)

    def test_many_concurrent_sequences(self) -> None:
        spec = CacheSpec(num_layers=2, num_blocks=256, heads=1, block_size=4, head_dim=16, itemsize=1, order="HND")
        r, _ = self.pair("fragmented", self.cfg(seed=7, sender_spec=spec.to_dict(), receiver_spec=spec.to_dict(), n_seqs=64))
        assert r["problems"] == [] and r["missing"] == [] and r["slots_in_use"] == 0

    def test_waits_time_out(self) -> None:
        r, _ = self.pair("timeout", self.cfg())
        for what in ("wait", "wait_layer"):
            assert isinstance(r[what], float), r
            assert 0.45 <= r[what] < 3.0, r

    def test_sender_closes_mid_sequence(self) -> None:
        r, s = self.pair("dropout", self.cfg())
        assert r["outcome"] == "PeerDisconnected"
        assert r["detected_s"] < 10 and r["close_s"] < 10 and s["close_s"] < 10

    def test_sender_process_dies_mid_sequence(self) -> None:
        r, _ = self.pair("dropout", self.cfg(hard_exit=True))
        assert r["outcome"] == "PeerDisconnected"
        assert r["detected_s"] < 10 and r["close_s"] < 10

    def test_receiver_goes_away(self) -> None:
        _, s = self.pair("vanish", self.cfg())
        assert s["outcome"] == "PeerDisconnected", s  # noticed as gone, not a wait that ran out
        assert s["detected_s"] < 15

    def test_incompatible_layouts_refused_before_any_byte(self) -> None:
        other = CacheSpec(**{**_SMALL.to_dict(), "order": "HND"})
        r, s = self.pair("mismatch", self.cfg(sender_spec=other.to_dict()))
        assert s["outcome"] == "IncompatiblePeer"
        assert "differs" in s["message"]
        assert r["untouched"] and r["bytes_received"] == 0

    def test_unauthenticated_peer_refused(self) -> None:
        r, s = self.pair("secret", self.cfg())
        assert s["outcomes"] == ["refused", "refused"]
        # the stranger without a secret reached the receiver and was refused there; the one with the wrong
        # secret refused the receiver's sealed metadata before connecting
        assert r["refused"] == 1

    def test_abort_storm(self) -> None:
        """1,000 sequences, random aborts (receiver) and cancels (sender) while blocks are reused."""
        r, s = run_pair("kvtransport.testing.faults.storm_receiver", "kvtransport.testing.faults.storm_sender",
                        self.cfg(seed=11, storm_seqs=1000), timeout=600)
        assert r["problems"] == [], r["problems"]
        assert r["dirty_free_blocks"] == [], "late data landed in freed blocks"
        assert r["slots_in_use"] == 0
        c = r["counts"]
        assert sum(c.values()) == 1000 and c["completed"] > 500 and c["aborted"] > 100 and c["cancelled"] > 50, c
        assert s["cancelled"] >= c["cancelled"]  # a cancel may race with (and lose to) an abort

    def test_kill_senders_at_random_points(self) -> None:
        from .faults import kill_senders

        out = kill_senders(self.cfg(spec=KILL_SPEC.to_dict(), seed=5), rounds=10, per_round=12)
        assert out["transfers"] >= 120
        assert out["problems"] == [] and out["leaks"] == [], out
        assert out["late_s"] < 15, "a wait outlived its bound"
        assert out["failed"] > 0 and out["completed"] > 12, out

    def test_kill_receivers_at_random_points(self) -> None:
        from .faults import kill_receivers

        out = kill_receivers(self.cfg(spec=KILL_SPEC.to_dict(), seed=6), rounds=8, per_round=12)
        assert out["transfers"] >= 96
        assert out["leaks"] == [] and out["fresh"] == "ok", out
        assert out["late_s"] < 15, "an operation outlived its bound"
        assert out["failed"] > 0, out

    def test_slot_exhaustion_and_reuse(self) -> None:
        r, s = self.pair("slots", self.cfg())
        assert r["third"] == "SlotsExhausted"
        assert s["third"] == "SlotsExhausted"
        assert r["released_wait"] in ("TransferTimeout", "SequenceAborted")
        assert r["fourth"] == "returned"
        assert r["slots_in_use"] == 2  # b and d
