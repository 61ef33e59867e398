"""The test kit: an in-process reference backend (``inproc``), the conformance suite every backend adopts, and
fault and hostile-peer scenarios. The caches, presets and two-process harness they run on are shared with the
demo and the bench and live in :mod:`kvtransport.workload`. ``import kvtransport.testing`` itself loads
neither numpy nor pytest; its modules that build caches (``conformance``, ``faults``, ``hostile``) need numpy."""

from __future__ import annotations

from typing import Any


def pair_devices(cfg: dict[str, Any]) -> tuple[str, str]:
    """(sender, receiver) devices of a two-process scenario: cpu/cpu, or cuda:0 -> cuda:1 (cuda:0 when only
    one GPU is visible: two processes then share it)."""
    if cfg.get("device", "cpu") == "cpu":
        return "cpu", "cpu"
    return "cuda:0", ("cuda:1" if gpu_count() > 1 else "cuda:0")


def gpu_count() -> int:
    """CUDA devices visible to torch (0 without torch or CUDA); for skip conditions of GPU tests."""
    try:
        import torch
    except Exception:
        return 0
    try:
        return int(torch.cuda.device_count())
    except Exception:
        return 0
