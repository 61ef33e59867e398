"""kvtransport UCX backend pieces.  See :mod:`kvtransport_ucx._ucp` for the UCP RMA binding."""

from ._ucp import (
    VERIFIED_VERSIONS,
    UcpContext,
    UcpEndpoint,
    UcpError,
    UcpMemory,
    UcpRkey,
    UcpUnavailableError,
    UcpWorker,
    batch_impl,
    is_available,
    library_path,
    load_error,
    ucx_version,
)

__all__ = [
    "VERIFIED_VERSIONS",
    "UcpContext",
    "UcpEndpoint",
    "UcpError",
    "UcpMemory",
    "UcpRkey",
    "UcpUnavailableError",
    "UcpWorker",
    "batch_impl",
    "is_available",
    "library_path",
    "load_error",
    "ucx_version",
]
