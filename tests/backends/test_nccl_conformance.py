"""The conformance suite against the ``nccl`` backend: gloo on host memory (CI), NCCL on CUDA (GPU host)."""

import pytest

from kvtransport import registry
from kvtransport.testing import gpu_count
from kvtransport.testing.conformance import ConformanceSuite

pytestmark = pytest.mark.skipif(not registry.probe("nccl").ok, reason=f"nccl backend unavailable: {registry.probe('nccl').reason}")


class TestNcclOnHostMemory(ConformanceSuite):
    backend = "nccl"
    device = "cpu"


@pytest.mark.gpu2
@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU); run on the 2xH200 host")
class TestNcclOnCudaMemory(ConformanceSuite):
    backend = "nccl"
    device = "cuda"
