"""Roles for tests against hostile peers and transient shortages (run in real processes by
:func:`kvtransport.testing.harness.run_pair`). Each returns a JSON-able dict for the test to judge.

* ``shortage_*``: the receiver runs out of file descriptors (a real RLIMIT_NOFILE, exhausted by a flood
  of plain TCP connections) and, afterwards, cannot start a thread for its first connections; then a real
  sender connects and its transfer must verify.
* ``flood_*``: hundreds of unauthenticated connections announce large HELLOs, send part of them and
  stall; the receiver's memory and threads are sampled before, during and after, and a legitimate sender
  (with the secret) is served during the flood.
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

from .cache import CacheSpec, HostCache, verify_transfer
from .harness import RoleLink

SPEC = CacheSpec(num_layers=2, num_blocks=32, heads=2, block_size=8, head_dim=16, order="NHD")
PAIRS = [(1, 20), (2, 21), (3, 22), (7, 5)]


def _plan() -> dict[int, list[tuple[int, int]]]:
    return {layer: PAIRS for layer in range(SPEC.num_layers)}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _py_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate())


def _os_threads() -> int:
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


# ============================================================== flood
def flood_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    dst = HostCache(SPEC)
    with kv_open(dst.layout, backend=cfg["backend"], secret=cfg["secret"], timeout=10) as cm:
        samples = {}
        link.publish(cm.metadata())
        time.sleep(0.5)
        samples["baseline"] = (_rss_mib(), _os_threads())
        names = {"baseline": _py_threads()}
        link.barrier("flooding")
        time.sleep(0.5)
        samples["flooding"] = (_rss_mib(), _os_threads())
        names["flooding"] = _py_threads()
        link.barrier("sampled")
        link.barrier("legit-sent")
        cm.wait("legit", timeout=30)
        samples["served"] = (_rss_mib(), _os_threads())
        link.barrier("flood-closed")
        time.sleep(cfg["settle_s"])
        samples["after"] = (_rss_mib(), _os_threads())
        problems = verify_transfer(dst, HostCache(SPEC, fill_seed=7), _plan())
        admission = getattr(cm, "_admission", None)
        return {"samples": samples, "names": names, "problems": problems,
                "pending_after": admission.pending if admission else -1,
                "dropped_crowded": admission.stats.dropped_crowded if admission else -1}


def flood_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    meta = link.peer_metadata()
    info = wire.decode_metadata(meta)
    announce = wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, wire.FRAME_VERSION, int(wire.FrameType.HELLO), 0,
                                      cfg["announce"])
    flood = []
    for _ in range(cfg["flood"]):
        try:
            s = socket.create_connection((info["host"], info["port"]), timeout=5)
            s.sendall(announce + b"\0" * cfg["send"])  # a header announcing a large HELLO, a part of it, then silence
            flood.append(s)
        except OSError:
            continue
    link.barrier("flooding")
    link.barrier("sampled")
    src = HostCache(SPEC, fill_seed=7)
    t0 = time.monotonic()
    with kv_open(src.layout, backend=cfg["backend"], secret=cfg["secret"], timeout=10) as cm:
        out = _push(cm, meta, "legit", attempts=1)
        out["legit_s"] = round(time.monotonic() - t0, 2)
        link.barrier("legit-sent")
        for s in flood:
            s.close()
        link.barrier("flood-closed")
    out["flood"] = len(flood)
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
