"""Fault scenarios shared by every backend's conformance suite: the abort storm (random cancels on both
sides while blocks are reused) and peer kills at random points (a survivor in the test process, victims
in spawned processes that are SIGKILLed)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from typing import Any

from .. import (
    CommClosed,
    PeerDisconnected,
    SequenceAborted,
    TransferError,
    TransferTimeout,
)
from .. import open as kv_open
from ..workload.caches import CacheSpec, make_cache, read_block, zero_block
from ..workload.harness import RoleLink
from . import pair_devices

KILL_SPEC = CacheSpec(num_layers=2, num_blocks=64, heads=2, block_size=4, head_dim=16, itemsize=2, order="HND")
STORM_SPEC = CacheSpec(num_layers=3, num_blocks=64, heads=1, block_size=4, head_dim=32, itemsize=2, order="NHD")
BOUND = 30.0


def _kill(p: Any) -> None:
    """SIGKILL a started victim process (never a process group)."""
    if p.pid is None or p.pid <= 0:
        raise AssertionError("victim process has no pid")
    os.kill(p.pid, signal.SIGKILL)


def _src_blocks(seq: int, k: int) -> list[int]:
    return random.Random(seq).sample(range(STORM_SPEC.num_blocks), k)


# ============================================================== abort storm
def storm_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    n, window = cfg["storm_seqs"], 4
    rng = random.Random(cfg["seed"])
    cache = make_cache(STORM_SPEC, pair_devices(cfg)[1])
    expected = make_cache(STORM_SPEC, "cpu", fill_seed=cfg["seed"])
    free = list(range(STORM_SPEC.num_blocks))
    rng.shuffle(free)
    assigned: dict[int, list[int]] = {}
    counts = {"completed": 0, "aborted": 0, "cancelled": 0, "bad": 0}
    problems: list[str] = []

    def assign(i: int) -> None:
        k = rng.randint(1, 4)
        assigned[i] = [free.pop() for _ in range(k)]
        link.send_value(("seq", i, assigned[i]))

    def recycle(i: int) -> None:
        for b in assigned.pop(i):
            zero_block(cache, b)
            free.append(b)

    opts = dict(cfg.get("options", {}))
    with kv_open(cache.layout, backend=cfg["backend"], capacity=16, **opts) as cm:
        link.publish(cm.metadata())
        for i in range(min(window, n)):
            assign(i)
        for i in range(n):
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.003)
                cm.abort(i, timeout=BOUND)  # fence: nothing of i can land after this
                counts["aborted"] += 1
                for b in assigned[i]:
                    zero_block(cache, b)
                # the sender is still mid-sequence: a late put would land now (every tenth abort waits longer:
                # a put that was in flight when the sender confirmed, on an asynchronous path, lands later)
                time.sleep(0.05 if counts["aborted"] % 10 == 0 else 0.004)
                for b in assigned[i]:
                    if any(any(read_block(cache, layer, b)) for layer in range(STORM_SPEC.num_layers)):
                        problems.append(f"seq {i}: data landed in block {b} after abort() returned")
            else:
                try:
                    cm.wait(i, timeout=BOUND)
                    src = _src_blocks(i, len(assigned[i]))
                    for layer in range(STORM_SPEC.num_layers):
                        for s, d in zip(src, assigned[i], strict=True):
                            if read_block(cache, layer, d) != read_block(expected, layer, s):
                                problems.append(f"seq {i} layer {layer} block {d}: wrong bytes")
                    counts["completed"] += 1
                except SequenceAborted:
                    counts["cancelled"] += 1
                cm.release(i)
            recycle(i)
            if i + window < n:
                assign(i + window)
        link.send_value(("end",))
        link.barrier("sender-done")
        time.sleep(0.2)  # anything late would land now
        dirty = [b for b in range(STORM_SPEC.num_blocks)
                 for layer in range(STORM_SPEC.num_layers) if any(read_block(cache, layer, b))]
        stats = cm.stats()
    return {"counts": counts, "problems": problems[:20], "dirty_free_blocks": sorted(set(dirty)),
            "slots_in_use": stats["slots_in_use"], "aborted_stat": stats["aborted"]}


def storm_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    cache = make_cache(STORM_SPEC, pair_devices(cfg)[0], fill_seed=cfg["seed"])
    counts = {"sent": 0, "refused": 0, "cancelled": 0}
    with kv_open(cache.layout, backend=cfg["backend"], **dict(cfg.get("options", {}))) as cm:
        peer = cm.connect(link.peer_metadata())
        while True:
            msg = link.recv_value(timeout=120)
            if msg[0] == "end":
                break
            _, i, dst = msg
            src = _src_blocks(i, len(dst))
            rng = random.Random(i * 7 + 1)
            cancel_at = rng.randrange(STORM_SPEC.num_layers) if rng.random() < 0.15 else None
            try:
                for layer in range(STORM_SPEC.num_layers):
                    if layer == cancel_at:
                        cm.cancel(peer, i)
                        counts["cancelled"] += 1
                        break
                    cm.put_layer(peer, i, layer, src, dst)
                    cm.signal_layer(peer, i, layer)
                    time.sleep(0.001)  # a prefill computing its next layer: aborts land mid-sequence
                else:
                    cm.signal(peer, i)
                    counts["sent"] += 1
            except SequenceAborted:
                counts["refused"] += 1
            if i >= 8:
                cm.release(i - 8)  # forget old error records (bounded memory)
        cm.flush(peer, timeout=BOUND)
        link.barrier("sender-done")
    return counts


# ============================================================== kills
def _victim_sender(meta: bytes, cfg: dict[str, Any], plan: list[tuple[int, list[int], list[int]]], ready: Any) -> None:
    cache = make_cache(CacheSpec(**cfg["spec"]), pair_devices(cfg)[0], fill_seed=cfg["seed"])
    cm = kv_open(cache.layout, backend=cfg["backend"], **dict(cfg.get("options", {})))
    peer = cm.connect(meta)
    ready.set()
    for seq, src, dst in plan:
        for layer in range(cache.spec.num_layers):
            cm.put_layer(peer, seq, layer, src, dst)
            cm.signal_layer(peer, seq, layer)
            time.sleep(0.002)
        cm.signal(peer, seq)
    cm.flush(peer, timeout=BOUND)
    time.sleep(60)  # wait to be killed


def _victim_receiver(cfg: dict[str, Any], conn: Any, fresh: list[tuple[int, int]] | None = None) -> None:
    spec = CacheSpec(**cfg["spec"])
    cache = make_cache(spec, pair_devices(cfg)[1])
    cm = kv_open(cache.layout, backend=cfg["backend"], **dict(cfg.get("options", {})))
    conn.send(cm.metadata())
    if fresh is None:
        time.sleep(60)  # wait to be killed
        return
    expected = make_cache(spec, "cpu", fill_seed=cfg["seed"])
    try:
        cm.wait("fresh", timeout=BOUND)
        bad = [(s, d) for layer in range(spec.num_layers) for s, d in fresh
               if read_block(cache, layer, d) != read_block(expected, layer, s)]
        conn.send("ok" if not bad else f"wrong bytes in {bad[:5]}")
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
    cm.close()


def kill_senders(cfg: dict[str, Any], rounds: int, per_round: int) -> dict[str, Any]:
    """Survivor = receiver (this process); each round a new sender is SIGKILLed at a random moment."""
    spec = CacheSpec(**cfg["spec"])
    rng = random.Random(cfg["seed"])
    ctx = mp.get_context("spawn")
    cache = make_cache(spec, pair_devices(cfg)[1])
    expected = make_cache(spec, "cpu", fill_seed=cfg["seed"])
    out: dict[str, Any] = {"transfers": 0, "completed": 0, "failed": 0, "late_s": 0.0, "problems": [], "leaks": []}
    with kv_open(cache.layout, backend=cfg["backend"], **dict(cfg.get("options", {}))) as cm:
        meta = cm.metadata()
        for rnd in range(rounds + 1):
            final = rnd == rounds  # the last sender is not killed: fresh transfers must work
            plan = []
            blocks = list(range(spec.num_blocks))
            rng.shuffle(blocks)
            for j in range(per_round):
                dst = blocks[j * 2 : j * 2 + 2]
                plan.append((f"r{rnd}-{j}", rng.sample(range(spec.num_blocks), 2), dst))
            ready = ctx.Event()
            p = ctx.Process(target=_victim_sender, args=(meta, cfg, plan, ready), daemon=True)
            p.start()
            if not ready.wait(60):
                p.kill()
                raise AssertionError("victim sender did not connect")
            deadline = time.monotonic() + 10
            while not cm.inbound_peers() and time.monotonic() < deadline:
                time.sleep(0.01)
            sender = cm.inbound_peers()[0]
            for seq, _, _ in plan:  # attribute the sequences: they fail at once if this sender dies
                cm.expect(seq, sender=sender)
            if not final:
                time.sleep(rng.random() * 0.05 * per_round)
                _kill(p)
            for seq, src, dst in plan:
                out["transfers"] += 1
                t0 = time.monotonic()
                try:
                    cm.wait(seq, timeout=BOUND)
                    out["completed"] += 1
                    for layer in range(spec.num_layers):
                        for s, d in zip(src, dst, strict=True):
                            if read_block(cache, layer, d) != read_block(expected, layer, s):
                                out["problems"].append(f"{seq}: wrong bytes")
                except (PeerDisconnected, TransferError) as exc:
                    if final:
                        out["problems"].append(f"{seq}: fresh transfer failed: {exc}")
                    out["failed"] += 1
                out["late_s"] = max(out["late_s"], time.monotonic() - t0)
                cm.release(seq)
            for _, _, dst in plan:
                for b in dst:
                    zero_block(cache, b)
            p.kill()
            p.join(10)
            deadline = time.monotonic() + 5
            while cm.stats()["inbound_peers"] and time.monotonic() < deadline:
                time.sleep(0.05)
            st = cm.stats()
            if st["slots_in_use"] or (not final and st["inbound_peers"]):
                out["leaks"].append(f"round {rnd}: slots {st['slots_in_use']}, inbound peers {st['inbound_peers']}")
    return out


def kill_receivers(cfg: dict[str, Any], rounds: int, per_round: int) -> dict[str, Any]:
    """Survivor = sender (this process); each round a new receiver is SIGKILLed mid-stream."""
    spec = CacheSpec(**cfg["spec"])
    rng = random.Random(cfg["seed"] + 1)
    ctx = mp.get_context("spawn")
    cache = make_cache(spec, pair_devices(cfg)[0], fill_seed=cfg["seed"])
    out: dict[str, Any] = {"transfers": 0, "ok": 0, "failed": 0, "late_s": 0.0, "problems": [], "leaks": []}
    with kv_open(cache.layout, backend=cfg["backend"], timeout=10.0, **dict(cfg.get("options", {}))) as cm:
        for rnd in range(rounds):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_victim_receiver, args=(cfg, child), daemon=True)
            p.start()
            if not parent.poll(60):
                p.kill()
                raise AssertionError("victim receiver did not start")
            peer = cm.connect(parent.recv())
            kill_at = rng.randrange(per_round)
            for j in range(per_round):
                if j == kill_at:
                    _kill(p)
                out["transfers"] += 1
                t0 = time.monotonic()
                try:
                    src = rng.sample(range(spec.num_blocks), 2)
                    for layer in range(spec.num_layers):
                        cm.put_layer(peer, f"r{rnd}-{j}", layer, src, [0, 1])
                    cm.signal(peer, f"r{rnd}-{j}")
                    cm.flush(peer, timeout=10.0)
                    out["ok"] += 1
                except (PeerDisconnected, TransferTimeout, CommClosed, TransferError):
                    out["failed"] += 1
                out["late_s"] = max(out["late_s"], time.monotonic() - t0)
            p.join(10)
            cm.disconnect(peer)
            st = cm.stats()
            if st["outbound_peers"]:
                out["leaks"].append(f"round {rnd}: outbound peers {st['outbound_peers']}")
        # a fresh receiver in a real process: the survivor's next transfer must land intact
        fresh = list(zip(rng.sample(range(spec.num_blocks), 4), range(4), strict=True))
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_victim_receiver, args=(cfg, child, fresh), daemon=True)
        p.start()
        if not parent.poll(60):
            p.kill()
            raise AssertionError("fresh receiver did not start")
        peer = cm.connect(parent.recv())
        for layer in range(spec.num_layers):
            cm.put_layer(peer, "fresh", layer, [s for s, _ in fresh], [d for _, d in fresh])
        cm.signal(peer, "fresh")
        cm.flush(peer, timeout=BOUND)
        out["fresh"] = parent.recv() if parent.poll(BOUND) else "no answer"
        p.join(10)
        cm.disconnect(peer)
    return out
