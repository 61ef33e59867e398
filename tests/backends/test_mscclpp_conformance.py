"""The conformance suite against the ``mscclpp`` backend: CUDA memory over CudaIpc (GPU host: two processes share
one GPU, or one GPU each with peer access).

Skips with the reason elsewhere (MSCCL++ has no wheel; CI has no GPU)."""

import pytest

from kvtransport import registry
from kvtransport.testing import gpu_count
from kvtransport.testing.conformance import ConformanceSuite

_probe = registry.probe("mscclpp")
_skip = (f"mscclpp backend unavailable: {_probe.reason}" if not _probe.ok
         else "needs a CUDA GPU (two processes share it, or use two with peer access)" if gpu_count() < 1 else "")


@pytest.mark.gpu
@pytest.mark.skipif(bool(_skip), reason=_skip)
class TestMscclppOnCudaMemory(ConformanceSuite):
    backend = "mscclpp"
    device = "cuda"
