"""The flood scenario against a receiver (run in real processes by :func:`kvtransport.workload.harness.run_pair`):
after a warm-up link and a baseline taken before the first stranger, hundreds of unauthenticated connections
announce large HELLOs, send part of them (80 MiB in all first: past the pre-handshake byte budget) and stall,
and keep coming; a legitimate sender (with the secret) is served in rounds, each after more than MAX_PENDING
further strangers, over a new link and its link of the round before. The receiver's peak RSS, threads and
admission counters are reported for during and after. The other hostile-peer roles: :mod:`.hostile`."""

from __future__ import annotations

import collections
import gc
import socket
import threading
import time
from typing import Any

from kvtransport import open as kv_open
from kvtransport import wire
from kvtransport.admission import MAX_PENDING_BYTES

from ..workload.caches import HostCache, verify_transfer
from ..workload.harness import RoleLink
from .hostile import PAIRS, SPEC, os_threads, py_threads, rss_mib, status_mib

# ============================================================== flood
OLD_PAIRS = [(4, 10), (5, 11)]
"""Blocks a legitimate sender writes over the link it opened in the round before (FLOOD: served over both)."""


def _round_plan(k: int) -> dict[int, list[tuple[int, int]]]:
    """What the receiver holds after flood round ``k``: PAIRS over the new link, OLD_PAIRS over the old one."""
    pairs = PAIRS + (OLD_PAIRS if k > 0 else [])
    return {layer: pairs for layer in range(SPEC.num_layers)}


def _kvt_threads() -> list[str]:
    return [n for n in py_threads() if n.startswith("kvt-")]


def _reset_peak_rss() -> bool:
    """Start a new VmHWM (peak RSS) window (Linux: ``5`` to /proc/self/clear_refs). False when unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    return status_mib("VmHWM")


class _Sampler:
    """Samples the receiver's RSS, OS threads and ``kvt-`` threads every ``interval`` s on a thread of its
    own (started before the baseline, so that the baseline counts it); keeps the largest values seen."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.max_rss = 0.0
        self.max_threads = 0
        self.extra_kvt: set[str] = set()
        self.max_extra_kvt = 0
        self._base: set[str] = set()
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood-sampler", daemon=True)
        self._thread.start()

    def watch(self, baseline_kvt: list[str]) -> None:
        """From now on, record the largest values and the ``kvt-`` threads beyond ``baseline_kvt``."""
        self._base = set(baseline_kvt)
        self._on.set()

    def observe(self, kvt: list[str]) -> None:
        """Count a snapshot of ``kvt-`` threads taken elsewhere (the sampler's interval may miss a moment that
        a round's own snapshot holds)."""
        extra = [n for n in kvt if n not in self._base]
        self.extra_kvt.update(extra)
        self.max_extra_kvt = max(self.max_extra_kvt, len(extra))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._on.is_set():
                continue
            self.max_rss = max(self.max_rss, rss_mib())
            self.max_threads = max(self.max_threads, os_threads())
            self.observe(_kvt_threads())


