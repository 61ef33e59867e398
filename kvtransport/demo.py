"""The main job: move a vLLM-shaped KV request between two local processes, verify it, report GB/s.

``kvtransport demo`` spawns a receiver (decode side) and a sender (prefill side), builds a Llama-3.1-8B
shaped paged cache in each (32 layers, 8 KV heads, head 128, bf16, block 16: 64 KiB per layer and block),
pushes a request layer by layer into random destination blocks from random source blocks, and has the
receiver wait layer by layer. Every transferred piece is compared byte for byte and every other block is
checked untouched. The figure is reported next to a ceiling for the same bytes on the same machine,
measured in the same run: on the host the best of plain copies (one thread, several threads, and a
cross-process read of the sender's memory, timed in the receiver after each transfer; see
kvtransport.bench.ceiling); on CUDA a cuda:0 -> cuda:1 copy in one piece.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from .workload.caches import PRESETS, CacheSpec, host_copy, make_cache, preset, verify_transfer
from .workload.harness import RoleLink, run_pair


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
    ceiling = None
    with kvtransport.open(cache.layout, backend=cfg["backend"]) as cm:
        link.publish(cm.metadata())
        if cfg["receiver_device"] == "cpu":  # the same bytes by plain copies, timed after each transfer
            ceiling, _buffers = _host_ceiling(cfg["nbytes"], link.recv_value())
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
            if ceiling is not None:
                ceiling.sample()
        link.barrier("ceiling-done")
        stats = cm.stats()
    src, dst = _plan(cfg)
    pairs = list(zip(src, dst, strict=True))
    problems = verify_transfer(host_copy(cache), host_copy(make_cache(spec, "cpu", cfg["seed"])),
                               {layer: pairs for layer in range(spec.num_layers)}) if cfg["verify"] else []
    out = {"times": times, "problems": problems, "stats": stats, "pieces": len(pairs) * spec.num_layers}
    if ceiling is not None:
        out["ceiling"] = {"gbps": ceiling.gbps(), "notes": ceiling.notes}
    return out


def _host_ceiling(nbytes: int, remote: tuple[int, int]) -> tuple[Any, Any]:
    """A CopyCeiling over local buffers of ``nbytes`` (and the sender's, at ``remote``), and the buffers,
    which the caller keeps alive while sampling."""
    import numpy as np

    from .bench.ceiling import CopyCeiling

    src = np.full(nbytes, 0x5A, dtype=np.uint8)
    dst = np.full(nbytes, 0xA5, dtype=np.uint8)  # touched: no first-write page faults in a timed copy
    return CopyCeiling(nbytes, int(dst.ctypes.data), int(src.ctypes.data), remote), (src, dst)


def sender(link: RoleLink, cfg: dict[str, Any]) -> dict[str, Any]:
    import kvtransport

    spec = _spec(cfg)
    cache = make_cache(spec, cfg["sender_device"], fill_seed=cfg["seed"])
    with kvtransport.open(cache.layout, backend=cfg["backend"]) as cm:
        peer = cm.connect(link.peer_metadata())
        source = None
        if cfg["receiver_device"] == "cpu":  # what the receiver's cross-process copy reads
            import numpy as np

            source = np.full(cfg["nbytes"], 0x3C, dtype=np.uint8)
            link.send_value((os.getpid(), int(source.ctypes.data)))
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
        link.barrier("ceiling-done", timeout=cfg["timeout"])  # keeps ``source`` alive while it is read
        del source
        return {"path": peer.path, "backend": cm.backend}


def run(argv: list[str] | None = None) -> int:
    """``kvtransport demo``: 0 when the request arrived byte-exact, 1 when verification failed. Raises
    KVTransportError (the CLI prints it in one line) for a bad setting, before any process is spawned."""
    ap = argparse.ArgumentParser(prog="kvtransport demo", description=__doc__.split("\n\n")[0])
    what = ap.add_argument_group("the request")
    what.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS), help="KV shape preset (default %(default)s)")
    what.add_argument("--tokens", type=int, default=2048, help="prompt length of the request (default %(default)s)")
    what.add_argument("--pattern", default="random", choices=["random", "contiguous"],
                      help="block ids: random on both sides (a long-running server), or one run per layer")
    where = ap.add_argument_group("where it moves")
    where.add_argument("--backend", default=None, help="backend name (default: KV_TRANSPORT, else auto)")
    where.add_argument("--device", default="cpu", help="cpu or cuda (sender cuda:0, receiver cuda:1 if present)")
    how = ap.add_argument_group("the run")
    how.add_argument("--reps", type=int, default=3, help="timed transfers after one warm-up (default %(default)s)")
    how.add_argument("--timeout", type=float, default=120.0, help="bound of every wait, seconds (default %(default)s)")
    how.add_argument("--seed", type=int, default=0, help="seed of the block ids and the cache contents")
    how.add_argument("--no-verify", dest="verify", action="store_false", help="skip the byte-for-byte check")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.reps < 1:
        ap.error("--tokens and --reps must be >= 1")

    import kvtransport
    from kvtransport import registry
    from kvtransport.config import resolve

    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    settings = resolve(backend=args.backend)  # every setting checked here, in one process, before spawning
    chosen = registry.choose(settings.backend, kind).name
    request_blocks = -(-args.tokens // 16)
    cfg: dict[str, Any] = {
        "backend": chosen, "model": args.model, "num_blocks": 2 * request_blocks, "request_blocks": request_blocks,
        "reps": args.reps, "pattern": args.pattern, "timeout": args.timeout, "seed": args.seed, "verify": args.verify,
        "sender_device": "cpu" if kind == "cpu" else "cuda:0"}
    if kind == "cuda":
        import torch

        cfg["receiver_device"] = f"cuda:{1 if torch.cuda.device_count() > 1 else 0}"
    else:
        cfg["receiver_device"] = "cpu"
    spec = _spec(cfg)
    nbytes = cfg["nbytes"] = request_blocks * spec.num_layers * spec.piece_bytes
    mib = f"{nbytes / 2**20:.0f} MiB"
    print(f"kvtransport {kvtransport.__version__} demo: {args.model} KV request of {args.tokens} tokens = "
          f"{spec.num_layers} layers x {request_blocks} blocks x {spec.piece_bytes >> 10} KiB = {mib}, "
          f"{args.pattern} block ids, 2 processes ({cfg['sender_device']} -> {cfg['receiver_device']})", flush=True)
    r, s = run_pair(f"{__name__}.receiver", f"{__name__}.sender", cfg, timeout=args.timeout * (args.reps + 2))
    med = statistics.median(r["times"])
    gbps = nbytes / med / 1e9
    auto = " (chosen by auto: the fastest usable here)" if settings.backend == "auto" else ""
    print(f"backend: {s['backend']} via {s['path']}{auto}")
    print(f"transfer: {med * 1e3:.1f} ms median of {args.reps} -> {gbps:.2f} GB/s")
    if kind == "cpu":
        methods = r["ceiling"]["gbps"]
        best = max(methods, key=methods.get)
        base = methods[best]
        parts = ", ".join(f"{m} {g:.2f}" for m, g in methods.items())
        print(f"ceiling: {base:.2f} GB/s, the best plain copy of the same {mib} timed in this run "
              f"-> kvtransport at {100 * gbps / base:.1f}% of it")
        print(f"         (best sample of each: {parts} GB/s)")
        for note in r["ceiling"]["notes"][:1]:
            print(f"  ({note})")
    else:
        from .bench.baselines import Ceiling

        base = Ceiling("cuda", cap=nbytes).measure(nbytes)["gbps"]
        print(f"ceiling: {base:.2f} GB/s, a cuda:0 -> {cfg['receiver_device']} copy of the same {mib} in one piece "
              f"(best of 5, after the transfers) -> kvtransport at {100 * gbps / base:.1f}% of it")
    if not args.verify:
        print("verification skipped (--no-verify)")
        return 0
    if r["problems"]:
        print("VERIFICATION FAILED:\n  " + "\n  ".join(r["problems"][:20]))
        return 1
    print(f"verified: {r['pieces']} pieces byte-exact on the receiver; no other block written")
    return 0
