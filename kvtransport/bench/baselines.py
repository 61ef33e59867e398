"""Baselines measured in the same run: the ceiling, raw torch.distributed send/recv, NIXL; and the
per-layer compute time of the overlap workload.

* Ceiling: a contiguous copy of the same bytes in one process: the best of ``memcpy`` in one thread and in
  several (kvtransport.bench.ceiling) on CPU, GPU0 -> GPU1 ``copy_`` timed with CUDA events on CUDA (the
  demo's CUDA ceiling too).
* Raw ``torch.distributed``: a 2-rank process group (gloo for host memory, NCCL for CUDA) in two
  processes, one ``send`` of the bytes (messages of at most 256 MiB), timed with the roles' protocol.
* Raw TCP stream (``bench --netns``): one TCP connection between the two hosts, the same bytes per request
  with ``sendall`` into one ``recv_into`` buffer: the link's own figure for the TCP backends.
* NIXL (``nixl`` wheel, UCX backend), when importable: prepared descriptor lists over the same layouts,
  one WRITE with a notification per request, timed with the same protocol.
* Mooncake's transfer engine (``mooncake-transfer-engine``, or ``-non-cuda`` on a host without a CUDA driver),
  when importable: P2P handshake (no metadata server), TCP on host memory, the receiver's whole region
  registered; a request is one synchronous batched WRITE of its pieces, contiguous pieces merged first (as
  vLLM's MooncakeConnector merges contiguous blocks), batches of at most MOONCAKE_BATCH entries. Mooncake has no
  completion notification on the receiving side: a request is timed on the sender, from before the first batch
  to the return of the last synchronous one (every byte acknowledged by the receiver's engine).
"""

from __future__ import annotations

import os
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

RAW_CHUNK = 256 << 20
"""Largest single message of the raw send/recv baseline (bigger requests go as several messages)."""


