"""The test kit: an in-process reference backend (``inproc``), a two-process harness, vLLM-shaped caches,
the conformance suite every backend adopts, and fault scenarios. Imports numpy/pytest only when used."""

from __future__ import annotations


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
