"""kvtransport workloads as (receiver, sender) role pairs for :func:`kvtransport.workload.harness.run_pair`.

Every timed repetition follows one protocol: both roles meet at a barrier named after the sequence id;
the sender stamps ``t0`` and issues the work through the public API; the receiver stamps ``t1`` when
``wait`` returns. The sender then calls ``flush`` (outside the timed span) so that a backend which
releases per-put resources only on flush does not pile them up across requests. After the repetitions of a case the sender sends its stamps, the receiver turns them
into durations, and the receiver's result carries the rows. The first repetition of a case is a warm-up
and is dropped. Sequence ids are never reused within a manager (released ids are tombstoned).
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any

from .common import (
    FILL,
    alloc,
    busy,
    done,
    gbps,
    is_filled,
    make_cache,
    now,
    progress,
    set_bytes,
    summarize,
    sync,
    torch_module,
    use_device,
)


def _open(layout: Any, cfg: dict[str, Any], coalesce: bool = True) -> Any:
    import kvtransport

    return kvtransport.open(layout, backend=cfg["backend"], coalesce=coalesce, timeout=cfg["timeout"])


def _durations(t0s: list[float], t1s: list[float], warmup: int) -> list[float]:
    return [b - a for a, b in zip(t0s, t1s, strict=True)][warmup:]


def _recv_reps(link: Any, cm: Any, seqs: list[str], timeout: float) -> list[float]:
    """Receiver half of the protocol: per sequence, barrier, wait, stamp, release."""
    t1s = []
    for seq in seqs:
        link.barrier(seq)
        cm.wait(seq, timeout=timeout)
        t1s.append(now())
        cm.release(seq)
    return t1s


def shape_cache_spec(shape: dict[str, Any]) -> Any:
    """The cache spec a bench shape names (its preset, its pool of blocks, NHD order)."""
    from ..workload.caches import preset

    return preset(shape["preset"], shape["pool_blocks"], "NHD")


def _check_piece(cache: Any, layer: int, block: int) -> Any:
    return cache.views[f"layers.{layer}"][block]


# ====================================================================== 1. message sweep
def _sweep_layout(sizes: list[int], device: str, fill: int | None) -> tuple[Any, list[Any]]:
    """One layer per size, one block per layer: a put of layer ``i`` moves ``sizes[i]`` contiguous bytes."""
    from ..layout import KVLayout

    arrays = [alloc(s, device, fill) for s in sizes]
    return KVLayout.from_tensors(arrays, block_dim=0), arrays


def sweep_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["recv_device"])
    sizes: list[int] = cfg["sizes"]
    layout, arrays = _sweep_layout(sizes, cfg["recv_device"], None)
    rows = []
    with _open(layout, cfg) as cm:
        link.publish(cm.metadata())
        for i, size in enumerate(sizes):
            set_bytes(arrays[i], 0)
            seqs = [f"sw{i}-{r}" for r in range(1 + cfg["reps"][i])]
            t1s = _recv_reps(link, cm, seqs, cfg["timeout"])
            d = _durations(link.recv_value(), t1s, 1)
            st = summarize(d)
            row = {"workload": "sweep", "case": {"size": size}, "bytes": size, "samples_s": d, **st,
                   "gbps": gbps(size, st["median_s"]), **busy(), "verified": is_filled(arrays[i], FILL)}
            rows.append(row)
            progress(cfg, i, f"{cfg['label']} sweep {_fmt(size)}: {row['gbps']:.3g} GB/s, "
                     f"median {st['median_s'] * 1e6:.0f} us")
        link.barrier("end")
        stats = cm.stats()
    return done({"rows": rows, "stats": stats})


def sweep_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["send_device"])
    sizes: list[int] = cfg["sizes"]
    layout, _arrays = _sweep_layout(sizes, cfg["send_device"], FILL)
    with _open(layout, cfg) as cm:
        peer = cm.connect(link.peer_metadata())
        for i in range(len(sizes)):
            t0s = []
            for r in range(1 + cfg["reps"][i]):
                seq = f"sw{i}-{r}"
                link.barrier(seq)
                t0s.append(now())
                cm.put_layer(peer, seq, i, [0], [0])
                cm.signal(peer, seq)
                cm.flush(peer)  # outside the timed span (the receiver stamps the end)
            link.send_value(t0s)
        cm.flush(peer)
        link.barrier("end")
        return done({"path": peer.path, "backend": cm.backend, "stats": cm.stats()})


# ====================================================================== 2. KV requests
class _CacheHolder:
    """Keeps the cache of the current KV shape; frees it before allocating the next one."""

    def __init__(self, device: str, fill: int | None) -> None:
        self.device, self.fill = device, fill
        self.key: tuple[str, int] | None = None
        self.cache: Any = None

    def get(self, shape: dict[str, Any]) -> Any:
        key = (shape["preset"], shape["pool_blocks"])
        if key != self.key:
            self.cache = None
            gc.collect()
            self.cache = make_cache(shape_cache_spec(shape), self.device, self.fill)
            self.key = key
        return self.cache


def _mode(coalesce: bool) -> str:
    return "on" if coalesce else "off"


def kv_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Per shape: one manager per coalescing mode, both on one cache; repetitions alternate between the
    modes so that a change in machine load hits both alike (the on/off ratio is what the case is for)."""
    use_device(cfg["recv_device"])
    from .plan import block_ids

    holder = _CacheHolder(cfg["recv_device"], None)
    rows = []
    stats = []
    for g in cfg["groups"]:
        shape = g["shape"]
        cache = holder.get(shape)
        modes = [_mode(c) for c in g["coalesce"]]
        with contextlib.ExitStack() as stack:
            cms = {}
            for c in g["coalesce"]:
                cms[_mode(c)] = stack.enter_context(_open(cache.layout, cfg, c))
                link.publish(cms[_mode(c)].metadata())
            for case in g["cases"]:
                _, dst = block_ids(case["pattern"], shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
                probes = [_check_piece(cache, 0, dst[0]), _check_piece(cache, shape["num_layers"] - 1, dst[-1])]
                t1s: dict[str, list[float]] = {m: [] for m in modes}
                ok = dict.fromkeys(modes, True)
                for r in range(1 + case["reps"]):
                    for m in modes:
                        for p in probes:
                            set_bytes(p, 0)
                        sync(cfg["recv_device"])
                        t1s[m] += _recv_reps(link, cms[m], [f"kv{case['index'][m]}-{r}"], cfg["timeout"])
                        ok[m] = ok[m] and all(is_filled(p, FILL) for p in probes)
                t0s = link.recv_value()
                nbytes = shape["request_bytes"]
                for m in modes:
                    d = _durations(t0s[m], t1s[m], 1)
                    st = summarize(d)
                    row = {"workload": "kv", "case": {"preset": shape["preset"], "tokens": shape["tokens"],
                                                      "ids": case["pattern"], "coalesce": m == "on",
                                                      "api": cfg.get("kv_api", "put_layers")},
                           "bytes": nbytes, "runs_per_layer": case["runs"][m], "samples_s": d, **st,
                           "gbps": gbps(nbytes, st["median_s"]), **busy(), "verified": ok[m]}
                    rows.append(row)
                    progress(cfg, case["index"][m], f"{cfg['label']} kv {shape['preset']} {_tok(shape['tokens'])} "
                             f"{case['pattern']} coalesce={m}: {row['gbps']:.3g} GB/s")
            link.barrier(f"g-end-{g['index']}")
            stats.append(cms[modes[0]].stats())
    return done({"rows": rows, "stats": stats[-1] if stats else {}})


def kv_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["send_device"])
    from .plan import block_ids

    holder = _CacheHolder(cfg["send_device"], FILL)
    path = ""
    whole = cfg.get("kv_api", "put_layers") == "put_layers"  # one call per request (else one per layer)
    for g in cfg["groups"]:
        shape = g["shape"]
        cache = holder.get(shape)
        modes = [_mode(c) for c in g["coalesce"]]
        with contextlib.ExitStack() as stack:
            cms, peers = {}, {}
            for c in g["coalesce"]:
                m = _mode(c)
                cms[m] = stack.enter_context(_open(cache.layout, cfg, c))
                peers[m] = cms[m].connect(link.peer_metadata())
                path = peers[m].path
            for case in g["cases"]:
                src, dst = block_ids(case["pattern"], shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
                t0s: dict[str, list[float]] = {m: [] for m in modes}
                for r in range(1 + case["reps"]):
                    for m in modes:
                        cm, peer = cms[m], peers[m]
                        seq = f"kv{case['index'][m]}-{r}"
                        link.barrier(seq)
                        t0s[m].append(now())
                        if whole:
                            cm.put_layers(peer, seq, None, src, dst)
                        else:
                            for layer in range(shape["num_layers"]):
                                cm.put_layer(peer, seq, layer, src, dst)
                        cm.signal(peer, seq)
                        cm.flush(peer)
                link.send_value(t0s)
            for m in modes:
                cms[m].flush(peers[m])
            link.barrier(f"g-end-{g['index']}")
    return done({"path": path})


# ====================================================================== 3. layer-wise overlap
class _Compute:
    """The synthetic prefill's per-layer compute on the sender.

    ``sleep``: the host sleeps (CPU runs: models an accelerator's compute, which leaves the host cores to
    the transport). ``matmul``: runs ``[tokens, hidden] @ [hidden, hidden/tp]`` on the current CUDA stream
    (what the default per-layer time was measured from). ``cuda_sleep``: a calibrated spin kernel of the
    given time on the current stream (a ``--layer-compute-ms`` override on CUDA)."""

    def __init__(self, mode: str, seconds: float, device: str, matmul: list[int] | None) -> None:
        self.mode, self.seconds, self.device = mode, seconds, device
        self.cycles = 0
        if mode == "matmul":
            torch = torch_module()
            t, h, n = matmul or [1, 1, 1]
            self.a = torch.randn(t, h, dtype=torch.bfloat16, device=device)
            self.w = torch.randn(h, n, dtype=torch.bfloat16, device=device)
            self.o = torch.empty(t, n, dtype=torch.bfloat16, device=device)
        elif mode == "cuda_sleep":
            torch = torch_module()
            probe = 1_000_000
            torch.cuda._sleep(probe)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.cuda._sleep(probe)
            e1.record()
            e1.synchronize()
            per_cycle = e0.elapsed_time(e1) / 1e3 / probe
            self.cycles = max(1, int(seconds / per_cycle))

    def layer(self) -> None:
        if self.mode == "sleep":
            time.sleep(self.seconds)
        elif self.mode == "matmul":
            torch_module().matmul(self.a, self.w, out=self.o)
        else:
            torch_module().cuda._sleep(self.cycles)

    def start(self) -> Any:
        """Start of a prefill: returns a token for :meth:`end_time`."""
        if self.mode == "sleep":
            return None
        torch = torch_module()
        torch.cuda.synchronize(self.device)
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        e0.synchronize()
        return (e0, now())

    def mark_end(self) -> Any:
        """Called right after the last layer's compute was issued."""
        if self.mode == "sleep":
            return now()
        e1 = torch_module().cuda.Event(enable_timing=True)
        e1.record()
        return e1

    def end_time(self, token: Any, mark: Any) -> float:
        """Host-clock time at which the last layer's compute finished."""
        if self.mode == "sleep":
            return float(mark)
        e0, t_e0 = token
        mark.synchronize()
        return float(t_e0 + e0.elapsed_time(mark) / 1e3)


def _overlap_schedule(g: dict[str, Any]) -> list[tuple[str, int, bool]]:
    """(mode, rep, warm-up?) in run order: one serialized warm-up, then serialized and layer-wise
    repetitions alternating, so that a change in machine load hits both alike."""
    out = [("serialized", 0, True)]
    for r in range(max(g["serial_reps"], g["reps"])):
        if r < g["serial_reps"]:
            out.append(("serialized", r + 1, False))
        if r < g["reps"]:
            out.append(("layerwise", r, False))
    return out


def overlap_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["recv_device"])
    holder = _CacheHolder(cfg["recv_device"], None)
    rows = []
    for g in cfg["groups"]:
        shape = g["shape"]
        cache = holder.get(shape)
        schedule = _overlap_schedule(g)
        with _open(cache.layout, cfg) as cm:
            link.publish(cm.metadata())
            t1s = []
            for m, r, _ in schedule:  # as a decode worker would: layer by layer, then the whole request
                seq = f"ov{g['index']}-{m}-{r}"
                link.barrier(seq)
                for layer in range(shape["num_layers"]):
                    cm.wait_layer(seq, layer, timeout=cfg["timeout"])
                cm.wait(seq, timeout=cfg["timeout"])
                t1s.append(now())
                cm.release(seq)
            t0s = link.recv_value()
            link.barrier(f"ov-end-{g['index']}")
        result: dict[str, list[float]] = {"serialized": [], "layerwise": []}
        for (m, _, warm), t0, t1 in zip(schedule, t0s, t1s, strict=True):
            if not warm:
                result[m].append(t1 - t0)
        ser = summarize(result["serialized"])
        lay = summarize(result["layerwise"])
        c = g["compute_s"]
        row = {"workload": "overlap", "case": {"preset": shape["preset"], "tokens": shape["tokens"], "ids": "random"},
               "bytes": shape["request_bytes"], "compute_s_per_layer": c, "compute_mode": g["mode"],
               "num_layers": shape["num_layers"], "serialized_s": ser["median_s"], "exposed_s": lay["median_s"],
               "exposed_p99_s": lay["p99_s"], "samples_serialized_s": result["serialized"],
               "samples_exposed_s": result["layerwise"], "median_s": ser["median_s"],
               "gbps": gbps(shape["request_bytes"], ser["median_s"]),
               "exposed_pct": 100.0 * lay["median_s"] / ser["median_s"] if ser["median_s"] > 0 else float("nan"),
               **busy()}
        rows.append(row)
        progress(cfg, g["index"], f"{cfg['label']} overlap {shape['preset']} {_tok(shape['tokens'])}: compute "
                 f"{c * 1e3:.3g} ms/layer, serialized {ser['median_s'] * 1e3:.1f} ms, exposed "
                 f"{lay['median_s'] * 1e3:.2f} ms ({row['exposed_pct']:.1f}%)")
    return done({"rows": rows})


