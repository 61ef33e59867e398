"""``kvtransport doctor``: preflight checks, each finding printed with its fix. Exit 1 if a check failed."""

from __future__ import annotations

import argparse
import os
import resource

from .backend import Finding

__all__ = ["Finding", "findings", "run"]


def findings(backend: str | None = None, ifname: str | None = None) -> list[Finding]:
    from . import available_backends
    from .config import interface_address, list_interfaces
    from .errors import InterfaceNotFound

    out: list[Finding] = []
    for row in available_backends():
        if row.available:
            out.append(Finding("ok", f"backend {row.name}", row.reason))
        elif row.installed:
            out.append(Finding("warn", f"backend {row.name}", row.reason, row.install_hint))
        else:
            out.append(Finding("warn", f"backend {row.name}", "not installed", row.install_hint))
    out.extend(_backend_findings())
    wanted = backend or os.environ.get("KV_TRANSPORT")
    if wanted and wanted != "auto":
        rows = {r.name: r for r in available_backends()}
        if wanted not in rows or not rows[wanted].available:
            out.append(Finding("fail", "KV_TRANSPORT", f"{wanted!r} is not usable here",
                               rows[wanted].install_hint if wanted in rows else f"choose one of {sorted(rows)}"))
    iface = ifname or os.environ.get("NET_IFNAME")
    ifaces = list_interfaces()
    listing = ", ".join(f"{n}={a or '-'}" for n, a in sorted(ifaces.items()))
    if iface:
        try:
            out.append(Finding("ok", "NET_IFNAME", f"{iface} -> {interface_address(iface)}"))
        except InterfaceNotFound as exc:
            out.append(Finding("fail", "NET_IFNAME", str(exc), "set NET_IFNAME to one of the interfaces listed"))
    else:
        out.append(Finding("warn", "NET_IFNAME", f"unset: side channels use loopback (peers on this host only); "
                           f"interfaces: {listing}", "set NET_IFNAME=<interface> for peers on other hosts"))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and soft < (1 << 30):
        out.append(Finding("warn", "memlock", f"ulimit -l is {soft >> 10} KiB: RDMA registration of a KV cache will fail "
                           "('Cannot allocate memory')", "ulimit -l unlimited (containers: --ulimit memlock=-1)"))
    else:
        out.append(Finding("ok", "memlock", "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"))
    ib = "/sys/class/infiniband"
    devs = sorted(os.listdir(ib)) if os.path.isdir(ib) else []
    out.append(Finding("ok" if devs else "warn", "InfiniBand/RoCE devices", ", ".join(devs) or "none found",
                       "" if devs else "RDMA paths are unavailable; inter-host traffic will use TCP"))
    out.extend(_cuda_findings())
    return out


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
        return [Finding("warn", "CUDA", "torch not importable; GPU checks skipped")]
    if not torch.cuda.is_available():
        return [Finding("warn", "CUDA", "no CUDA device visible: host-memory transfers only")]
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
    ap.add_argument("--backend", default=None)
    ap.add_argument("--ifname", default=None)
    args = ap.parse_args(argv)
    results = findings(args.backend, args.ifname)
    for f in results:
        print(f)
    failed = [f for f in results if f.level == "fail"]
    print(f"{len(results)} checks, {len(failed)} failed")
    return 1 if failed else 0
