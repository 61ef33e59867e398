"""Where a GPU request's time goes: host cost of each ``put_layer``, the device copy time, and the completion
path, for one backend: sender on cuda:0, receiver process on cuda:1 (on a one-GPU host both on cuda:0, two
processes, CUDA IPC between them).

``kvtransport bench`` reports one figure per request (first put to the receiver's ``wait`` returning). This
script splits it: per request it times every ``put_layer`` call on the host, the copies on the device (CUDA
events around them on the sender's stream), when the sender's ``flush`` returned and when the receiver's
``wait`` returned (``time.monotonic`` is one clock for both processes), and it prices the launcher's
primitives one by one. Next to each request: the raw GPU0 -> GPU1 copy of the same bytes, same run (the
bench's own Ceiling; GPU0 -> GPU0 on one GPU). The ``signal`` case times signal -> the receiver's ``wait``
returning alone (no puts; p50 and p99 over ``--signals`` sequences).

    python benchmarks/gpu_put_path.py --backend mscclpp --out /tmp/probe.json
    python benchmarks/gpu_put_path.py --backend ucx --api layers   # one put_layers call per request

Needs a CUDA device and a backend with a device path (mscclpp, ucx); prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from typing import Any

CASES = {  # name: (preset, tokens, ids pattern)
    "llama8b-2k-random": ("llama-3.1-8b", 2048, "random"),
    "one-256MiB-put": ("one-layer", 65536, "contiguous"),
    "signal": ("one-layer", 16, "contiguous"),  # signal -> wait alone: no puts
}


def _spec(preset: str, tokens: int) -> Any:
    from kvtransport.workload.caches import preset as make_preset

    blocks = tokens // 16
    return make_preset(preset, blocks * 2 if preset != "one-layer" else blocks, "NHD")


def _ids(pattern: str, blocks: int, pool: int, seed: int) -> tuple[list[int], list[int]]:
    if pattern == "contiguous":
        return list(range(blocks)), list(range(blocks))
    rng = random.Random(seed)
    return rng.sample(range(pool), blocks), rng.sample(range(pool), blocks)


def _receiver(backend: str, cases: list[str], conn: Any, doorbell: bool, device: int) -> None:
    import torch

    import kvtransport as kt
    from kvtransport.workload.caches import CudaCache

    torch.cuda.set_device(device)
    for name in cases:
        preset, tokens, _ = CASES[name]
        cache = CudaCache(_spec(preset, tokens), f"cuda:{device}")
        with kt.open(cache.layout, backend=backend, timeout=60, doorbell=doorbell) as cm:
            conn.send(cm.metadata())
            while True:
                seq = conn.recv()
                if seq is None:
                    break
                cm.wait(seq, timeout=60)
                conn.send(time.monotonic())
                cm.release(seq)
            conn.send(cm.stats()["doorbell_signals"])
        del cache
        torch.cuda.empty_cache()


def _primitives(cm: Any) -> dict[str, float]:
    """Median cost (µs) of each step of a device put's host path, 2,000 calls each."""
    import ctypes

    import torch

    def cost(fn: Any, n: int = 2000) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return round((time.perf_counter() - t0) / n * 1e6, 2)

    out = {
        "torch.cuda.current_stream().cuda_stream": cost(lambda: torch.cuda.current_stream(0).cuda_stream),
        "ctypes no-op (getpid)": cost(ctypes.CDLL(None).getpid),
    }
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        out["torch._C._cuda_getCurrentRawStream"] = cost(lambda: raw(0))
    try:
        from kvtransport.gpu import SegmentCopier
    except ImportError:
        return out
    import numpy as np

    copier = SegmentCopier(0)
    buf = torch.empty(16 << 20, dtype=torch.uint8, device="cuda:0")
    base = buf.data_ptr()
    offs = np.arange(128, dtype=np.uint64) * np.uint64(64 << 10)
    table, n = copier.upload(offs, offs + np.uint64(8 << 20), np.full(128, 64 << 10, dtype=np.uint64))
    out["SegmentCopier.launch (128 x 64 KiB, local)"] = cost(lambda: copier.launch(table, n, base, base), 500)
    mark = copier.launch(table, n, base, base)
    torch.cuda.synchronize(0)
    out["Mark.done"] = cost(lambda: mark.done)
    out["cm.stats()"] = cost(cm.stats, 200)
    return out


