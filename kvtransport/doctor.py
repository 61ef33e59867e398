"""``kvtransport doctor``: preflight checks, each finding printed with its fix. Exit 1 if a check failed."""

from __future__ import annotations

import argparse
import os
import resource

from .backend import Finding

__all__ = ["Finding", "findings", "run", "summary"]


LEVELS = ("ok", "info", "warn", "fail")
"""Finding levels: ``info`` is a fact that needs no action here (e.g. no RDMA device, so memlock is moot)."""


def findings(backend: str | None = None, ifname: str | None = None) -> list[Finding]:
    """Every check, in order. Warnings only where they apply: RDMA and memlock checks only on a machine with an
    RDMA device, a backend that cannot run here only when it could move this machine's memory."""
    from . import available_backends, registry
    from .config import interface_address, list_interfaces
    from .errors import InterfaceNotFound

    cuda = _cuda_findings()
    kinds = {"cpu"} | ({"cuda"} if any(f.check == "CUDA" and f.level == "ok" for f in cuda) else set())
    specs = registry.specs()
    rows = available_backends()
    out: list[Finding] = []
    for row in rows:
        spec = specs.get(row.name)
        relevant = spec is not None and bool(kinds & set(spec.memory_kinds))
        if row.available:
            out.append(Finding("ok", f"backend {row.name}", row.reason))
        elif row.installed:
            out.append(Finding("warn" if relevant else "info", f"backend {row.name}", row.reason
                               + ("" if relevant else f" (it moves {'/'.join(sorted(spec.memory_kinds)) if spec else '?'} "
                                  "memory, which this machine lacks)"), row.install_hint if relevant else ""))
        else:
            out.append(Finding("info", f"backend {row.name}", "not installed (optional)", row.install_hint))
    if not any(r.available for r in rows):
        out.append(Finding("fail", "backends", "no backend can run here", "pip install ./backends/ucx (host memory)"))
    out.extend(_backend_findings())
    wanted = backend or os.environ.get("KV_TRANSPORT")
    if wanted and wanted != "auto":
        by_name = {r.name: r for r in rows}
        if wanted not in by_name or not by_name[wanted].available:
            out.append(Finding("fail", "KV_TRANSPORT", f"{wanted!r} is not usable here",
                               by_name[wanted].install_hint if wanted in by_name else f"choose one of {sorted(by_name)}"))
    iface = ifname or os.environ.get("NET_IFNAME")
    ifaces = list_interfaces()
    listing = ", ".join(f"{n}={a or '-'}" for n, a in sorted(ifaces.items()))
    if iface:
        try:
            out.append(Finding("ok", "NET_IFNAME", f"{iface} -> {interface_address(iface)}"))
        except InterfaceNotFound as exc:
            out.append(Finding("fail", "NET_IFNAME", str(exc), exc.fix))
    else:
        out.append(Finding("info", "NET_IFNAME", f"unset: side channels use loopback (peers on this host only); "
                           f"interfaces: {listing}", "set NET_IFNAME=<interface> for peers on other hosts"))
    out.extend(_rdma_findings())
    out.extend(cuda)
    return out


def _rdma_findings(sysfs: str = "/sys/class/infiniband") -> list[Finding]:
    """RDMA devices and, only where there is one, the memlock limit that RDMA registration needs."""
    devs = sorted(os.listdir(sysfs)) if os.path.isdir(sysfs) else []
    if not devs:
        return [Finding("info", "RDMA", "no InfiniBand/RoCE device: inter-host traffic uses TCP "
                        "(memlock limit not checked: only RDMA registration needs it)")]
    out = [Finding("ok", "InfiniBand/RoCE devices", ", ".join(devs))]
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < (1 << 30):
        out.append(Finding("warn", "memlock", f"ulimit -l is {soft >> 10} KiB: RDMA registration of a KV cache will fail "
                           "('Cannot allocate memory')", "ulimit -l unlimited (containers: --ulimit memlock=-1)"))
    else:
        out.append(Finding("ok", "memlock", "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"))
    return out


def summary(results: list[Finding]) -> str:
    """``N checks: a ok, b warnings, c failed, d notes`` (every finding counted once, by level)."""
    count = {level: sum(1 for f in results if f.level == level) for level in LEVELS}
    return (f"{len(results)} checks: {count['ok']} ok, {count['warn']} warning{'s' * (count['warn'] != 1)}, "
            f"{count['fail']} failed, {count['info']} note{'s' * (count['info'] != 1)}")


def _backend_findings() -> list[Finding]:
    """Each installed backend's own checks (richest for mscclpp: build, IB, bootstrap)."""
    from . import registry

    out: list[Finding] = []
    for name, spec in sorted(registry.specs().items()):
        try:
            out.extend(spec.doctor())
        except Exception as exc:  # a broken plugin must not stop the doctor
            out.append(Finding("warn", f"backend {name}", f"its checks failed: {type(exc).__name__}: {exc}"))
    return out


def _cuda_findings() -> list[Finding]:
    try:
        import torch
    except Exception:
        return [Finding("info", "CUDA", "torch not importable; GPU checks skipped")]
    if not torch.cuda.is_available():
        return [Finding("info", "CUDA", "no CUDA device visible: host-memory transfers only")]
    n = torch.cuda.device_count()
    out = [Finding("ok", "CUDA", f"{n} device(s): " + ", ".join(torch.cuda.get_device_name(i) for i in range(n)))]
    for i in range(n):
        for j in range(n):
            if i != j and not torch.cuda.can_device_access_peer(i, j):
                out.append(Finding("warn", "peer access", f"GPU{i} cannot access GPU{j} directly",
                                   "transfers between them go through host memory or NCCL's fallback"))
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "cudaMallocAsync" in conf:
        out.append(Finding("warn", "allocator", "PYTORCH_CUDA_ALLOC_CONF uses cudaMallocAsync; CUDA IPC of KV memory "
                           "needs cudaMalloc-backed memory", "unset backend:cudaMallocAsync"))
    return out


def run(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtransport doctor", description=__doc__)
    ap.add_argument("--backend", default=None, help="the backend you mean to use (default: KV_TRANSPORT)")
    ap.add_argument("--ifname", default=None, help="the interface you mean to use (default: NET_IFNAME)")
    args = ap.parse_args(argv)
    results = findings(args.backend, args.ifname)
    for f in results:
        print(f)
    print(summary(results))
    return 1 if any(f.level == "fail" for f in results) else 0
