"""Helpers shared by the roles (run in the spawned processes) and the runner: clocks, statistics,
buffers, progress lines.

Timing across the two processes uses ``time.monotonic()``: CLOCK_MONOTONIC is one system-wide clock on
Linux, so a sender's start stamp and the receiver's end stamp compare directly (both roles run on one host).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

FILL = 0x5A
"""Byte the sender's buffers hold; the receiver spot-checks that it arrived."""


def busy() -> dict[str, float | None]:
    """How busy the machine was when a row was taken: 1-minute load average and CPU pressure (PSI
    ``some avg10``: % of the last 10 s in which some runnable task waited for a CPU). None if unknown."""
    try:
        load: float | None = float(os.getloadavg()[0])
    except (AttributeError, OSError):
        load = None
    return {"load1": load, "cpu_psi10": cpu_pressure()}


def cpu_pressure() -> float | None:
    """``/proc/pressure/cpu`` some avg10 in percent, or None where the kernel has no PSI."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.split("avg10=")[1].split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return None


def cpu_idle(seconds: float) -> float | None:
    """Fraction of CPU time idle over the next ``seconds`` (from /proc/stat; None where unavailable)."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]

    try:
        a = snap()
        time.sleep(seconds)
        b = snap()
    except (OSError, ValueError, IndexError):
        return None
    return (b[1] - a[1]) / max(1, b[0] - a[0])


def now() -> float:
    """System-wide monotonic clock, seconds (see module docstring)."""
    return time.monotonic()


def summarize(samples: list[float]) -> dict[str, float]:
    """median / p99 / min / max of positive durations in seconds (p99: nearest rank)."""
    if not samples:
        return {"median_s": float("nan"), "p99_s": float("nan"), "min_s": float("nan"), "max_s": float("nan")}
    xs = sorted(samples)
    k = min(len(xs) - 1, max(0, -(-99 * len(xs) // 100) - 1))
    return {"median_s": statistics.median(xs), "p99_s": xs[k], "min_s": xs[0], "max_s": xs[-1]}


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second), NaN for non-positive times."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def mmss(seconds: float) -> str:
    """``mm:ss`` of a duration (minutes may exceed 59)."""
    seconds = max(0, int(seconds))
    return f"{seconds // 60:02d}:{seconds % 60:02d}"


def eta(t0: float, done: int, total: int) -> str:
    """`` ~mm:ss left``, extrapolated from ``done`` of ``total`` rows since ``t0`` (wall clock); empty before
    the first row, after the last, or without a total. Rows differ in cost: a guide, not a promise."""
    if done <= 0 or total <= 0 or done >= total:
        return ""
    return f" ~{mmss((time.time() - t0) * (total - done) / done)} left"


def progress(cfg: dict[str, Any], index: int, text: str) -> None:
    """One progress line ``[mm:ss k/N ~mm:ss left] text`` on stdout, flushed (works without a TTY)."""
    p = cfg.get("progress") or {}
    if p.get("quiet"):
        return
    t0 = float(p.get("t0", time.time()))
    k = int(p.get("offset", 0)) + index + 1
    total = int(p.get("total", 0))
    count = f"{k:>3}/{total}" if total else f"{k:>3}"
    print(f"[{mmss(time.time() - t0)} {count}{eta(t0, k, total)}] {text}", flush=True, file=sys.stdout)


def alloc(nbytes: int, device: str, fill: int | None) -> Any:
    """A ``(1, nbytes)`` uint8 array: numpy on ``cpu``, torch elsewhere; every page touched (filled)."""
    if device == "cpu":
        import numpy as np

        a = np.empty((1, nbytes), dtype=np.uint8)
        a.fill(0 if fill is None else fill)
        return a
    import torch

    return torch.full((1, nbytes), 0 if fill is None else fill, dtype=torch.uint8, device=device)


def is_filled(view: Any, value: int) -> bool:
    """True if every byte of a numpy/torch view equals ``value``."""
    if hasattr(view, "cpu"):
        t = view.reshape(-1)
        return bool((t.min() == value).item() and (t.max() == value).item())
    return bool(view.min() == value and view.max() == value)


def set_bytes(view: Any, value: int) -> None:
    """Fill a numpy/torch view in place."""
    if hasattr(view, "fill_"):
        view.fill_(value)
    else:
        view[...] = value


def done(result: dict[str, Any]) -> dict[str, Any]:
    """A role's result with this process's peak resident memory added (``peak_rss_bytes``).

    Reads VmHWM (this process image only); ``ru_maxrss`` would include the parent's peak on Linux."""
    peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if peak is None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["peak_rss_bytes"] = peak
    return result


def use_device(device: str) -> None:
    """Make ``device`` the current CUDA device of this process (no-op on CPU)."""
    if device != "cpu":
        torch_module().cuda.set_device(device)


def make_cache(spec: Any, device: str, fill: int | None) -> Any:
    """A preset KV cache (workload.caches) on ``device``, every byte set to ``fill`` (0 if None)."""
    from ..workload.caches import CudaCache, HostCache

    if device == "cpu":
        cache: Any = HostCache(spec)
        cache.backing.fill(0 if fill is None else fill)
    else:
        cache = CudaCache(spec, device)
        cache.backing.fill_(0 if fill is None else fill)
    return cache


def sync(device: str) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device != "cpu":
        torch_module().cuda.synchronize(device)


def torch_module() -> Any:
    """``import torch``, typed as Any (torch's CUDA helpers are untyped for strict mypy)."""
    import torch

    return torch