def run_case(backend: str, name: str, reps: int, api: str, conn: Any, doorbell: bool, profile: bool = False,
             signals: int = 500) -> dict[str, Any]:
    import torch

    import kvtransport as kt
    from kvtransport.workload.caches import CudaCache

    preset, tokens, pattern = CASES[name]
    spec = _spec(preset, tokens)
    cache = CudaCache(spec, "cuda:0", fill_seed=1)
    blocks = tokens // 16
    src, dst = _ids(pattern, blocks, spec.num_blocks, 0)
    nbytes = spec.num_layers * blocks * spec.piece_bytes
    rows: dict[str, list[float]] = {k: [] for k in ("put_us", "issue_us", "gpu_copy_us", "flush_us", "wait_us")}
    prims: dict[str, float] = {}
    with kt.open(cache.layout, backend=backend, timeout=60, doorbell=doorbell) as cm:
        peer = cm.connect(conn.recv())
        if name == "signal":
            lat = []
            for r in range(signals + 20):
                seq = f"signal-{r}"
                conn.send(seq)
                time.sleep(0.002)  # the receiver is in wait()
                t0 = time.monotonic()
                cm.signal(peer, seq)
                t_wait = conn.recv()
                if r >= 20:
                    lat.append((t_wait - t0) * 1e6)
            conn.send(None)
            by_bell = conn.recv()
            lat.sort()
            return {"case": name, "backend": backend, "doorbell": doorbell, "doorbell_signals": by_bell,
                    "signals": len(lat), "signal_to_wait_p50_us": round(lat[len(lat) // 2], 1),
                    "signal_to_wait_p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
                    "signal_to_wait_max_us": round(lat[-1], 1)}
        for r in range(reps + 2):
            seq = f"{name}-{r}"
            conn.send(seq)
            time.sleep(0.01)  # the receiver is in wait()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            puts = []
            t0 = time.monotonic()
            e0.record()
            if api == "layers":
                prof = cProfile.Profile(time.perf_counter) if profile and r == 5 else None
                p0 = time.perf_counter()
                if prof is not None:
                    prof.enable()
                cm.put_layers(peer, seq, None, src, dst)
                if prof is not None:
                    prof.disable()
                puts.append(time.perf_counter() - p0)
                if prof is not None:  # µs per function, by cumulative time
                    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][3])[:18]  # type: ignore[attr-defined]
                    for (fname, line, func), (_, calls, tot, cum, _) in top:
                        print(f"    profile {cum * 1e6:8.1f} us cum {tot * 1e6:8.1f} us own {calls:4d}x "
                              f"{fname.rsplit('/', 1)[-1]}:{line}({func})")
            else:
                for layer in range(spec.num_layers):
                    p0 = time.perf_counter()
                    cm.put_layer(peer, seq, layer, src, dst)
                    puts.append(time.perf_counter() - p0)
            e1.record()
            t_issue = time.monotonic()
            cm.signal(peer, seq)
            cm.flush(peer)
            t_flush = time.monotonic()
            t_wait = conn.recv()
            torch.cuda.synchronize(0)
            if r < 2:
                continue
            rows["put_us"].append(statistics.median(puts) * 1e6)
            rows["issue_us"].append((t_issue - t0) * 1e6)
            rows["gpu_copy_us"].append(e0.elapsed_time(e1) * 1e3)
            rows["flush_us"].append((t_flush - t0) * 1e6)
            rows["wait_us"].append((t_wait - t0) * 1e6)
        if name == next(iter(CASES)):
            prims = _primitives(cm)
    conn.send(None)
    by_bell = conn.recv()
    del cache
    torch.cuda.empty_cache()
    from kvtransport.bench.baselines import Ceiling

    raw = Ceiling("cuda", cap=nbytes).measure(nbytes)["seconds"]  # best of 5 GPU0 -> GPU1 (one GPU: GPU0) copies
    med = {k: round(statistics.median(v), 1) for k, v in rows.items()}
    return {"case": name, "backend": backend, "api": api, "doorbell": doorbell, "doorbell_signals": by_bell, "bytes": nbytes, "layers": spec.num_layers,
            "raw_copy_us": round(raw * 1e6, 1), "raw_gbps": round(nbytes / raw / 1e9, 1), **med,
            "request_gbps": round(nbytes / (med["wait_us"] * 1e-6) / 1e9, 1),
            "request_pct_of_raw": round(100 * raw * 1e6 / med["wait_us"], 1),
            "gpu_copy_pct_of_raw": round(100 * raw * 1e6 / med["gpu_copy_us"], 1),
            "completion_lag_us": round(med["wait_us"] - med["flush_us"], 1), "primitives": prims}


def main(argv: list[str] | None = None) -> int:
    import multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="mscclpp")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--api", choices=["layer", "layers"], default="layer",
                    help="put_layer per layer (default) or one put_layers call per request")
    ap.add_argument("--doorbell", type=int, default=1, help="1: completions by doorbell where possible (default); 0: side channel only")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of one put_layers call")
    ap.add_argument("--signals", type=int, default=500, help="sequences timed by the signal case")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    import torch

    if torch.cuda.device_count() < 1:
        print("needs a CUDA device", file=sys.stderr)
        return 2
    receiver = 1 if torch.cuda.device_count() > 1 else 0  # one GPU: two processes on it (CUDA IPC)
    cases = args.cases.split(",")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(args.backend, cases, there, bool(args.doorbell), receiver),
                       daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    results = []
    try:
        for name in cases:
            res = run_case(args.backend, name, args.reps, args.api, here, bool(args.doorbell), args.profile,
                           args.signals)
            res["receiver_device"] = f"cuda:{receiver}"
            results.append(res)
            if name == "signal":
                print(f"{args.backend} doorbell={args.doorbell} ({res['doorbell_signals']} used) signal -> wait: p50 "
                      f"{res['signal_to_wait_p50_us']} us, p99 {res['signal_to_wait_p99_us']} us, max "
                      f"{res['signal_to_wait_max_us']} us over {res['signals']}", flush=True)
                continue
            print(f"{args.backend} {args.api} doorbell={args.doorbell} ({res['doorbell_signals']} used) {name}: put {res['put_us']} us x {res['layers']}, issue "
                  f"{res['issue_us']} us, gpu copies {res['gpu_copy_us']} us ({res['gpu_copy_pct_of_raw']}% of raw), "
                  f"flush {res['flush_us']} us, receiver wait {res['wait_us']} us -> {res['request_gbps']} GB/s "
                  f"({res['request_pct_of_raw']}% of raw {res['raw_gbps']} GB/s); completion lag "
                  f"{res['completion_lag_us']} us", flush=True)
            for k, v in res["primitives"].items():
                print(f"    {k}: {v} us")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
