"""The ``mscclpp`` backend without MSCCL++ or a GPU: build detection, transport selection, error mapping,
bootstrap id layout, and how it reports itself on a machine where it cannot run."""

from __future__ import annotations

import importlib
import socket
import struct
import sys
from pathlib import Path

import pytest
from kvtransport_mscclpp import native, routing
from kvtransport_mscclpp.spec import SPEC
from kvtransport_mscclpp.transport import make_unique_id

from kvtransport import available_backends, registry
from kvtransport.doctor import findings
from kvtransport.errors import (
    BackendUnavailable,
    ConfigurationError,
    PeerDisconnected,
    TransferError,
    TransferTimeout,
)


# ---------------------------------------------------------------- transport selection
def test_same_host_peer_uses_cuda_ipc() -> None:
    c = routing.choose(same_host=True, requested=None, ib_devices=[], ib_compiled=False)
    assert c.transport == "CudaIpc" and not c.is_ib


def test_remote_peer_uses_first_rdma_device() -> None:
    c = routing.choose(same_host=False, requested=None, ib_devices=["mlx5_0", "mlx5_1"], ib_compiled=True)
    assert c.transport == "IB0" and "mlx5_0" in c.why


def test_remote_peer_ib_index_and_explicit_request() -> None:
    assert routing.choose(same_host=False, requested=None, ib_devices=["a", "b"], ib_compiled=True,
                          ib_index=1).transport == "IB1"
    assert routing.choose(same_host=True, requested="IB1", ib_devices=["a", "b"], ib_compiled=True).transport == "IB1"


def test_remote_peer_without_rdma_device_says_what_to_do() -> None:
    with pytest.raises(BackendUnavailable, match=r"IB0 needs RDMA device #0, this host has 0 \(none\).*ucx"):
        routing.choose(same_host=False, requested=None, ib_devices=[], ib_compiled=True)


def test_ib_off_build_is_refused_before_it_can_crash() -> None:
    with pytest.raises(BackendUnavailable, match="MSCCLPP_USE_IB=OFF"):
        routing.choose(same_host=False, requested=None, ib_devices=["mlx5_0"], ib_compiled=False)


def test_cuda_ipc_to_another_host_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="only works inside one host"):
        routing.choose(same_host=False, requested="CudaIpc", ib_devices=["mlx5_0"], ib_compiled=True)


@pytest.mark.parametrize(("value", "expected"), [
    (None, None), ("auto", None), ("cudaipc", "CudaIpc"), ("NVLink", "CudaIpc"), ("ib", "IB0"), ("ib7", "IB7"),
])
def test_transport_option(value: str | None, expected: str | None) -> None:
    assert routing.parse_request(value) == expected


@pytest.mark.parametrize("value", ["ib8", "tcp", "ethernet", "ibx"])
def test_bad_transport_option(value: str) -> None:
    with pytest.raises(ConfigurationError, match="auto, cudaipc, ib"):
        routing.parse_request(value)


def test_hca_devices_env_orders_ib_transports(tmp_path: Path) -> None:
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert native.ib_devices({}, str(tmp_path)) == ["mlx5_0", "mlx5_1"]
    assert native.ib_devices({"MSCCLPP_HCA_DEVICES": "mlx5_1, mlx5_0"}, str(tmp_path)) == ["mlx5_1", "mlx5_0"]
    assert native.ib_devices({}, str(tmp_path / "absent")) == []


# ---------------------------------------------------------------- error mapping
class Error(Exception):
    """Stands in for mscclpp._mscclpp.Error: args are (error code, message)."""


class IbError(Exception):
    pass


@pytest.mark.parametrize(("exc", "kind", "words"), [
    (Error(3, "MSCCLPP ERROR NET ib.cc:685 IB transport out of range: 0 >= 0 (mscclpp failure: InvalidUsage)"),
     BackendUnavailable, "fewer RDMA devices"),
    (IbError(1, "Ib failure: Cannot allocate memory"), BackendUnavailable, "ulimit -l unlimited"),
    (Error(1, "NET/Socket : No interface named eth9 found."), ConfigurationError, "NET_IFNAME"),
    (Error(4, "TcpBootstrap connection timeout"), TransferTimeout, "did not join"),
    (Error(4, "something slow"), TransferTimeout, "timed out"),
    (Error(0, "connect: Connection refused"), PeerDisconnected, "not listening"),
    (RuntimeError("weird"), TransferError, "weird"),
])
def test_errors_become_typed_with_a_remedy(exc: Exception, kind: type, words: str) -> None:
    err = native.translate(exc, "connect")
    assert type(err) is kind
    assert words in str(err)


def test_cuda_error_codes_are_not_read_as_mscclpp_error_codes() -> None:
    class CuError(Exception):
        pass

    assert type(native.translate(CuError(4, "Cu failure: deinitialized"), "put")) is TransferError


