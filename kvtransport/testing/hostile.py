"""Roles for tests against hostile peers and transient shortages (run in real processes by
:func:`kvtransport.workload.harness.run_pair`). Each returns a JSON-able dict for the test to judge.

* ``shortage_*``: the receiver runs out of file descriptors (a real RLIMIT_NOFILE, exhausted by a flood
  of plain TCP connections) and, afterwards, cannot start a thread for its first connections; then a real
  sender connects and its transfer must verify.
* ``flood_*``: in :mod:`.flood` (a flood of unauthenticated connections while a legitimate sender is served).
* ``owner_*``: another connected sender tries to complete, cancel, impersonate and crowd out a legitimate
  one's sequences.
* per-peer bounds: ``checksums_*`` (debug checksums that wait for signals, MAX_PENDING_CHECKSUMS),
  ``nacks_*`` (a hostile receiver's made-up NACKs, MAX_FAILED_RECORDS), ``inbound_*`` (senders served at
  once, MAX_INBOUND).
"""

from __future__ import annotations

import os
import resource
import socket
import threading
import time
from typing import Any

from kvtransport import open as kv_open
from kvtransport import wire

from ..workload.caches import CacheSpec, HostCache, verify_transfer
from ..workload.harness import RoleLink

SPEC = CacheSpec(num_layers=2, num_blocks=32, heads=2, block_size=8, head_dim=16, order="NHD")
PAIRS = [(1, 20), (2, 21), (3, 22), (7, 5)]


