"""Scenarios between two "hosts" (network namespaces joined by a veth pair, :mod:`kvtransport.workload.netns`),
as role pairs for :func:`kvtransport.workload.harness.run_pair` with ``hosts=``.

* ``bound_*``: fragmented vLLM-shaped transfers over NET_IFNAME's interface, verified byte for byte; while
  the link is up, each side lists its listening sockets and tries to reach each of them from loopback and,
  for the receiver, from ``cfg["third"]``, the host behind the receiver's other interface (both must fail).
  The receiver's NET_IFNAME may be its first interface (peer b, third c) or its second (peer c, third b):
  only the second tells NET_IFNAME apart from "the first interface that is not loopback".
* ``partition_*``: a stream of requests; the link goes down in the middle (the parent does it at the
  ``partition`` barrier); every wait and flush must end within its bound with a typed error and nothing may
  leak; the link comes back (``heal`` barrier), a new ``connect`` works and new transfers verify.

Each role returns plain data, with :func:`whoami` (hostname and namespaces as the role process sees them);
the test asserts. The roles need root (they run inside namespaces anyway).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from .. import KVTransportError
from .. import open as kv_open
from ..workload.caches import CacheSpec, HostCache, preset
from ..workload.harness import RoleLink
from ..workload.netns import Host, connect_error, listening_sockets
from .conformance import plan_transfers

WAIT = 60.0


def _open(cfg: dict[str, Any], layout: Any, **extra: Any) -> Any:
    return kv_open(layout, backend=cfg["backend"], **{**cfg.get("options", {}), **extra})


def _spec(cfg: dict[str, Any]) -> CacheSpec:
    return preset(cfg.get("preset", "llama-3.1-8b"), cfg["num_blocks"], cfg.get("order", "NHD"))


def mismatches(received: HostCache, sent: HostCache, plan: dict[int, list[tuple[int, int]]]) -> list[str]:
    """Pieces of ``plan`` (layer -> [(src, dst)]) whose bytes differ between the two caches."""
    bad = []
    for layer, pairs in plan.items():
        for plane in range(len(received.layout.layers[layer].planes)):
            for src, dst in pairs:
                if received.piece(layer, plane, dst) != sent.piece(layer, plane, src):
                    bad.append(f"layer {layer} plane {plane} block {dst} (from {src})")
    return bad


def whoami() -> dict[str, Any]:
    """Where this process runs, as it sees it: hostname, its UTS and network namespaces (``/proc/self/ns``
    links, which the test compares with its own), and the first non-loopback interface of its network
    namespace (what a build ignoring NET_IFNAME would likely take)."""
    names = [n for _, n in sorted(socket.if_nameindex()) if n != "lo"]
    return {"hostname": socket.gethostname(), "uts_ns": os.readlink("/proc/self/ns/uts"),
            "net_ns": os.readlink("/proc/self/ns/net"), "first_interface": names[0] if names else None}


def _binding_report(cfg: dict[str, Any], role: str) -> dict[str, Any]:
    """This process's listening sockets, and what a connection to each of them from elsewhere gets."""
    ifname = os.environ.get("NET_IFNAME", "")
    mine: Host = cfg["hosts"][role]
    listeners = listening_sockets()
    probes: dict[str, str | None] = {}
    for _addr, port in listeners:
        probes[f"127.0.0.1:{port}"] = connect_error(mine, "127.0.0.1", port)
        for other_if, other_addr in mine.interfaces:
            if other_if != ifname and "third" in cfg:  # our other interface, from the host behind it
                third: Host = cfg["third"]
                probes[f"{other_addr}:{port} from host {third.name}"] = connect_error(third, other_addr, port)
    return {"ifname": ifname, "address": mine.address, "listeners": listeners, "probes": probes, **whoami()}


# ============================================================== scenario: bound to NET_IFNAME
def bound_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = _spec(cfg)
    cache = HostCache(spec)
    plans = plan_transfers(cfg["seed"], spec, spec, cfg["n_seqs"])
    with _open(cfg, cache.layout, capacity=cfg["n_seqs"]) as cm:
        link.publish(cm.metadata())
        for seq in plans:
            for layer in range(spec.num_layers):
                cm.wait_layer(seq, layer, timeout=WAIT)
            cm.wait(seq, timeout=WAIT)
        sent = HostCache(spec, fill_seed=cfg["seed"])
        problems = [f"{seq}: {p}" for seq, plan in plans.items() for p in mismatches(cache, sent, plan)]
        link.barrier("landed")  # both links are up: every listener exists now
        report = _binding_report(cfg, "receiver")
        for seq in plans:
            cm.release(seq)
        stats = cm.stats()
        link.barrier("checked")
    return {"problems": problems, "binding": report, "slots_in_use": stats["slots_in_use"],
            "bytes_received": stats["bytes_received"]}


def bound_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = _spec(cfg)
    cache = HostCache(spec, fill_seed=cfg["seed"])
    plans = plan_transfers(cfg["seed"], spec, spec, cfg["n_seqs"])
    with _open(cfg, cache.layout) as cm:
        peer = cm.connect(link.peer_metadata())
        for i, (seq, plan) in enumerate(plans.items()):
            if i % 2:  # whole request in one call
                src, dst = zip(*plan[0], strict=True)
                cm.put_layers(peer, seq, None, list(src), list(dst))
            else:  # layer by layer, as a prefill pushes
                for layer in range(spec.num_layers):
                    src, dst = zip(*plan[layer], strict=True)
                    cm.put_layer(peer, seq, layer, list(src), list(dst))
                    cm.signal_layer(peer, seq, layer)
            cm.signal(peer, seq)
        cm.flush(peer, timeout=WAIT)
        link.barrier("landed")
        report = _binding_report(cfg, "sender")
        stats = cm.stats()
        link.barrier("checked")
    return {"binding": report, "paths": stats["paths"], "path": peer.path, "bytes_sent": stats["bytes_sent"]}