# ---------------------------------------------------------------- build detection
def _fake_build(root: Path, blob: bytes) -> None:
    lib = root / "mscclpp" / "lib"
    lib.mkdir(parents=True)
    (root / "mscclpp" / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (lib / "libmscclpp.so.0").write_bytes(blob)


@pytest.fixture
def fake_mscclpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def make(blob: bytes) -> native.BuildInfo:
        _fake_build(tmp_path, blob)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        native.build_info.cache_clear()
        return native.build_info()

    yield make
    native.build_info.cache_clear()
    sys.modules.pop("mscclpp", None)


def test_detects_ib_build_and_dynamic_libstdcxx(fake_mscclpp) -> None:  # type: ignore[no-untyped-def]
    info = fake_mscclpp(b"\x7fELF...libstdc++.so.6...IB transport out of range...")
    assert info.installed and info.ib_compiled and not info.static_libstdcxx
    assert native.unusable_reason(info, {}) is None
    assert "IB compiled in" in info.summary()


def test_static_libstdcxx_build_is_refused_with_the_fix(fake_mscclpp) -> None:  # type: ignore[no-untyped-def]
    info = fake_mscclpp(b"\x7fELF...no dynamic c++ runtime here...")
    assert info.static_libstdcxx and not info.ib_compiled
    reason = native.unusable_reason(info, {})
    assert reason and "CXX=/usr/bin/g++" in reason and "LD_PRELOAD" in reason
    assert native.unusable_reason(info, {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libstdc++.so.6"}) is None


def test_missing_build_names_the_build_doc() -> None:
    reason = native.unusable_reason(native.BuildInfo(installed=False), {})
    assert reason and "no wheel" in reason and "README" in reason


# ---------------------------------------------------------------- bootstrap id
def test_unique_id_layout_matches_tcp_bootstrap() -> None:
    # the id MSCCL++'s own create_unique_id produced on the GPU host: magic, AF_INET, port 60011, 192.0.2.2
    observed = bytes.fromhex("f7fb1248a56e343d0200ea6bc0000202" + "00" * 112)
    magic = struct.unpack("<Q", observed[:8])[0]
    assert make_unique_id("192.0.2.2", 60011, magic) == observed
    assert len(make_unique_id("127.0.0.1", 1234)) == 128


def test_unique_id_needs_ipv4() -> None:
    with pytest.raises(ConfigurationError, match="IPv4"):
        make_unique_id("::1", 1234)


# ---------------------------------------------------------------- on a machine where it cannot run
@pytest.mark.skipif(registry.probe("mscclpp").ok, reason="MSCCL++ is usable here")
def test_listed_as_unavailable_with_the_reason() -> None:
    rows = {r.name: r for r in available_backends()}
    assert "mscclpp" in rows and not rows["mscclpp"].available
    assert rows["mscclpp"].reason  # e.g. not installed (no wheel exists) / no CUDA device
    assert "mscclpp" in registry.KNOWN_BACKENDS


def test_doctor_reports_mscclpp() -> None:
    text = "\n".join(str(f) for f in findings())
    assert "mscclpp" in text


def test_free_port_is_bindable() -> None:
    from kvtransport_mscclpp.transport import free_port

    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_open_with_ib_requested_reports_the_missing_rdma_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtransport_mscclpp.transport import MscclppTransport

    from kvtransport.config import resolve
    from kvtransport.workload.caches import CacheSpec, make_cache

    monkeypatch.setattr(native, "ib_devices", lambda *a, **k: [])
    monkeypatch.setattr(native, "build_info", lambda: native.BuildInfo(installed=True, library="x", ib_compiled=True))
    layout = make_cache(CacheSpec(num_layers=2, num_blocks=4, heads=1, block_size=4, head_dim=8), "cpu").layout
    with pytest.raises(BackendUnavailable, match=r"IB0 needs RDMA device #0, this host has 0"):
        MscclppTransport(layout, resolve("mscclpp", transport="ib"), options=SPEC.options)
    with pytest.raises(ConfigurationError, match="transport='tcp'"):
        MscclppTransport(layout, resolve("mscclpp", transport="tcp"), options=SPEC.options)


@pytest.mark.parametrize("static", [False, True])
def test_reads_how_a_real_shared_object_links_libstdcxx(fake_mscclpp, tmp_path: Path, static: bool) -> None:  # type: ignore[no-untyped-def]
    """Real ELF files, built here with the system g++: the DT_NEEDED entries decide, not a byte search."""
    import shutil
    import subprocess

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++ to build a test shared object")
    src = tmp_path / "x.cc"
    src.write_text('#include <string>\nextern "C" int f(int n) { return int(std::to_string(n).size()); }\n')
    out = tmp_path / "libx.so"
    cmd = [gxx, "-shared", "-fPIC", "-O1", str(src), "-o", str(out)] + (["-static-libstdc++"] if static else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    needed = native.elf_needed(out.read_bytes())
    assert needed is not None and ("libstdc++.so.6" in needed) is (not static)
    info = fake_mscclpp(out.read_bytes())
    assert info.static_libstdcxx is static