# ====================================================================== ceiling
class Ceiling:
    """Contiguous-copy bandwidth of a given size: the best of ``samples`` timings (a ceiling is what the
    machine can do, so other work that slows one sample down must not lower it), measured once per size.

    Sizes above ``cap`` are measured at ``cap`` (copy bandwidth is flat well below it; ``measured_at``
    in the result says so)."""

    def __init__(self, device: str, cap: int, samples: int = 5) -> None:
        self.device = device
        self.cap = cap
        self.samples = samples
        self.cache: dict[int, dict[str, Any]] = {}
        self.method = ("memcpy (best of 1 and several threads)" if device == "cpu"
                       else "cuda:0 -> cuda:1 copy_ (CUDA events)")

    def measure(self, nbytes: int) -> dict[str, Any]:
        """``{"gbps", "seconds", "measured_at", "method"}`` for a copy of ``nbytes``."""
        if nbytes in self.cache:
            return self.cache[nbytes]
        n = min(nbytes, self.cap)
        if n in self.cache:
            secs = self.cache[n]["seconds"]
        else:
            inner = max(1, (8 << 20) // n)  # several copies per sample for small sizes (timer resolution)
            secs = self._host(n, inner) if self.device == "cpu" else self._cuda(n, inner)
        out = {"gbps": gbps(n, secs), "seconds": secs * nbytes / n, "measured_at": n, "method": self.method}
        self.cache[nbytes] = out
        return out

    def _host(self, n: int, inner: int) -> float:
        import numpy as np

        from .ceiling import CopyCeiling

        a = np.full(n, FILL, dtype=np.uint8)
        b = np.zeros_like(a)
        np.copyto(b, a)
        ceiling = CopyCeiling(n, int(b.ctypes.data), int(a.ctypes.data))
        ts = []
        for _ in range(self.samples):
            if inner == 1:
                ceiling.sample()
                continue
            t0 = time.perf_counter()
            for _ in range(inner):
                np.copyto(b, a)
            ts.append((time.perf_counter() - t0) / inner)
        return min(ts) if ts else n / ceiling.best()[1] / 1e9

    def _cuda(self, n: int, inner: int) -> float:
        torch = torch_module()
        dst_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
        src = torch.full((n,), FILL, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(n, dtype=torch.uint8, device=dst_dev)
        dst.copy_(src)
        torch.cuda.synchronize()
        ts = []
        for _ in range(self.samples):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(inner):
                dst.copy_(src, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3 / inner)
        del src, dst
        torch.cuda.empty_cache()
        return float(min(ts))


# ====================================================================== per-layer compute
def layer_compute_seconds(hidden: int, tp: int, tokens: int, device: str, cpu_max_tokens: int = 512) -> tuple[float, str]:
    """Time of ``[tokens, hidden] @ [hidden, hidden/tp]`` in bf16 on ``device`` (best of 3 after a warm-up:
    other work on a shared machine only ever slows it down). On CPU in float32: torch's CPU bf16 matmul
    without AMX/AVX512-BF16 is a scalar fallback (29 s for [128, 4096] @ [4096, 4096] on the 2-core EPYC VM,
    0.23 s in float32), which made every overlap case exceed the budget and skip.

    On CPU the matmul is measured at ``min(tokens, cpu_max_tokens)`` rows and scaled linearly to
    ``tokens`` (the note says so). Returns (seconds, how it was obtained)."""
    torch = torch_module()
    n = max(1, hidden // tp)
    rows = tokens if device != "cpu" else min(tokens, cpu_max_tokens)
    dev = "cuda:0" if device != "cpu" else "cpu"
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    a = torch.randn(rows, hidden, dtype=dtype, device=dev)
    w = torch.randn(hidden, n, dtype=dtype, device=dev)
    o = torch.empty(rows, n, dtype=dtype, device=dev)
    torch.matmul(a, w, out=o)
    ts = []
    for _ in range(3):
        if dev == "cpu":
            t0 = time.perf_counter()
            torch.matmul(a, w, out=o)
            ts.append(time.perf_counter() - t0)
        else:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.matmul(a, w, out=o)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
    secs = float(min(ts)) * tokens / rows
    shape = f"{'bf16' if device != 'cpu' else 'fp32'} [{tokens}, {hidden}] @ [{hidden}, {n}] on {dev}"
    note = shape if rows == tokens else f"{shape}, measured at {rows} rows and scaled x{tokens / rows:g}"
    return secs, note


# ====================================================================== raw torch.distributed
def _raw_group(link: Any, cfg: dict[str, Any], rank: int) -> Any:
    import datetime

    torch = torch_module()
    dist = torch.distributed
    kind = "gloo" if cfg["send_device"] == "cpu" else "nccl"
    timeout = datetime.timedelta(seconds=cfg["timeout"])
    address = _net_address()
    if os.environ.get("NET_IFNAME") and kind == "gloo":  # between hosts (bench --netns): gloo on that interface
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NET_IFNAME"]
    if rank == 1:  # receiver hosts the store
        store = dist.TCPStore(address, 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)
        link.publish(f"{address} {store.port}".encode())
    else:
        host, port = link.peer_metadata().decode().split()
        store = dist.TCPStore(host, int(port), 2, is_master=False, timeout=timeout)
    dev = cfg["recv_device"] if rank == 1 else cfg["send_device"]
    if kind == "nccl":
        torch.cuda.set_device(dev)
    dist.init_process_group(kind, store=store, rank=rank, world_size=2, timeout=timeout)
    return dist


def _chunks(nbytes: int) -> list[int]:
    out = [RAW_CHUNK] * (nbytes // RAW_CHUNK)
    if nbytes % RAW_CHUNK:
        out.append(nbytes % RAW_CHUNK)
    return out


def raw_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    dist = _raw_group(link, cfg, 1)
    dev = cfg["recv_device"]
    buf = alloc(min(max(cfg["sizes"]), RAW_CHUNK), dev, None)
    flat = _as_torch(buf).view(-1)
    rows = []
    for i, (size, reps) in enumerate(zip(cfg["sizes"], cfg["reps"], strict=True)):
        set_bytes(flat[:16], 0)
        t1s = []
        for r in range(1 + reps):
            link.barrier(f"raw{i}-{r}")
            works = [dist.irecv(flat[:c], src=0) for c in _chunks(size)]
            for w in works:
                w.wait()
            sync(dev)
            t1s.append(now())
        d = [b - a for a, b in zip(link.recv_value(), t1s, strict=True)][1:]
        st = summarize(d)
        rows.append({"case": {"size": size}, "bytes": size, "samples_s": d, **st, "gbps": gbps(size, st["median_s"]),
                     **busy(), "verified": is_filled(flat[:16], FILL)})
        progress(cfg, i, f"{cfg['label']} {_fmt(size)}: {rows[-1]['gbps']:.3g} GB/s")
    link.barrier("end")
    dist.destroy_process_group()
    return done({"rows": rows})


def raw_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    dist = _raw_group(link, cfg, 0)
    dev = cfg["send_device"]
    flat = _as_torch(alloc(min(max(cfg["sizes"]), RAW_CHUNK), dev, FILL)).view(-1)
    for i, (size, reps) in enumerate(zip(cfg["sizes"], cfg["reps"], strict=True)):
        t0s = []
        for r in range(1 + reps):
            link.barrier(f"raw{i}-{r}")
            t0s.append(now())
            works = [dist.isend(flat[:c], dst=1) for c in _chunks(size)]
            for w in works:
                w.wait()
        link.send_value(t0s)
    link.barrier("end")
    dist.destroy_process_group()
    return done({})


def _net_address() -> str:
    """NET_IFNAME's IPv4 address (bench --netns sets NET_IFNAME in each role's host), else loopback."""
    from ..config import resolve

    return resolve().address


# ====================================================================== raw TCP stream
TCP_RECV_CHUNK = 4 << 20
"""Largest ``recv_into`` of the TCP baseline's receiver (the kernel returns what it has, usually less)."""


def tcp_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """The raw TCP stream: one connection over NET_IFNAME's interface, each repetition ``size`` bytes sent
    with ``sendall`` and read with ``recv_into`` straight into one buffer (no framing, no gather/scatter):
    what the link and the kernel can do for these bytes, the yardstick of the TCP backends."""
    import socket

    import numpy as np

    server = socket.create_server((_net_address(), 0))
    link.publish(f"{server.getsockname()[0]} {server.getsockname()[1]}".encode())
    server.settimeout(cfg["timeout"])
    conn, _ = server.accept()
    server.close()
    conn.settimeout(cfg["timeout"])
    buf = np.zeros(max(cfg["sizes"]), dtype=np.uint8)
    view = buf.data  # a memoryview of the array
    rows = []
    with conn:
        for i, (size, reps) in enumerate(zip(cfg["sizes"], cfg["reps"], strict=True)):
            buf[:16] = 0
            buf[size - 16 : size] = 0
            t1s = []
            for r in range(1 + reps):
                link.barrier(f"tcp{i}-{r}")
                got = 0
                while got < size:
                    n = conn.recv_into(view[got : min(size, got + TCP_RECV_CHUNK)])
                    if not n:
                        raise ConnectionError(f"sender closed after {got} of {size} bytes")
                    got += n
                t1s.append(now())
            d = [b - a for a, b in zip(link.recv_value(), t1s, strict=True)][1:]
            st = summarize(d)
            ok = bool((buf[:16] == FILL).all() and (buf[size - 16 : size] == FILL).all())
            rows.append({"case": {"size": size}, "bytes": size, "samples_s": d, **st, "gbps": gbps(size, st["median_s"]),
                         **busy(), "verified": ok})
            progress(cfg, i, f"{cfg['label']} {_fmt(size)}: {rows[-1]['gbps']:.3g} GB/s")
        link.barrier("end")
    return done({"rows": rows})


def tcp_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    import socket

    import numpy as np

    host, port = link.peer_metadata().decode().split()
    buf = np.full(max(cfg["sizes"]), FILL, dtype=np.uint8)
    view = buf.data  # a memoryview of the array
    with socket.create_connection((host, int(port)), timeout=cfg["timeout"]) as conn:
        for i, (size, reps) in enumerate(zip(cfg["sizes"], cfg["reps"], strict=True)):
            t0s = []
            for r in range(1 + reps):
                link.barrier(f"tcp{i}-{r}")
                t0s.append(now())
                conn.sendall(view[:size])
            link.send_value(t0s)
        link.barrier("end")
        path = f"tcp {conn.getsockname()[0]} -> {host}"
    return done({"path": path})


def _as_torch(a: Any) -> Any:
    torch = torch_module()
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(a)


# ====================================================================== NIXL
def _installed(module: str, dists: tuple[str, ...]) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``dists`` installed, ``("unknown", "unknown")`` when none is
    named so, or None when ``import module`` fails."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception:
        return None
    from importlib import metadata

    for dist_name in dists:
        try:
            return dist_name, metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown", "unknown"


def nixl_version() -> str | None:
    """The installed nixl version, or None when ``import nixl`` fails."""
    found = _installed("nixl", ("nixl", "nixl-cu12", "nixl-cu13"))
    return None if found is None else found[1]


def _nixl_agent(role: str) -> Any:
    import importlib

    api: Any = importlib.import_module("nixl._api")
    return api.nixl_agent(f"kvbench-{role}-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))


def _mem(device: str) -> tuple[str, int]:
    """NIXL memory type and device id of a torch/cpu device string."""
    if device == "cpu":
        return "DRAM", 0
    return "VRAM", int(device.split(":")[1]) if ":" in device else 0


def _ptr(a: Any) -> int:
    return int(a.data_ptr()) if hasattr(a, "data_ptr") else int(a.ctypes.data)


def _nbytes(a: Any) -> int:
    return int(a.numel() * a.element_size()) if hasattr(a, "element_size") else int(a.nbytes)


class _NixlRegion:
    """A set of equally described pieces over registered buffers: ``descs[i] = (addr, len, dev)``."""

    def __init__(self, agent: Any, buffers: list[Any], descs: list[tuple[int, int, int]], device: str) -> None:
        self.mem, self.dev = _mem(device)
        self.agent = agent
        self.reg = agent.register_memory([(_ptr(b), _nbytes(b), self.dev, "") for b in buffers], self.mem)
        self.descs = descs


def _sweep_region(agent: Any, cfg: dict[str, Any], device: str, fill: int | None) -> tuple[_NixlRegion, list[Any]]:
    arrays = [alloc(s, device, fill) for s in cfg["sizes"]]
    _, dev = _mem(device)
    return _NixlRegion(agent, arrays, [(_ptr(a), _nbytes(a), dev) for a in arrays], device), arrays


def _kv_region(agent: Any, cache: Any, device: str) -> _NixlRegion:
    layout = cache.layout
    _, dev = _mem(device)
    descs = [(p.address(b), p.piece_bytes, dev) for layer in layout.layers for p in layer.planes
             for b in range(layout.num_blocks)]
    return _NixlRegion(agent, [cache.backing], descs, device)


def _kv_indices(cache: Any, blocks: list[int]) -> list[int]:
    layout = cache.layout
    out: list[int] = []
    k = 0
    for layer in layout.layers:
        for _ in layer.planes:
            base = k * layout.num_blocks
            out.extend(base + b for b in blocks)
            k += 1
    return out


def _peer_sweep_row(cfg: dict[str, Any], k: int, system: str, size: int, samples: list[float],
                    received: Any) -> dict[str, Any]:
    """A peer system's sweep row (the same fields as ours) for ``samples`` of one ``size``; a progress line."""
    st = summarize(samples)
    row = {"workload": "sweep", "case": {"size": size}, "bytes": size, "samples_s": samples, **st,
           "gbps": gbps(size, st["median_s"]), **busy(), "verified": is_filled(received, FILL)}
    progress(cfg, k, f"{system} sweep {_fmt(size)}: {row['gbps']:.3g} GB/s")
    return row


def _peer_kv_row(cfg: dict[str, Any], k: int, system: str, shape: dict[str, Any], pattern: str,
                 samples: list[float], probe: Any) -> dict[str, Any]:
    """A peer system's KV request row (coalescing: not ours, None) for ``samples`` of one case; a progress line."""
    st = summarize(samples)
    nbytes = shape["request_bytes"]
    row = {"workload": "kv", "case": {"preset": shape["preset"], "tokens": shape["tokens"], "ids": pattern,
                                      "coalesce": None},
           "bytes": nbytes, "samples_s": samples, **st, "gbps": gbps(nbytes, st["median_s"]), **busy(),
           "verified": is_filled(probe, FILL)}
    progress(cfg, k, f"{system} kv {shape['preset']} {shape['tokens']} {pattern}: {row['gbps']:.3g} GB/s")
    return row


def nixl_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["recv_device"])
    agent = _nixl_agent("recv")
    link.publish(agent.get_agent_metadata())
    rows: list[dict[str, Any]] = []
    dev = cfg["recv_device"]
    k = 0
    for item in cfg["items"]:
        if item["kind"] == "sweep":
            region, arrays = _sweep_region(agent, cfg, dev, None)
            link.send_value((region.descs, agent.get_agent_metadata()))  # metadata after registering: it holds the keys
            sender = str(link.recv_value())
            for i, size in enumerate(cfg["sizes"]):
                set_bytes(arrays[i], 0)
                d = _nixl_recv_reps(link, agent, sender, [f"nsw{i}-{r}" for r in range(1 + cfg["sweep_reps"][i])])
                rows.append(_peer_sweep_row(cfg, k, "nixl", size, d, arrays[i]))
                k += 1
            agent.deregister_memory(region.reg)
        else:
            from .plan import block_ids
            from .roles import shape_cache_spec

            shape = item["shape"]
            cache = make_cache(shape_cache_spec(shape), dev, None)
            region = _kv_region(agent, cache, dev)
            link.send_value((region.descs, agent.get_agent_metadata()))  # metadata after registering: it holds the keys
            sender = str(link.recv_value())
            for case in item["cases"]:
                _, dst = block_ids(case["pattern"], shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
                probe = cache.views["layers.0"][dst[0]]
                set_bytes(probe, 0)
                d = _nixl_recv_reps(link, agent, sender, [f"nkv{case['index']}-{r}" for r in range(1 + case["reps"])])
                rows.append(_peer_kv_row(cfg, k, "nixl", shape, case["pattern"], d, probe))
                k += 1
            agent.deregister_memory(region.reg)
            del cache
        link.barrier(f"nixl-item-end-{item['index']}")
    link.barrier("end")
    return done({"rows": rows})


def _nixl_recv_reps(link: Any, agent: Any, sender: str, seqs: list[str]) -> list[float]:
    t1s = []
    for seq in seqs:
        link.barrier(seq)
        tag = seq.encode()
        while not agent.check_remote_xfer_done(sender, tag):
            pass
        t1s.append(now())
    return [b - a for a, b in zip(link.recv_value(), t1s, strict=True)][1:]


def nixl_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    use_device(cfg["send_device"])
    agent = _nixl_agent("send")
    remote = agent.add_remote_agent(link.peer_metadata())
    dev = cfg["send_device"]
    mem, _ = _mem(dev)
    for item in cfg["items"]:
        if item["kind"] == "sweep":
            region, _arrays = _sweep_region(agent, cfg, dev, FILL)
            lh, rh = _nixl_prep(agent, remote, region, link.recv_value(), mem)
            link.send_value(agent.name)
            for i in range(len(cfg["sizes"])):
                _nixl_send_reps(link, agent, lh, rh, [i], [i], [f"nsw{i}-{r}" for r in range(1 + cfg["sweep_reps"][i])])
        else:
            from .plan import block_ids
            from .roles import shape_cache_spec

            shape = item["shape"]
            cache = make_cache(shape_cache_spec(shape), dev, FILL)
            region = _kv_region(agent, cache, dev)
            lh, rh = _nixl_prep(agent, remote, region, link.recv_value(), mem)
            link.send_value(agent.name)
            for case in item["cases"]:
                src, dst = block_ids(case["pattern"], shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
                _nixl_send_reps(link, agent, lh, rh, _kv_indices(cache, src), _kv_indices(cache, dst),
                                [f"nkv{case['index']}-{r}" for r in range(1 + case["reps"])])
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
        agent.deregister_memory(region.reg)
        link.barrier(f"nixl-item-end-{item['index']}")
    link.barrier("end")
    return done({"path": "nixl UCX"})


def _nixl_prep(agent: Any, remote: str, region: _NixlRegion, offer: Any, mem: str) -> tuple[Any, Any]:
    """Prepared local and remote descriptor lists. ``offer`` is the receiver's (descs, metadata): metadata
    taken after it registered the region (NIXL's metadata carries the remote keys of registered memory;
    metadata from before registration makes ``prep_xfer_dlist`` fail with NIXL_ERR_NOT_FOUND)."""
    remote_descs, metadata = offer
    agent.add_remote_agent(bytes(metadata))
    lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", region.descs, mem)
    rh = agent.prep_xfer_dlist(remote, [tuple(d) for d in remote_descs], mem)
    return lh, rh


def _nixl_send_reps(link: Any, agent: Any, lh: Any, rh: Any, li: list[int], ri: list[int], seqs: list[str]) -> None:
    t0s = []
    for seq in seqs:
        link.barrier(seq)
        t0s.append(now())
        h = agent.make_prepped_xfer("WRITE", lh, li, rh, ri, seq.encode())
        state = agent.transfer(h)
        while state == "PROC":
            state = agent.check_xfer_state(h)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer {seq} ended in state {state}")
        agent.release_xfer_handle(h)
    link.send_value(t0s)


def _fmt(size: int) -> str:
    from .plan import fmt_bytes

    return fmt_bytes(size)


# ====================================================================== Mooncake
MOONCAKE_BATCH = 1024
"""Most entries per ``batch_transfer_sync_write`` call (0.3.13's TCP transport failed a batch of 4,096)."""
MOONCAKE_DISTS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


def mooncake_version() -> str | None:
    """The installed Mooncake transfer engine (``distribution version``), or None when ``import mooncake.engine``
    fails."""
    found = _installed("mooncake.engine", MOONCAKE_DISTS)
    return None if found is None else ("unknown" if found[0] == "unknown" else " ".join(found))


def _mooncake_engine(host: str) -> Any:
    import importlib

    engine: Any = importlib.import_module("mooncake.engine").TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) returned {rc}")
    return engine


def _mooncake_register(engine: Any, buffers: list[Any]) -> None:
    for b in buffers:
        rc = engine.register_memory(_ptr(b), _nbytes(b))
        if rc != 0:
            raise RuntimeError(f"Mooncake register_memory of {_nbytes(b)} bytes returned {rc}")


def merged_runs(src: list[int], dst: list[int], lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Pieces ``(src[i], dst[i], lengths[i])`` with neighbours contiguous on both sides merged: (sources,
    destinations, lengths). Order kept."""
    out_s: list[int] = []
    out_d: list[int] = []
    out_n: list[int] = []
    for a, b, n in zip(src, dst, lengths, strict=True):
        if out_n and out_s[-1] + out_n[-1] == a and out_d[-1] + out_n[-1] == b:
            out_n[-1] += n
        else:
            out_s.append(a)
            out_d.append(b)
            out_n.append(n)
    return out_s, out_d, out_n


def _kv_pieces(cache: Any, blocks: list[int]) -> tuple[list[int], list[int]]:
    """(addresses, lengths) of the pieces a request of ``blocks`` moves: layer by layer, plane by plane, block by
    block."""
    layout = cache.layout
    planes = [p for layer in layout.layers for p in layer.planes]
    return [p.address(b) for p in planes for b in blocks], [p.piece_bytes for p in planes for _ in blocks]


def mooncake_receiver(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    host = cfg["addresses"]["receiver"]
    engine = _mooncake_engine(host)
    session = f"{host}:{engine.get_rpc_port()}"
    rows: list[dict[str, Any]] = []
    k = 0
    for item in cfg["items"]:
        if item["kind"] == "sweep":
            arrays = [alloc(size, "cpu", None) for size in cfg["sizes"]]
            _mooncake_register(engine, arrays)
            link.send_value((session, [_ptr(a) for a in arrays]))
            for i, size in enumerate(cfg["sizes"]):
                set_bytes(arrays[i], 0)
                d = _mooncake_recv_reps(link, [f"msw{i}-{r}" for r in range(1 + cfg["sweep_reps"][i])])
                rows.append(_peer_sweep_row(cfg, k, "mooncake", size, d, arrays[i]))
                k += 1
            for a in arrays:
                engine.unregister_memory(_ptr(a))
        else:
            from .plan import block_ids
            from .roles import shape_cache_spec

            shape = item["shape"]
            cache = make_cache(shape_cache_spec(shape), "cpu", None)
            _mooncake_register(engine, [cache.backing])
            link.send_value((session, None))
            for case in item["cases"]:
                _, dst = block_ids(case["pattern"], shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
                link.send_value(_kv_pieces(cache, dst)[0])
                probe = cache.views["layers.0"][dst[0]]
                set_bytes(probe, 0)
                d = _mooncake_recv_reps(link, [f"mkv{case['index']}-{r}" for r in range(1 + case["reps"])])
                rows.append(_peer_kv_row(cfg, k, "mooncake", shape, case["pattern"], d, probe))
                k += 1
            engine.unregister_memory(_ptr(cache.backing))
            del cache
        link.barrier(f"mooncake-item-end-{item['index']}")
    link.barrier("end")
    return done({"rows": rows})


def _mooncake_recv_reps(link: Any, seqs: list[str]) -> list[float]:
    for seq in seqs:
        link.barrier(seq)
    return [float(x) for x in link.recv_value()][1:]  # the sender's times; the first (connect) left out


def mooncake_sender(link: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    engine = _mooncake_engine(cfg["addresses"]["sender"])
    for item in cfg["items"]:
        if item["kind"] == "sweep":
            arrays = [alloc(size, "cpu", FILL) for size in cfg["sizes"]]
            _mooncake_register(engine, arrays)
            session, remote = link.recv_value()
            for i, size in enumerate(cfg["sizes"]):
                _mooncake_send_reps(link, engine, session, ([_ptr(arrays[i])], [int(remote[i])], [size]),
                                    [f"msw{i}-{r}" for r in range(1 + cfg["sweep_reps"][i])])
            for a in arrays:
                engine.unregister_memory(_ptr(a))
        else:
            from .plan import block_ids
            from .roles import shape_cache_spec

            shape = item["shape"]
            cache = make_cache(shape_cache_spec(shape), "cpu", FILL)
            _mooncake_register(engine, [cache.backing])
            session, _ = link.recv_value()
            for case in item["cases"]:
                src, _dst = block_ids(case["pattern"], shape["request_blocks"], shape["pool_blocks"], cfg["seed"])
                remote = [int(a) for a in link.recv_value()]
                addresses, lengths = _kv_pieces(cache, src)
                runs = merged_runs(addresses, remote, lengths)
                _mooncake_send_reps(link, engine, session, runs,
                                    [f"mkv{case['index']}-{r}" for r in range(1 + case["reps"])])
            engine.unregister_memory(_ptr(cache.backing))
            del cache
        link.barrier(f"mooncake-item-end-{item['index']}")
    link.barrier("end")
    hosts = cfg["addresses"]
    return done({"path": f"mooncake TCP (P2P handshake) {hosts['sender']} -> {hosts['receiver']}"})


def _mooncake_send_reps(link: Any, engine: Any, session: str, runs: tuple[list[int], list[int], list[int]],
                        seqs: list[str]) -> None:
    src, dst, lengths = runs
    times = []
    for seq in seqs:
        link.barrier(seq)
        t0 = now()
        for i in range(0, len(src), MOONCAKE_BATCH):
            j = i + MOONCAKE_BATCH
            rc = engine.batch_transfer_sync_write(session, src[i:j], dst[i:j], lengths[i:j])
            if rc != 0:
                raise RuntimeError(f"Mooncake batch_transfer_sync_write of {len(src[i:j])} pieces for {seq} "
                                   f"returned {rc}")
        times.append(now() - t0)
    link.send_value(times)
