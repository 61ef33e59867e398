"""The conformance suite against the ``ucx`` backend: host memory (CI); CUDA memory over cuda_ipc (GPU host)."""

import pytest

from kvtransport import registry
from kvtransport.testing import gpu_count
from kvtransport.testing.conformance import ConformanceSuite

pytestmark = pytest.mark.skipif(not registry.probe("ucx").ok, reason=f"ucx backend unavailable: {registry.probe('ucx').reason}")


class TestUcxOnHostMemory(ConformanceSuite):
    backend = "ucx"
    device = "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 1, reason="needs a CUDA GPU (two processes share it, or use two with peer access)")
class TestUcxOnCudaMemory(ConformanceSuite):
    backend = "ucx"
    device = "cuda"
