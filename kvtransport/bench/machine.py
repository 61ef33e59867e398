"""The machine description that goes into the JSON (and the doc): what the numbers were measured on."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

from .plan import meminfo


def describe(device: str) -> dict[str, Any]:
    """CPU, memory, OS, Python/torch/numpy/kvtransport versions, GPUs, date (UTC). Never raises."""
    import kvtransport

    mem = meminfo()
    out: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": _cpu_model(),
        "mem_total_bytes": mem.get("MemTotal"),
        "mem_available_bytes": mem.get("MemAvailable"),
        "os": platform.platform(),
        "python": platform.python_version(),
        "kvtransport": kvtransport.__version__,
        "device": device,
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import numpy

        out["numpy"] = numpy.__version__
    except Exception:
        out["numpy"] = None
    try:
        from .common import torch_module

        torch = torch_module()
        out["torch"] = torch.__version__
        out["torch_threads"] = torch.get_num_threads()
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            out["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
            out["gpu_memory_bytes"] = [torch.cuda.get_device_properties(i).total_memory for i in range(n)]
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
            out["peer_access"] = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j)
                                  for i in range(n) for j in range(n) if i != j}
        else:
            out["gpus"] = []
    except Exception as exc:
        out["torch"] = f"not importable: {exc}"
        out["gpus"] = []
    return out


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def summary_line(m: dict[str, Any]) -> str:
    """One human line: cpus, memory, GPUs, versions."""
    gib = (m.get("mem_total_bytes") or 0) / (1 << 30)
    gpus = ", ".join(m.get("gpus") or []) or "no GPU"
    load = m.get("loadavg")
    tail = f"; load average {load[0]:.1f}" if load else ""
    return (f"{m.get('cpu_count')} CPUs ({m.get('cpu_model')}), {gib:.0f} GiB, {gpus}; "
            f"Python {m.get('python')}, torch {m.get('torch')}, kvtransport {m.get('kvtransport')}{tail}")