# ============================================================== scenario: partition
def _timed(fn: Any, *args: Any, **kw: Any) -> dict[str, Any]:
    """Call ``fn``; record how long it took and its outcome (None, or the error's class name)."""
    t0 = time.monotonic()
    try:
        fn(*args, **kw)
        error = None
    except KVTransportError as exc:
        error = type(exc).__name__
    except Exception as exc:  # an untyped error is a finding: report it, the test fails on it
        error = f"untyped {type(exc).__name__}: {exc}"
    return {"seconds": time.monotonic() - t0, "error": error}


def _partition_plan(cfg: dict[str, Any]) -> dict[str, dict[int, list[tuple[int, int]]]]:
    """Sequences of the partition scenario, with disjoint destinations: ``pre-*`` (before the cut), ``mid-*``
    (issued just before it), ``post-*`` (issued after it), ``re-*`` (after the link came back)."""
    spec = _spec(cfg)
    names = [f"pre-{i}" for i in range(cfg["pre"])] + [f"mid-{i}" for i in range(cfg["mid"])] + \
            [f"post-{i}" for i in range(cfg["post"])] + [f"re-{i}" for i in range(cfg["re"])]
    plans = plan_transfers(cfg["seed"], spec, spec, len(names))
    return dict(zip(names, plans.values(), strict=True))


def partition_receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = _spec(cfg)
    cache = HostCache(spec)
    plans = _partition_plan(cfg)
    bound = cfg["wait_timeout"]
    out: dict[str, Any] = {"waits": {}, **whoami()}
    with _open(cfg, cache.layout, capacity=len(plans)) as cm:
        link.publish(cm.metadata())
        for seq in (s for s in plans if s.startswith("pre-")):
            cm.wait(seq, timeout=WAIT)
        link.barrier("partition")  # the parent takes the link down before releasing us
        for seq in (s for s in plans if s.startswith(("mid-", "post-"))):
            out["waits"][seq] = _timed(cm.wait, seq, timeout=bound)
            out["waits"][seq]["layer0"] = _timed(cm.wait_layer, seq, 0, timeout=bound)
            cm.release(seq)
        stats = cm.stats()
        out.update(slots_after_release=stats["slots_in_use"], failures_before_heal=stats["failures"])
        link.barrier("heal")  # the parent brings the link back up before releasing us
        for seq in (s for s in plans if s.startswith("re-")):
            cm.wait(seq, timeout=WAIT)
        sent = HostCache(spec, fill_seed=cfg["seed"])
        out["problems"] = [f"{seq}: {p}" for seq, plan in plans.items() if seq.startswith(("pre-", "re-"))
                           for p in mismatches(cache, sent, plan)]
        for seq in (s for s in plans if s.startswith(("pre-", "re-"))):
            cm.release(seq)
        # the link from before the cut goes once its side channel ends (its FIN arrives after the heal,
        # or its receive timed out); bounded look, no sleep-and-hope
        deadline = time.monotonic() + cfg["stale_link_bound"]
        while cm.stats()["inbound_peers"] > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = cm.stats()
        out.update(slots_in_use=stats["slots_in_use"], inbound_peers=stats["inbound_peers"],
                   outbound_peers=stats["outbound_peers"], failures=stats["failures"])
        link.barrier("done")
    return out


def partition_sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = _spec(cfg)
    cache = HostCache(spec, fill_seed=cfg["seed"])
    plans = _partition_plan(cfg)
    bound = cfg["flush_timeout"]
    out: dict[str, Any] = whoami()
    meta = link.peer_metadata()

    def push(cm: Any, peer: Any, prefix: str) -> None:
        for seq, plan in plans.items():
            if seq.startswith(prefix):
                src, dst = zip(*plan[0], strict=True)
                cm.put_layers(peer, seq, None, list(src), list(dst))
                cm.signal(peer, seq)

    with _open(cfg, cache.layout) as cm:
        peer = cm.connect(meta)
        out["path"] = peer.path
        push(cm, peer, "pre-")
        cm.flush(peer, timeout=WAIT)
        push(cm, peer, "mid-")  # in flight when the link goes down
        link.barrier("partition")
        out["post_puts"] = _timed(push, cm, peer, "post-")  # after the cut: must not hang
        out["flush"] = _timed(cm.flush, peer, timeout=bound)
        out["disconnect"] = _timed(cm.disconnect, peer)
        out["outbound_after_disconnect"] = cm.stats()["outbound_peers"]
        link.barrier("heal")
        t0 = time.monotonic()
        peer = cm.connect(meta, timeout=WAIT)
        out["reconnect_s"] = time.monotonic() - t0
        push(cm, peer, "re-")
        cm.flush(peer, timeout=WAIT)
        stats = cm.stats()
        out.update(outbound_peers=stats["outbound_peers"], paths=stats["paths"])
        link.barrier("done")
    return out