def _settle(cm: Any, want_kvt: list[str], until: Any = None, timeout: float = 15.0) -> bool:
    """Wait (bounded) until ``cm`` serves no sender, holds no connection in its handshake, its ``kvt-``
    threads are ``want_kvt`` again and ``until()`` (if given) holds. Returns whether it got there."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (not cm.inbound_peers() and cm._admission.pending == 0 and _kvt_threads() == want_kvt
                and (until is None or until())):
            return True
        time.sleep(0.02)
    return False


def _admission_stats(cm: Any) -> dict[str, int]:
    return dict(vars(cm._admission.stats))


def flood_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """Serves a warm-up link, takes the baseline (no flood yet), then, while strangers keep flooding it, one
    link per round from the legitimate sender (and that sender's link of the round before); reports the
    baseline, the largest values during the flood, each round, and the state once the flood is over."""
    dst = HostCache(SPEC)
    sampler = _Sampler()
    out: dict[str, Any] = {"rounds": []}
    with kv_open(dst.layout, backend=cfg["backend"], secret=cfg["secret"], timeout=10) as cm:
        link.publish(cm.metadata())
        cm.wait("warm", timeout=30)  # libraries, allocator pools and backend threads exist before the baseline
        cm.release("warm")
        out["warm_threads"] = os_threads()  # the warm-up link still up: what one link costs
        out["warm_kvt"] = _kvt_threads()
        link.barrier("warm-sampled")
        link.barrier("warm-closed")
        idle_kvt = [n for n in _kvt_threads() if not n.startswith("kvt-in-")]
        out["settled_before"] = _settle(cm, idle_kvt)
        gc.collect()
        time.sleep(0.2)
        out["baseline"] = {"rss": rss_mib(), "threads": os_threads(), "kvt": _kvt_threads(),
                           "admission": _admission_stats(cm)}
        out["peak_reset"] = _reset_peak_rss()
        sampler.watch(out["baseline"]["kvt"])
        link.barrier("baseline")  # only now does the flood start
        link.barrier("bigs-sent")
        dropped = cfg["bigs"] - MAX_PENDING_BYTES // (cfg["big"] + wire.FRAME_HEADER.size)  # once all are read
        deadline = time.monotonic() + 60
        while cm._admission.stats.dropped_over_budget < dropped and time.monotonic() < deadline:
            time.sleep(0.01)
        out["at_budget"] = {"rss": rss_mib(), "admission": _admission_stats(cm), "pending": cm._admission.pending}
        link.barrier("budget-reached")
        for k in range(cfg["rounds"]):
            seqs = [f"legit-{k}"] + ([f"legit-{k}-old"] if k else [])
            for seq in seqs:
                cm.wait(seq, timeout=30)
                cm.release(seq)
            out["rounds"].append({
                "problems": verify_transfer(dst, HostCache(SPEC, fill_seed=100 + k), _round_plan(k)),
                "threads": os_threads(), "kvt": _kvt_threads(), "inbound": len(cm.inbound_peers()),
                "admission": _admission_stats(cm)})
            sampler.observe(out["rounds"][-1]["kvt"])
            link.barrier(f"round-{k}")
        counts = link.recv_value()  # the flood is over: the sender closed every connection and its managers
        base_threads = out["baseline"]["threads"]
        out["settled_after"] = _settle(cm, out["baseline"]["kvt"], lambda: (
            cm._admission.stats.accepted == counts["connections"] and os_threads() <= base_threads))
        gc.collect()
        time.sleep(0.2)
        out["after"] = {"rss": rss_mib(), "threads": os_threads(), "kvt": _kvt_threads(),
                        "admission": _admission_stats(cm), "pending": cm._admission.pending}
        sampler.stop()
        out["flood_peak_rss"] = _peak_rss_mib() if out["peak_reset"] else sampler.max_rss
        out["flood_max_threads"] = sampler.max_threads
        out["flood_extra_kvt"] = sorted(sampler.extra_kvt)
        out["flood_max_extra_kvt"] = sampler.max_extra_kvt
    return out


class _Flood:
    """Strangers on a thread of their own: one connection after another (``pace`` s apart), each announcing a
    HELLO of ``announce`` bytes, sending a part of it and stalling: ``big`` bytes for each of the first
    ``bigs``, ``small`` bytes for the others, which wait for ``resume()``. The newest ``keep`` stay open (the
    receiver holds fewer: the older ones it dropped already). ``connected`` counts the connections made."""

    def __init__(self, addr: tuple[str, int], cfg: dict[str, Any]) -> None:
        header = wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, wire.FRAME_VERSION, int(wire.FrameType.HELLO), 0,
                                        cfg["announce"])
        self.big, self.small = header + b"\0" * cfg["big"], header + b"\0" * cfg["small"]
        self.bigs = cfg["bigs"]
        self.addr, self.pace, self.keep = addr, cfg["pace"], cfg["keep"]
        self.connected = 0
        self.short = 0  # connections whose bytes did not all go out (the receiver had dropped them)
        self.failed = 0
        self._resume = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, connected: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.connected < connected:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the flood made {self.connected} of {connected} connections")
            time.sleep(0.005)

    def resume(self) -> None:
        self._resume.set()

    def stop(self) -> None:
        self._stop.set()
        self._resume.set()
        self._thread.join(30)

    def _run(self) -> None:
        window: collections.deque[socket.socket] = collections.deque()
        try:
            while not self._stop.is_set():
                if self.connected == self.bigs:
                    self._resume.wait()  # (stop() sets it too)
                    if self._stop.is_set():
                        break
                try:
                    s = socket.create_connection(self.addr, timeout=5)
                except OSError:
                    self.failed += 1
                    continue
                window.append(s)
                self.connected += 1
                try:
                    s.sendall(self.big if self.connected <= self.bigs else self.small)
                except OSError:
                    self.short += 1
                while len(window) > self.keep:
                    window.popleft().close()
                self._stop.wait(self.pace)
        finally:
            for s in window:
                s.close()


def _refill(cache: HostCache, seed: int) -> None:
    """New contents for every block of ``cache`` (each round sends bytes of its own)."""
    cache.backing[:] = HostCache(cache.spec, fill_seed=seed).backing


def flood_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """The legitimate sender (with the secret; a manager of its own per link, since a receiver takes one link
    per sender instance) and, on a thread of this process, the strangers. Round ``k`` starts once more than
    MAX_PENDING strangers connected since the previous round's connection (every stranger that was pending
    then has been crowded out since): a new connection pushes PAIRS (seed 100 + k), and the previous round's
    link, opened before those strangers, pushes OLD_PAIRS."""
    meta = link.peer_metadata()
    info = wire.decode_metadata(meta, cfg["secret"].encode())
    src = HostCache(SPEC, fill_seed=7)
    out: dict[str, Any] = {"rounds": []}

    def sender() -> Any:
        return kv_open(src.layout, backend=cfg["backend"], secret=cfg["secret"], timeout=10)

    def push(cm: Any, peer: Any, seq: str, pairs: list[tuple[int, int]]) -> None:
        cm.put_layers(peer, seq, None, [s for s, _ in pairs], [d for _, d in pairs])
        cm.signal(peer, seq)
        cm.flush(peer, timeout=20)

    with sender() as cm:
        push(cm, cm.connect(meta), "warm", PAIRS)
        link.barrier("warm-sampled")
    link.barrier("warm-closed")
    link.barrier("baseline")
    flood = _Flood((info["host"], info["port"]), cfg)
    flood.start()
    old: tuple[Any, Any] | None = None
    try:
        flood.wait_for(cfg["bigs"])
        link.barrier("bigs-sent")
        link.barrier("budget-reached")  # the receiver read them (and dropped some: its byte budget held)
        flood.resume()
        for k in range(cfg["rounds"]):
            flood.wait_for((out["rounds"][-1]["strangers_before"] if k else 0) + cfg["between"])
            _refill(src, 100 + k)  # (every earlier put was flushed)
            cm = sender()
            before = flood.connected
            t0 = time.monotonic()
            try:
                peer = cm.connect(meta, timeout=10)  # one attempt: a refusal fails the round
            except BaseException:
                cm.close()
                raise
            connect_s, during = time.monotonic() - t0, flood.connected - before
            push(cm, peer, f"legit-{k}", PAIRS)
            if old is not None:
                push(*old, f"legit-{k}-old", OLD_PAIRS)
            out["rounds"].append({"strangers_before": before, "strangers_during_connect": during,
                                  "connect_s": round(connect_s, 3), "served_s": round(time.monotonic() - t0, 3)})
            link.barrier(f"round-{k}")
            if old is not None:
                old[0].close()
            old = (cm, peer)
    finally:
        flood.stop()
        if old is not None:
            old[0].close()
    out.update(connected=flood.connected, short=flood.short, failed=flood.failed)
    link.send_value({"connections": flood.connected + cfg["rounds"] + 1})  # strangers, rounds, warm-up
    return out
