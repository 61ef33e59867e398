"""The conformance suite against the ``mscclpp`` backend: CUDA memory over CudaIpc (two GPUs, GPU host).

Skips with the reason elsewhere (MSCCL++ has no wheel; CI has no GPU)."""

import pytest

from kvtransport import registry
from kvtransport.testing import gpu_count
from kvtransport.testing.conformance import ConformanceSuite

_probe = registry.probe("mscclpp")
_skip = (f"mscclpp backend unavailable: {_probe.reason}" if not _probe.ok
         else "needs two CUDA GPUs with peer access (CudaIpc between processes)" if gpu_count() < 2 else "")


@pytest.mark.gpu2
@pytest.mark.skipif(bool(_skip), reason=_skip)
class TestMscclppOnCudaMemory(ConformanceSuite):
    backend = "mscclpp"
    device = "cuda"