def _plan() -> dict[int, list[tuple[int, int]]]:
    return {layer: PAIRS for layer in range(SPEC.num_layers)}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def status_mib(field: str) -> float:
    """A size field of /proc/self/status (``VmRSS``, ``VmHWM``...) in MiB; 0 when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_mib() -> float:
    return status_mib("VmRSS")


def py_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def os_threads() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def _push(cm: Any, meta: bytes, seq: str, *, attempts: int = 1, pause: float = 0.2) -> dict[str, Any]:
    """Connect (retrying ``attempts`` times), push PAIRS in every layer, signal, flush. Returns how it went."""
    errors = []
    for _ in range(attempts):
        try:
            peer = cm.connect(meta, timeout=10)
            break
        except Exception as exc:  # recorded: the test judges how many attempts it took
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            time.sleep(pause)
    else:
        return {"connected": False, "errors": errors}
    cm.put_layers(peer, seq, None, [s for s, _ in PAIRS], [d for _, d in PAIRS])
    cm.signal(peer, seq)
    cm.flush(peer, timeout=20)
    return {"connected": True, "errors": errors}


# ============================================================== shortage
def shortage_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    dst = HostCache(SPEC)
    with kv_open(dst.layout, backend=cfg["backend"], timeout=10) as cm:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + cfg["spare_fds"], hard))
        failures = {"left": cfg["thread_failures"], "injected": 0}
        start = threading.Thread.start

        def failing_start(thread: threading.Thread) -> None:  # no thread for the next connections
            if thread.name.startswith("kvt-in-") and failures["left"] > 0:
                failures["left"] -= 1
                failures["injected"] += 1
                raise RuntimeError("can't start new thread (injected)")
            start(thread)

        link.publish(cm.metadata())
        link.barrier("flooded")  # the sender holds more connections than we have descriptors
        link.barrier("flood-over")
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        threading.Thread.start = failing_start  # type: ignore[method-assign,assignment]
        try:
            cm.wait("after", timeout=60)
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]
        problems = verify_transfer(dst, HostCache(SPEC, fill_seed=7), _plan())
        admission = getattr(cm, "_admission", None)
        return {"problems": problems, "accept_errors": admission.stats.accept_errors if admission else -1,
                "injected": failures["injected"]}


def shortage_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    meta = link.peer_metadata()
    info = wire.decode_metadata(meta)
    flood = []
    for _ in range(cfg["flood"]):  # more than the receiver has descriptors: its accept() hits EMFILE
        try:
            flood.append(socket.create_connection((info["host"], info["port"]), timeout=5))
        except OSError:
            break
    time.sleep(0.5)
    link.barrier("flooded")
    for s in flood:
        s.close()
    link.barrier("flood-over")
    src = HostCache(SPEC, fill_seed=7)
    t0 = time.monotonic()
    with kv_open(src.layout, backend=cfg["backend"], timeout=10) as cm:
        out = _push(cm, meta, "after", attempts=cfg["thread_failures"] + 3)
    out.update(flooded=len(flood), took_s=round(time.monotonic() - t0, 2))
    return out


# ============================================================== ownership
OWNER_CAPACITY = 16  # reserve 4; with two senders connected, a sender's share is (16 - 4) // 2 = 6


def owner_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """Serves a legitimate sender L and an attacker A (both in the sender process); reports what A could do."""
    dst = HostCache(SPEC)
    out: dict[str, Any] = {}
    with kv_open(dst.layout, backend=cfg["backend"], capacity=OWNER_CAPACITY, timeout=10) as cm:
        link.publish(cm.metadata())
        legit_instance = link.recv_value()
        cm.expect("e", sender=legit_instance)  # the receiver knows "e" comes from L (its instance id)
        link.barrier("expected")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(  # L's first signals reached us: "s", "s2" are L's
                (st := cm._table.get(seq)) is not None and st.peer == legit_instance for seq in ("s", "s2")):
            time.sleep(0.01)
        link.barrier("l-claimed")
        link.barrier("claimed")  # L claimed "s", "s2" (layer 0 put and signalled); A signalled "s" and "e"
        time.sleep(0.5)          # whole and cancelled "s2"
        for seq in ("s", "s2", "e"):
            try:
                cm.wait(seq, timeout=0.3)
                out[seq] = "completed"  # by A's signal, although L never signalled it
            except Exception as exc:
                out[seq] = type(exc).__name__
        link.barrier("checked")
        link.barrier("impersonated")
        out["inbound"] = len(cm.inbound_peers())
        link.barrier("filled")  # A made up ids until refused; L now needs 3 more slots (6 in all: its share)
        out["slots_at_filled"] = cm.stats()["slots_in_use"]
        link.barrier("counted")  # only now may L claim more (its l0 could otherwise be counted on a slow host)
        link.barrier("legit-done")
        for seq in ("s", "s2", "e", "l0", "l1", "l2"):
            cm.wait(seq, timeout=20)
        out["problems"] = verify_transfer(dst, HostCache(SPEC, fill_seed=7), _plan())
        out["foreign_refused"] = cm.stats().get("foreign_refused", -1)
        out["slots_in_use"] = cm.stats()["slots_in_use"]
    return out


def owner_senders(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    meta = link.peer_metadata()
    src = HostCache(SPEC, fill_seed=7)
    out: dict[str, Any] = {}
    backend = cfg["backend"]
    with kv_open(src.layout, backend=backend, timeout=10) as legit, kv_open(src.layout, backend=backend, timeout=10) as bad:
        link.send_value(legit.instance)
        lp, ap = legit.connect(meta), bad.connect(meta)
        link.barrier("expected")
        srcs, dsts = [s for s, _ in PAIRS], [d for _, d in PAIRS]
        for seq in ("s", "s2"):  # L claims them with its first layer (a one-sided link's first signal claims)
            legit.put_layer(lp, seq, 0, srcs, dsts)
            legit.signal_layer(lp, seq, 0)
        legit.flush(lp, timeout=10)
        link.barrier("l-claimed")
        bad.signal(ap, "s")  # A: "s" is complete (blocks never written)
        bad.signal(ap, "e")  # A: so is "e", which the receiver expects from L (A is first to name it)
        bad.cancel(ap, "s2")  # A: give "s2" up
        bad.flush(ap, timeout=10)
        time.sleep(0.3)  # the receiver's NACKs reach A
        try:
            bad.signal(ap, "s")
            out["attacker_after_nack"] = "accepted"
        except Exception as exc:
            out["attacker_after_nack"] = type(exc).__name__
        link.barrier("claimed")
        link.barrier("checked")
        impostor = kv_open(src.layout, backend=backend, timeout=10)
        impostor.instance = legit.instance  # connects under L's instance id
        try:
            impostor.connect(meta)
            out["impersonation"] = "connected"
        except Exception as exc:
            out["impersonation"] = type(exc).__name__
        finally:
            impostor.close()
        link.barrier("impersonated")
        made_up = 0
        for i in range(OWNER_CAPACITY):  # A fills the table with ids nobody asked for
            try:
                bad.signal_layer(ap, f"junk-{i}", 0)
                bad.flush(ap, timeout=10)
                made_up += 1
            except Exception:
                break
        time.sleep(0.3)
        out["made_up_sent"] = made_up
        link.barrier("filled")
        link.barrier("counted")
        for i in range(3):  # L still finds slots
            legit.put_layers(lp, f"l{i}", None, [], [])
            legit.put_layer(lp, f"l{i}", 1, srcs, dsts)
            legit.put_layer(lp, f"l{i}", 0, srcs, dsts)
            legit.signal(lp, f"l{i}")
        for seq in ("s", "s2"):  # L finishes its own sequences
            legit.put_layer(lp, seq, 1, srcs, dsts)
            legit.signal(lp, seq)
        legit.put_layers(lp, "e", None, srcs, dsts)
        legit.signal(lp, "e")
        legit.flush(lp, timeout=10)
        link.barrier("legit-done")
    return out


# ============================================================== per-peer bounds
def _inbound_of(cm: Any, instance: str, timeout: float = 20.0) -> Any:
    """The receiver's ``Inbound`` serving sender ``instance`` (waits, bounded, for its handshake to end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [ib for ib in cm._receiver.peers() if ib.peer == instance]
        if found:
            return found[0]
        time.sleep(0.01)
    raise RuntimeError(f"sender {instance} never connected")


