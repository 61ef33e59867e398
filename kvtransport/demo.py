"""The main job: move a vLLM-shaped KV request between two local processes, verify it, report GB/s.

``kvtransport demo`` spawns a receiver (decode side) and a sender (prefill side), builds a Llama-3.1-8B
shaped paged cache in each (32 layers, 8 KV heads, head 128, bf16, block 16: 64 KiB per layer and block),
pushes a request layer by layer into random destination blocks from random source blocks, and has the
receiver wait layer by layer. Every transferred piece is compared byte for byte and every other block is
checked untouched. The figure is reported next to a memcpy (host) or device copy (CUDA) of the same bytes
measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from .testing.cache import PRESETS, CacheSpec, host_copy, make_cache, preset, verify_transfer
from .testing.harness import RoleLink, run_pair


def _plan(cfg: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The request's (source, destination) block ids: random on both sides, as in a long-running server."""
    rng = random.Random(cfg["seed"])
    n = cfg["request_blocks"]
    if cfg.get("pattern") == "contiguous":  # one run per layer: the best case
        return list(range(n)), list(range(n, 2 * n))
    return rng.sample(range(cfg["num_blocks"]), n), rng.sample(range(cfg["num_blocks"]), n)


def _spec(cfg: dict[str, Any]) -> CacheSpec:
    return preset(cfg["model"], cfg["num_blocks"], cfg.get("order", "NHD"))


def receiver(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    import kvtransport

    spec = _spec(cfg)
    cache = make_cache(spec, cfg["receiver_device"])
    times = []
    with kvtransport.open(cache.layout, backend=cfg["backend"]) as cm:
        link.publish(cm.metadata())
        for rep in range(-1, cfg["reps"]):  # rep -1 warms up
            seq = f"req-{rep}"
            link.barrier(f"go-{rep}")
            t_start = link.recv_value()
            for layer in range(spec.num_layers):
                cm.wait_layer(seq, layer, timeout=cfg["timeout"])
            cm.wait(seq, timeout=cfg["timeout"])
            if rep >= 0:
                times.append(time.time() - t_start)
            cm.release(seq)
        stats = cm.stats()
    src, dst = _plan(cfg)
    pairs = list(zip(src, dst, strict=True))
    problems = verify_transfer(host_copy(cache), host_copy(make_cache(spec, "cpu", cfg["seed"])),
                               {layer: pairs for layer in range(spec.num_layers)}) if cfg["verify"] else []
    return {"times": times, "problems": problems, "stats": stats, "pieces": len(pairs) * spec.num_layers}


def sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    import kvtransport

    spec = _spec(cfg)
    cache = make_cache(spec, cfg["sender_device"], fill_seed=cfg["seed"])
    with kvtransport.open(cache.layout, backend=cfg["backend"]) as cm:
        peer = cm.connect(link.peer_metadata())
        src, dst = _plan(cfg)
        for rep in range(-1, cfg["reps"]):
            seq = f"req-{rep}"
            link.barrier(f"go-{rep}")
            link.send_value(time.time())
            for layer in range(spec.num_layers):
                cm.put_layer(peer, seq, layer, src, dst)
                cm.signal_layer(peer, seq, layer)
            cm.signal(peer, seq)
            cm.flush(peer, timeout=cfg["timeout"])
        return {"path": peer.path, "backend": cm.backend}


def copy_baseline(nbytes: int, device: str, reps: int = 5) -> float:
    """GB/s of one contiguous copy of ``nbytes`` (memcpy on the host, device copy across GPUs on CUDA)."""
    if device == "cpu":
        import numpy as np

        a = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        b = np.empty_like(a)
        np.copyto(b, a)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(b, a)
            ts.append(time.perf_counter() - t0)
        return nbytes / statistics.median(ts) / 1e9
    return _device_copy_baseline(nbytes, reps)


def _device_copy_baseline(nbytes: int, reps: int) -> float:
    import torch

    n = torch.cuda.device_count()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0").random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{1 if n > 1 else 0}")
    dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        e0.record()
        dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        ts.append(float(e0.elapsed_time(e1)) / 1e3)
    return nbytes / statistics.median(ts) / 1e9


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransport demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default=None, help="backend name (default: KV_TRANSPORT, else auto)")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of the request")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (sender cuda:0, receiver cuda:1 if present)")
    ap.add_argument("--pattern", default="random", choices=["random", "contiguous"],
                    help="block ids: random on both sides (a long-running server), or one run per layer")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    args = ap.parse_args(argv)

    import os

    import kvtransport
    from kvtransport import registry

    backend = args.backend or os.environ.get("KV_TRANSPORT") or "auto"
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    chosen = registry.choose(backend, kind).name
    request_blocks = -(-args.tokens // 16)
    cfg = {"backend": chosen, "model": args.model, "num_blocks": 2 * request_blocks, "request_blocks": request_blocks,
           "reps": args.reps, "pattern": args.pattern, "timeout": args.timeout, "seed": args.seed, "verify": args.verify,
           "sender_device": "cpu" if kind == "cpu" else "cuda:0"}
    if kind == "cuda":
        import torch

        cfg["receiver_device"] = f"cuda:{1 if torch.cuda.device_count() > 1 else 0}"
    else:
        cfg["receiver_device"] = "cpu"
    spec = _spec(cfg)
    nbytes = request_blocks * spec.num_layers * spec.piece_bytes
    print(f"kvtransport {kvtransport.__version__} demo: {args.model} KV request of {args.tokens} tokens = "
          f"{spec.num_layers} layers x {request_blocks} blocks x {spec.piece_bytes >> 10} KiB = {nbytes / 2**20:.0f} MiB, "
          f"{args.pattern} block ids, 2 processes ({cfg['sender_device']} -> {cfg['receiver_device']})")
    print("backends:", "; ".join(str(r) for r in kvtransport.available_backends()))
    r, s = run_pair(f"{__name__}.receiver", f"{__name__}.sender", cfg, timeout=args.timeout * (args.reps + 2))
    med = statistics.median(r["times"])
    gbps = nbytes / med / 1e9
    base = copy_baseline(nbytes, cfg["sender_device"])
    what = "memcpy" if kind == "cpu" else "device copy"
    print(f"backend: {s['backend']} via {s['path']}")
    print(f"transfer: {med * 1e3:.1f} ms median of {args.reps} -> {gbps:.2f} GB/s")
    print(f"baseline: {what} of the same {nbytes / 2**20:.0f} MiB in one piece: {base:.2f} GB/s "
          f"-> kvtransport at {100 * gbps / base:.1f}% of it")
    if not args.verify:
        print("verification skipped (--no-verify)")
        return 0
    if r["problems"]:
        print("VERIFICATION FAILED:\n  " + "\n  ".join(r["problems"][:20]))
        return 1
    print(f"verified: {r['pieces']} pieces byte-exact on the receiver; no other block written")
    return 0
