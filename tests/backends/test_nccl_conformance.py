"""The conformance suite against the ``nccl`` backend: gloo on host memory (CI), NCCL on CUDA (GPU host)."""

import pytest

import kvtransport as kt
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


def test_interface_knobs_are_process_wide_and_never_silently_mixed(monkeypatch, caplog):
    """NET_IFNAME -> NCCL_/GLOO_SOCKET_IFNAME at open(): set when absent, a user's value kept (logged), and a
    second manager asking for another interface than the one this process already set is refused."""
    import os
    import types

    pytest.importorskip("torch")
    from kvtransport_nccl import transport

    keys = list(transport.KNOBS)
    saved = {k: os.environ.get(k) for k in keys}
    monkeypatch.setattr(transport, "_knobs_set", {})
    try:
        for k in keys:
            os.environ.pop(k, None)
        transport._apply_interface_knobs(types.SimpleNamespace(ifname="lo"))
        assert all(os.environ[k] == "lo" for k in keys)
        transport._apply_interface_knobs(types.SimpleNamespace(ifname="lo"))  # same interface: fine
        with pytest.raises(kt.ConfigurationError, match="one interface per process"):
            transport._apply_interface_knobs(types.SimpleNamespace(ifname="eth0"))
        monkeypatch.setattr(transport, "_knobs_set", {})
        for k in keys:
            os.environ[k] = "ib0"  # the user's own setting
        with caplog.at_level("WARNING", logger="kvtransport.nccl"):
            transport._apply_interface_knobs(types.SimpleNamespace(ifname="eth0"))
        assert all(os.environ[k] == "ib0" for k in keys) and "is kept" in caplog.text
        transport._apply_interface_knobs(types.SimpleNamespace(ifname=None))  # no NET_IFNAME: nothing to do
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