def _until(pred: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _error_of(fn: Any, *args: Any) -> str:
    """The name of what ``fn(*args)`` raised ("" when it returned)."""
    try:
        fn(*args)
    except Exception as exc:
        return type(exc).__name__
    return ""


CHECKSUM_SEQS = 64
"""The checksum hog spreads its puts over this many sequences (each within one sender's share of slots)."""


def checksums_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """Debug checksums on, MAX_PENDING_CHECKSUMS set to ``cfg["bound"]`` (read at each CHECKSUM frame). A
    sender puts without ever signalling until that many checksums wait here (its link must stay up), then one
    more (its link must drop); then another sender is served."""
    from kvtransport import receiving

    receiving.MAX_PENDING_CHECKSUMS = bound = cfg["bound"]
    dst = HostCache(SPEC)
    out: dict[str, Any] = {}
    with kv_open(dst.layout, backend=cfg["backend"], checksum=True, timeout=10) as cm:
        link.publish(cm.metadata())
        hog = link.recv_value()
        ib = _inbound_of(cm, hog)
        link.barrier("at-bound")  # the hog's puts and checksums were flushed: they reach us in order
        out["reached"] = _until(lambda: ib._pending_checksums >= bound)
        time.sleep(0.2)  # (nothing more is on its way)
        out["held_at_bound"] = ib._pending_checksums
        out["sequences_at_bound"] = len(ib._checksums)
        out["up_at_bound"] = hog in cm.inbound_peers()
        link.barrier("checked")
        link.barrier("one-more")
        out["dropped"] = _until(lambda: hog not in cm.inbound_peers())
        link.barrier("dropped")
        cm.wait("fine", timeout=30)
        hog_pairs = [(j, 8 + j) for j in range(8)]  # what the hog wrote (its checksums never mattered)
        out["problems"] = verify_transfer(dst, HostCache(SPEC, fill_seed=7),
                                          {layer: PAIRS + hog_pairs for layer in range(SPEC.num_layers)})
    return out


def checksums_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    meta = link.peer_metadata()
    src = HostCache(SPEC, fill_seed=7)
    out: dict[str, Any] = {}
    with kv_open(src.layout, backend=cfg["backend"], checksum=True, timeout=10) as hog:
        link.send_value(hog.instance)
        peer = hog.connect(meta)
        for i in range(cfg["bound"]):  # one checksum each (one layer), none ever signalled
            j = i // SPEC.num_layers % 8
            hog.put_layer(peer, f"never-{i % CHECKSUM_SEQS}", i % SPEC.num_layers, [j], [8 + j])
        hog.flush(peer, timeout=60)
        link.barrier("at-bound")
        link.barrier("checked")
        hog.put_layer(peer, "never-0", 0, [0], [8])  # the one past the bound
        link.barrier("one-more")
        deadline, out["after"] = time.monotonic() + 20, ""
        while not out["after"] and time.monotonic() < deadline:  # the link drops: the next call says so
            out["after"] = _error_of(hog.put_layer, peer, "never-1", 0, [0], [8]) or _error_of(
                lambda: hog.flush(peer, timeout=0.2))
            time.sleep(0.02)
        link.barrier("dropped")
    with kv_open(src.layout, backend=cfg["backend"], checksum=True, timeout=10) as other:
        peer = other.connect(meta)
        other.put_layers(peer, "fine", None, [s for s, _ in PAIRS], [d for _, d in PAIRS])
        other.signal(peer, "fine")
        other.flush(peer, timeout=20)
    return out


NACKS_BEYOND = 1000
"""How many made-up NACKs past the sender's bound (MAX_FAILED_RECORDS) a hostile receiver sends."""


def nacks_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """Hostile: sends its sender ``cfg["bound"]`` + NACKS_BEYOND NACKs for sequences nobody used, then serves
    it normally."""
    from kvtransport.errors import SlotsExhausted
    from kvtransport.wire import FrameType

    dst = HostCache(SPEC)
    with kv_open(dst.layout, backend=cfg["backend"], timeout=10) as cm:
        link.publish(cm.metadata())
        ib = _inbound_of(cm, link.recv_value())
        n = cfg["bound"] + NACKS_BEYOND
        for start in range(0, n, 4096):
            ib.conn.send_many([(FrameType.NACK, wire.encode_error(f"made-up-{i}", SlotsExhausted("made up")))
                               for i in range(start, min(n, start + 4096))])
        link.barrier("nacked")
        cm.wait("after", timeout=30)
        return {"sent": n, "problems": verify_transfer(dst, HostCache(SPEC, fill_seed=7), _plan())}


def nacks_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """MAX_FAILED_RECORDS set to ``cfg["bound"]`` (read at each NACK). Counts the NACKs as they arrive, then
    reports how many failure records its link holds and which made-up sequences still raise; then transfers
    over the same link."""
    from kvtransport import sending

    sending.MAX_FAILED_RECORDS = cfg["bound"]
    meta = link.peer_metadata()
    src = HostCache(SPEC, fill_seed=7)
    n = cfg["bound"] + NACKS_BEYOND
    with kv_open(src.layout, backend=cfg["backend"], timeout=10) as cm:
        peer = cm.connect(meta)
        link.send_value(cm.instance)
        link.barrier("nacked")
        out: dict[str, Any] = {"all_arrived": _until(lambda: cm.stats()["failures"] >= n, timeout=60)}
        out["failures"] = cm.stats()["failures"]
        out["records"] = len(peer._state._failed)
        out["oldest_kept"] = _error_of(cm.signal, peer, f"made-up-{NACKS_BEYOND}")
        out["newest"] = _error_of(cm.signal, peer, f"made-up-{n - 1}")
        out["forgotten"] = _error_of(cm.signal, peer, f"made-up-{NACKS_BEYOND - 1}")
        cm.put_layers(peer, "after", None, [s for s, _ in PAIRS], [d for _, d in PAIRS])
        cm.signal(peer, "after")
        cm.flush(peer, timeout=20)
    return out


def inbound_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    """Serves at most ``cfg["max_inbound"]`` senders at once (MAX_INBOUND, lowered for the test: it is read
    at each handshake); reports how many it served when one more came, and after one left."""
    from kvtransport import receiving

    receiving.MAX_INBOUND = cfg["max_inbound"]
    dst = HostCache(SPEC)
    out: dict[str, Any] = {}
    with kv_open(dst.layout, backend=cfg["backend"], timeout=10) as cm:
        link.publish(cm.metadata())
        link.barrier("full")  # the sender linked max_inbound managers, and one more tried
        _until(lambda: len(cm.inbound_peers()) >= cfg["max_inbound"])  # (our side of the last link completes)
        out["inbound_full"] = len(cm.inbound_peers())
        with cm._receiver.lock:  # (for a failure's message: each link's state)
            out["links_full"] = [(ib.peer, ib.closed) for ib in cm._receiver.inbound.values()]
        out["handed_off_full"] = cm._admission.stats.handed_off  # (the one more was refused before that)
        link.barrier("counted-full")
        link.barrier("one-left")
        out["made_room"] = _until(lambda: len(cm.inbound_peers()) == cfg["max_inbound"] - 1)
        link.barrier("room")
        cm.wait("after", timeout=30)
        out["inbound_end"] = len(cm.inbound_peers())
        link.barrier("counted")
        out["problems"] = verify_transfer(dst, HostCache(SPEC, fill_seed=7), _plan())
    return out


def inbound_senders(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    meta = link.peer_metadata()
    src = HostCache(SPEC, fill_seed=7)
    out: dict[str, Any] = {}
    cms = [kv_open(src.layout, backend=cfg["backend"], timeout=10) for _ in range(cfg["max_inbound"] + 1)]
    try:
        peers = [cm.connect(meta) for cm in cms[:-1]]
        extra = None
        try:
            extra = cms[-1].connect(meta)
            out["one_more"] = "connected"
        except Exception as exc:
            out["one_more"] = f"{type(exc).__name__}: {exc}"
        link.barrier("full")
        link.barrier("counted-full")
        cms[0].close()
        link.barrier("one-left")
        link.barrier("room")
        peer = extra or cms[-1].connect(meta)  # the room one left
        cms[-1].put_layers(peer, "after", None, [s for s, _ in PAIRS], [d for _, d in PAIRS])
        cms[-1].signal(peer, "after")
        cms[-1].flush(peer, timeout=20)
        link.barrier("counted")
        out["served"] = len(peers)
    finally:
        for cm in cms:
            cm.close()
    return out
