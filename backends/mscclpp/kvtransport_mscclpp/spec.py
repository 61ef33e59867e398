"""Registry entry of the ``mscclpp`` backend. Imports nothing heavy (MSCCL++ is inspected, not imported)."""

from __future__ import annotations

import importlib.util
import os
import socket

from kvtransport.backend import Availability, BackendSpec, Finding, Transport
from kvtransport.config import Settings
from kvtransport.layout import KVLayout

from . import native


class MscclppSpec(BackendSpec):
    name = "mscclpp"
    priority = 30  # CUDA only: one copy kernel per put over CudaIpc, like ucx's IPC path, plus IB between hosts
    install_hint = ("build MSCCL++ from upstream source (no wheel exists), then pip install ./backends/mscclpp; "
                    "see backends/mscclpp/README.md")
    memory_kinds = frozenset({"cuda"})
    options = ("transport", "ib_index")

    def probe(self) -> Availability:
        info = native.build_info()
        reason = native.unusable_reason(info)
        if reason:
            return Availability(False, reason, {"build": info.summary()})
        try:
            import torch

            if not torch.cuda.is_available():
                return Availability(False, f"{info.summary()}; but no CUDA device is visible (mscclpp moves GPU memory)")
        except Exception as exc:
            return Availability(False, f"{info.summary()}; torch with CUDA is needed: {exc}")
        if importlib.util.find_spec("cupy") is None:
            return Availability(False, f"{info.summary()}; CuPy is missing (MSCCL++'s Python package needs it)")
        return Availability(True, info.summary(), {"version": info.version, "ib_compiled": info.ib_compiled})

    def doctor(self) -> list[Finding]:
        info = native.build_info()
        out: list[Finding] = []
        reason = native.unusable_reason(info)
        if not info.installed:
            return []  # the generic backend row already says so, with the install hint
        out.append(Finding("fail" if reason else "ok", "mscclpp build", reason or info.summary(),
                           "" if not reason else "see backends/mscclpp/README.md"))
        devices = native.ib_devices()
        if info.ib_compiled:
            out.append(Finding("ok" if devices else "warn", "mscclpp InfiniBand",
                               f"RDMA devices for IB0..: {', '.join(devices)}" if devices else
                               "IB compiled in, but no RDMA device here: peers on other hosts are unreachable; "
                               "peers on this host use CudaIpc",
                               "" if devices else "for inter-host transfers install/enable an IB or RoCE NIC "
                               "(check `ibv_devices`), or use ucx (TCP) between hosts"))
        else:
            out.append(Finding("warn", "mscclpp InfiniBand", "built with MSCCLPP_USE_IB=OFF: CudaIpc only",
                               "rebuild with -DMSCCLPP_USE_IB=ON (needs libibverbs-dev) for peers on other hosts"))
        net, sock_if = os.environ.get("NET_IFNAME"), os.environ.get("MSCCLPP_SOCKET_IFNAME")
        if net and sock_if != net:
            out.append(Finding("warn", "mscclpp bootstrap interface",
                               f"NET_IFNAME={net} but MSCCLPP_SOCKET_IFNAME={sock_if or 'unset'}: the sending rank of "
                               "a link listens on the interface MSCCL++ picks itself",
                               f"export MSCCLPP_SOCKET_IFNAME={net}"))
        if importlib.util.find_spec("cupy") is None:
            out.append(Finding("fail", "mscclpp CuPy", "CuPy is not installed (needed by MSCCL++ and the copy kernel)",
                               "pip install cupy-cuda12x (or cupy-cuda13x on CUDA 13)"))
        address = "127.0.0.1"
        if net:
            try:
                from kvtransport.config import interface_address

                address = interface_address(net)
            except Exception:
                address = ""
        if address:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((address, 0))
                out.append(Finding("ok", "mscclpp bootstrap port", f"can listen on {address} (bootstrap root)"))
            except OSError as exc:
                out.append(Finding("fail", "mscclpp bootstrap port", f"cannot listen on {address}: {exc}",
                                   "check NET_IFNAME, firewalls and ip_local_port_range"))
        return out

    def create(self, layout: KVLayout, settings: Settings) -> Transport:
        from .transport import MscclppTransport

        return MscclppTransport(layout, settings, options=self.options or ())


SPEC = MscclppSpec()
