"""Registry entry of the ``nccl`` backend (torch.distributed). Imports nothing heavy."""

from __future__ import annotations

from collections.abc import Callable

from kvtransport.backend import Availability, BackendSpec, Transport
from kvtransport.config import Settings
from kvtransport.layout import KVLayout


class TorchDistributedSpec(BackendSpec):
    name = "nccl"
    priority = 10
    install_hint = "pip install ./backends/nccl (needs torch)"
    memory_kinds = frozenset({"cpu", "cuda"})
    options = ("strategy",)

    def probe(self) -> Availability:
        try:
            import torch
            import torch.distributed as dist
        except Exception as exc:
            return Availability(False, f"torch is not importable ({exc}); pip install torch")
        if not dist.is_available():
            return Availability(False, "this torch build has no torch.distributed")
        kinds = []
        if dist.is_gloo_available():
            kinds.append("host memory via gloo")
        if dist.is_nccl_available() and torch.cuda.is_available():
            nccl_version: Callable[[], tuple[int, ...]] = torch.cuda.nccl.version  # untyped in torch
            kinds.append(f"CUDA memory via NCCL {'.'.join(map(str, nccl_version()))}")
        if not kinds:
            return Availability(False, "neither gloo nor NCCL is available in this torch build")
        return Availability(True, "; ".join(kinds), {"torch": torch.__version__})

    def create(self, layout: KVLayout, settings: Settings) -> Transport:
        from .transport import TorchTransport

        return TorchTransport(layout, settings)


SPEC = TorchDistributedSpec()
