"""The host path of a layer-wise push, without a GPU: how much of a request's time kvtransport's own host
work (put_layer, signal_layer, the signaller thread, the side channel) adds on top of the device copies.

On the 2xH200 host the fragmented 2k-token Llama-8B request reached ~60% of the raw copy although the copy
kernel alone reaches ~93%: the rest is host work per layer. This script reproduces that regime on any
machine: a one-sided link (ucx on host memory) whose puts are replaced by a simulated device copy of
``--copy-us`` per layer, queued behind the previous one as on a CUDA stream, whose completion marks report
"landed" only once that time has passed, and whose flush sleeps until then without the GIL (as the C wait
does). Everything else — coalescing, the slot table, the signaller, the side channel, the receiver — is the
real code. The receiver runs in its own process (as on the GPU host). Reported: the host issue cost per layer, and the
copy time as a share of the request time, first put to the last signal written (100% would mean the host
path hides entirely behind the copies).

    python benchmarks/host_path.py                    # 8 MiB layers at ~380 GB/s: 22 us of copy a layer
    python benchmarks/host_path.py --copy-us 5 --layers 80 --blocks 128   # 70B-TP8-like small layers

Uses private attributes of the manager's link state to install the simulation (a benchmark, not an API).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import sys
import time
from typing import Any


def _receiver(spec_dict: dict[str, Any], backend: str, conn: Any) -> None:
    """The receiving process: hands its metadata over, then waits for and releases each request it is told."""
    import kvtransport as kt
    from kvtransport.workload.caches import CacheSpec, HostCache

    spec = CacheSpec(**spec_dict)
    with kt.open(HostCache(spec).layout, backend=backend) as r:
        conn.send(r.metadata())
        while True:
            seq = conn.recv()
            if seq is None:
                return
            for layer in range(spec.num_layers):
                r.wait_layer(seq, layer, timeout=30)
            r.wait(seq, timeout=30)
            r.release(seq)
            conn.send(seq)


def run(copy_us: float, layers: int, blocks: int, requests: int, backend: str = "ucx") -> dict[str, Any]:
    """Push ``requests`` requests of ``layers`` layers x ``blocks`` random blocks to a receiver in another
    process; returns the medians (host issue per layer; request = first put to the last signal written)."""
    import multiprocessing as mp

    import kvtransport as kt
    from kvtransport.workload.caches import CacheSpec, HostCache

    try:  # short sleeps as precise as the C wait's (the default timer slack adds ~50 us to each)
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us; threads started later inherit it
    except (OSError, AttributeError):
        pass
    delay = copy_us * 1e-6
    spec = CacheSpec(num_layers=layers, num_blocks=blocks + blocks // 4, heads=1, block_size=1, head_dim=8, order="NHD")
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(spec.to_dict(), backend, there), daemon=True)
    proc.start()
    try:
        if not here.poll(120):
            raise SystemExit("the receiver process did not start")
        meta = here.recv()
        with kt.open(HostCache(spec).layout, backend=backend) as s:
            peer = s.connect(meta)
            st = peer._state
            if not st.one_sided:
                raise SystemExit(f"backend {backend} is not one-sided: the simulation needs a one-sided link")
            stream_end = [0.0]  # when the last queued simulated copy completes (perf_counter seconds)

            def put(layer: int, runs: Any) -> None:
                stream_end[0] = max(stream_end[0], time.perf_counter()) + delay

            def flush_and_send(timeout: float, fd: int, data: bytes, parking: Any, on_wait: Any) -> int:
                if parking is not None:
                    parking.park()
                left = stream_end[0] - time.perf_counter()
                if left > 0:
                    time.sleep(left)  # without the GIL, like the C wait
                return 0  # the manager writes the frames

            st.link.put = put
            st._mark = lambda: stream_end[0]
            st._landed = lambda token: time.perf_counter() >= token
            st._flush_and_send_fn = flush_and_send
            rng = random.Random(0)
            pool = list(range(spec.num_blocks))
            issue, whole = [], []
            for i in range(requests + 3):
                src_ids, dst_ids = rng.sample(pool, blocks), rng.sample(pool, blocks)
                seq = f"req{i}"
                here.send(seq)
                t0 = time.perf_counter()
                for layer in range(layers):
                    s.put_layer(peer, seq, layer, src_ids, dst_ids)
                    s.signal_layer(peer, seq, layer)
                s.signal(peer, seq)
                t1 = time.perf_counter()
                s.flush(peer, timeout=30)  # every signal written to the side channel
                t2 = time.perf_counter()
                if not here.poll(30) or here.recv() != seq:
                    raise SystemExit(f"the receiver did not complete {seq}")
                if i >= 3:  # warm-up
                    issue.append((t1 - t0) / layers)
                    whole.append(t2 - t0)
        here.send(None)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    copy_s = layers * delay
    req = statistics.median(whole)
    return {
        "copy_us_per_layer": copy_us, "layers": layers, "blocks": blocks, "requests": requests, "backend": backend,
        "host_issue_us_per_layer": round(statistics.median(issue) * 1e6, 1),
        "request_us": round(req * 1e6), "copy_us": round(copy_s * 1e6),
        "copy_share_pct": round(100 * copy_s / req, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copy-us", type=float, default=22.0, help="simulated device copy per layer (default 22)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=128, help="random blocks per layer (2k tokens at block 16)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--backend", default="ucx", help="a one-sided backend on host memory (default ucx)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    res = run(args.copy_us, args.layers, args.blocks, args.requests, args.backend)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['layers']} layers x {res['blocks']} blocks, simulated copy {res['copy_us_per_layer']:g} us/layer: "
              f"host issue {res['host_issue_us_per_layer']} us/layer; request {res['request_us']} us "
              f"vs copies {res['copy_us']} us -> copies are {res['copy_share_pct']}% of the request time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
