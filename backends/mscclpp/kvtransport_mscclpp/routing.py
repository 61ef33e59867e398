"""Which MSCCL++ transport links us to a peer. Pure functions (unit-tested without MSCCL++ or a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtransport.errors import BackendUnavailable, ConfigurationError

CUDA_IPC = "CudaIpc"
MAX_IB = 8


@dataclass(frozen=True)
class Choice:
    """A transport (``"CudaIpc"`` or ``"IB0"``..``"IB7"``) and why it was picked, for logs and stats."""

    transport: str
    why: str

    @property
    def is_ib(self) -> bool:
        return self.transport.startswith("IB")


def parse_request(value: str | None) -> str | None:
    """The ``transport`` backend option: ``auto``/None, ``cudaipc``, ``ib`` (first device) or ``ibN``."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    v = value.strip().lower()
    if v in ("cudaipc", "cuda_ipc", "ipc", "nvlink"):
        return CUDA_IPC
    if v == "ib":
        return "IB0"
    if v.startswith("ib") and v[2:].isdigit() and int(v[2:]) < MAX_IB:
        return f"IB{int(v[2:])}"
    raise ConfigurationError(
        f"mscclpp option transport={value!r} is not one of auto, cudaipc, ib, ib0..ib{MAX_IB - 1}"
    )


def choose(
    *,
    same_host: bool,
    requested: str | None,
    ib_devices: list[str],
    ib_compiled: bool,
    ib_index: int = 0,
) -> Choice:
    """Pick the transport for one peer, or raise a typed error that says what to do.

    ``auto``: CudaIpc for a peer on this host (NVLink/PCIe peer access), else the ``ib_index``-th RDMA
    device. An explicit request is honoured if it can work here."""
    if requested == CUDA_IPC and not same_host:
        raise ConfigurationError(
            "mscclpp transport=cudaipc, but the peer is on another host: CUDA IPC only works inside one host "
            "(use transport=auto or ib)"
        )
    if requested == CUDA_IPC or (requested is None and same_host):
        return Choice(CUDA_IPC, "peer on this host: CUDA IPC (NVLink/PCIe peer access)")
    ib = requested or f"IB{ib_index}"
    index = int(ib[2:])
    where = "" if same_host else "peer on another host: "
    if not ib_compiled:
        raise BackendUnavailable(
            f"mscclpp: {where}{ib} needs InfiniBand, but this MSCCL++ was built with MSCCLPP_USE_IB=OFF "
            "(an IB-off build crashes on IB transports): rebuild with -DMSCCLPP_USE_IB=ON (needs libibverbs-dev)"
        )
    if index >= len(ib_devices):
        have = ", ".join(ib_devices) or "none"
        raise BackendUnavailable(
            f"mscclpp: {where}{ib} needs RDMA device #{index}, this host has {len(ib_devices)} ({have}): "
            "install/enable an IB or RoCE NIC, pick another with transport=ibN or MSCCLPP_HCA_DEVICES, "
            "or use the ucx backend for TCP between hosts"
        )
    return Choice(ib, f"{where}RDMA over {ib_devices[index]} ({ib})")