def overlap_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Serialized: the puts alone (all compute happened before). Layer-wise: compute, put, signal per layer;
    the stamp is the end of the last layer's compute, so ``t1 - stamp`` is the exposed transfer."""
    use_device(cfg["send_device"])
    from .plan import block_ids

    holder = _CacheHolder(cfg["send_device"], FILL)
    for g in cfg["groups"]:
        shape = g["shape"]
        cache = holder.get(shape)
        src, dst = block_ids("random", shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
        compute = _Compute(g["mode"], g["compute_s"], cfg["send_device"], g.get("matmul"))
        nl = shape["num_layers"]
        with _open(cache.layout, cfg) as cm:
            peer = cm.connect(link.peer_metadata())
            stamps = []
            for mode, r, _ in _overlap_schedule(g):
                seq = f"ov{g['index']}-{mode}-{r}"
                link.barrier(seq)
                if mode == "serialized":
                    stamps.append(now())
                    for layer in range(nl):
                        cm.put_layer(peer, seq, layer, src, dst)
                        cm.signal_layer(peer, seq, layer)
                    cm.signal(peer, seq)
                else:
                    token = compute.start()
                    mark = None
                    for layer in range(nl):
                        compute.layer()
                        if layer == nl - 1:
                            mark = compute.mark_end()
                        cm.put_layer(peer, seq, layer, src, dst)
                        cm.signal_layer(peer, seq, layer)
                    cm.signal(peer, seq)
                    stamps.append(compute.end_time(token, mark))
                cm.flush(peer)
            link.send_value(stamps)
            link.barrier(f"ov-end-{g['index']}")
    return done({})


# ====================================================================== 4. completion latency
def latency_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["recv_device"])
    shape = cfg["shape"]
    cache = make_cache(shape_cache_spec(shape), cfg["recv_device"], None)
    n = cfg["seqs"]
    with _open(cache.layout, cfg) as cm:
        link.publish(cm.metadata())
        seqs = [f"lat-{i}" for i in range(1 + n)]
        t1s = _recv_reps(link, cm, seqs, cfg["timeout"])
        t_put, t_sig = link.recv_value()
        link.barrier("end")
    sig = _durations(t_sig, t1s, 1)
    req = _durations(t_put, t1s, 1)
    st = summarize(sig)
    rq = summarize(req)
    row = {"workload": "latency", "case": {"preset": shape["preset"], "blocks": 1, "seqs": n},
           "bytes": shape["num_layers"] * shape["piece_bytes"], **st, "samples_s": sig,
           "request_median_s": rq["median_s"], "request_p99_s": rq["p99_s"], **busy()}
    progress(cfg, 0, f"{cfg['label']} latency signal->wait over {n} one-block sequences: median "
             f"{st['median_s'] * 1e6:.0f} us, p99 {st['p99_s'] * 1e6:.0f} us (whole request {rq['median_s'] * 1e6:.0f} us)")
    return done({"rows": [row]})


def latency_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["send_device"])
    shape = cfg["shape"]
    cache = make_cache(shape_cache_spec(shape), cfg["send_device"], FILL)
    n, pool = cfg["seqs"], shape["pool_blocks"]
    t_put, t_sig = [], []
    with _open(cache.layout, cfg) as cm:
        peer = cm.connect(link.peer_metadata())
        for i in range(1 + n):
            seq = f"lat-{i}"
            b = i % pool
            link.barrier(seq)
            t_put.append(now())
            for layer in range(shape["num_layers"]):
                cm.put_layer(peer, seq, layer, [b], [b])
            cm.flush(peer)
            t_sig.append(now())
            cm.signal(peer, seq)
        link.send_value((t_put, t_sig))
        cm.flush(peer)
        link.barrier("end")
    return done({})


def _fmt(size: int) -> str:
    from .plan import fmt_bytes

    return fmt_bytes(size)


def _tok(tokens: int) -> str:
    from .plan import fmt_tokens

    return fmt_tokens(tokens)
