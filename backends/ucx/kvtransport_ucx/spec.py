"""Registry entry of the ``ucx`` backend. Imports nothing heavy."""

from __future__ import annotations

from kvtransport.backend import Availability, BackendSpec, Transport
from kvtransport.config import Settings
from kvtransport.layout import KVLayout


class UcxSpec(BackendSpec):
    name = "ucx"
    priority = 20  # measured faster than gloo on host memory (docs/benchmarks.md)
    install_hint = "pip install ./backends/ucx  (pulls the libucx-cu12 wheel; libucx-cu13 on CUDA 13 hosts)"
    memory_kinds = frozenset({"cpu", "cuda"})
    options = ("tls",)

    def probe(self) -> Availability:
        try:
            from . import _ucp
        except Exception as exc:
            return Availability(False, f"kvtransport_ucx failed to import: {exc}")
        if not _ucp.is_available():
            return Availability(False, _ucp.load_error() or "libucp not found")
        major, minor, patch = _ucp.ucx_version()
        return Availability(True, f"UCX {major}.{minor}.{patch} ({_ucp.library_path()})",
                            {"ucx": f"{major}.{minor}.{patch}"})

    def create(self, layout: KVLayout, settings: Settings) -> Transport:
        from .transport import UcxTransport

        return UcxTransport(layout, settings, options=self.options or ())


SPEC = UcxSpec()
