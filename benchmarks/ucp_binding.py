"""Micro-benchmark of the UCP RMA binding between two local processes (not a test).

Prints, all measured in the same run (the machine is noisy; compare ratios):
  * GB/s of one 64 MiB put+flush vs numpy memcpy of the same bytes,
  * per-put cost (µs) of 4,096 scattered 64 KiB puts via put_batch vs put() one by one,
  * idle CPU of wait_for_events over 2 s with nothing arriving.

Usage: python benchmarks/ucp_binding.py [--tls TLS] [--reps N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvtransport_ucx import _ucp

MiB = 1 << 20
BIG = 64 * MiB
NPUT = 4096
SEG = 64 * 1024
AREA = NPUT * SEG  # 256 MiB of scattered destinations


def _receiver(conn: Connection, tls: str | None) -> None:
    ctx = _ucp.UcpContext(tls=tls)
    w = ctx.create_worker()
    buf = np.zeros(AREA, dtype=np.uint8)  # big put uses the first 64 MiB
    mem = w.mem_map(buf.ctypes.data, buf.nbytes)
    conn.send((w.address(), mem.pack_rkey(), buf.ctypes.data))
    while not conn.poll(0):
        w.wait_for_events(0.05)
    conn.recv()  # "idle": measure idle progress CPU
    c0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < 2.0:
        w.wait_for_events(2.0 - (time.monotonic() - t0))
    conn.send((time.process_time() - c0, time.monotonic() - t0))
    conn.recv()
    ctx.close()


def _sender(conn: Connection, tls: str | None, reps: int) -> None:
    ctx = _ucp.UcpContext(tls=tls)
    w = ctx.create_worker()
    raddr, packed, rbase = conn.recv()
    ep = w.create_endpoint(raddr)
    rkey = ep.unpack_rkey(packed)
    lanes = ", ".join(f"{t}/{d}" for t, d in ep.transport_list())
    print(f"libucp {'.'.join(map(str, _ucp.ucx_version()))}  lanes: {lanes}  put_batch impl: {_ucp.batch_impl()}")

    src = np.random.default_rng(0).integers(0, 256, AREA, dtype=np.uint8)
    dst_local = np.empty(BIG, dtype=np.uint8)
    ep.put(src.ctypes.data, BIG, rbase, rkey)  # warm-up (registration caches, page faults)
    ep.flush(60)
    np.copyto(dst_local, src[:BIG])

    put_s, cpy_s = [], []
    for _ in range(reps):
        t = time.perf_counter()
        ep.put(src.ctypes.data, BIG, rbase, rkey)
        ep.flush(60)
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(dst_local, src[:BIG])
        cpy_s.append(time.perf_counter() - t)

    def gbs(seconds: float) -> float:
        return BIG / seconds / 1e9

    print(f"64 MiB put+flush : median {gbs(statistics.median(put_s)):.2f} GB/s  best {gbs(min(put_s)):.2f} GB/s")
    print(f"64 MiB np.copyto : median {gbs(statistics.median(cpy_s)):.2f} GB/s  best {gbs(min(cpy_s)):.2f} GB/s")

    for seg in (SEG, 4096):  # the asked-for 64 KiB, plus 4 KiB where call overhead shows
        _scattered(ep, rkey, src.ctypes.data, rbase, seg, reps)

    conn.send("idle")
    cpu, wall = conn.recv()
    print(f"idle wait_for_events: {cpu * 1e3:.1f} ms CPU over {wall:.2f} s ({cpu / wall * 100:.2f}% of a core)")
    conn.send("bye")
    ep.close()
    ctx.close()


def _scattered(ep: _ucp.UcpEndpoint, rkey: _ucp.UcpRkey, src: int, rbase: int, seg: int, reps: int) -> None:
    """NPUT puts of ``seg`` bytes to a random permutation of slots: put_batch vs put() loop."""
    perm = np.random.default_rng(1).permutation(NPUT).astype(np.uint64)
    local = np.arange(NPUT, dtype=np.uint64) * np.uint64(seg) + np.uint64(src)
    remote = perm * np.uint64(seg) + np.uint64(rbase)
    local_l, remote_l = local.tolist(), remote.tolist()

    def batch() -> float:
        t = time.perf_counter()
        ep.put_batch(local, remote, seg, rkey)
        return time.perf_counter() - t

    def one_by_one() -> float:
        t = time.perf_counter()
        put = ep.put
        for la, ra in zip(local_l, remote_l, strict=False):
            put(la, seg, ra, rkey)
        return time.perf_counter() - t

    for name, fn in (("put_batch", batch), ("put() loop", one_by_one)):
        fn()
        ep.flush(60)  # warm-up
        issue, total = [], []
        for _ in range(reps):
            t = time.perf_counter()
            issue.append(fn())
            ep.flush(60)
            total.append(time.perf_counter() - t)
        mi, mt = statistics.median(issue), statistics.median(total)
        print(
            f"{NPUT} x {seg // 1024:2d} KiB {name:10s}: issue {mi / NPUT * 1e6:6.2f} µs/put, issue+flush "
            f"{mt / NPUT * 1e6:6.2f} µs/put = {NPUT * seg / mt / 1e9:.2f} GB/s"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tls", default=None, help="UCX TLS for both sides (default: UCX's choice minus CUDA)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    err = _ucp.load_error()
    if err:
        sys.exit(err)
    spawn = mp.get_context("spawn")
    a, b = spawn.Pipe()
    rx = spawn.Process(target=_receiver, args=(a, args.tls))
    rx.start()
    try:
        _sender(b, args.tls, args.reps)  # this process initialises UCX only after spawning
    finally:
        rx.join(30)
        if rx.is_alive():
            rx.kill()


if __name__ == "__main__":
    main()
