"""Device-side scattered copies into peer-mapped GPU memory: one kernel launch per put.

For backends whose peer KV memory is mapped into this process (CUDA IPC, MSCCL++ CudaIpc): the segments
of a put — every contiguous (source, destination, length) piece of its coalesced runs — go to the GPU as
one table, and one launch copies them all, each CTA one chunk of at most ``CHUNK`` bytes with 16-byte
loads and stores (NVLink stores into the peer GPU). Per-block host calls are what make the usual paths
slow on fragmented KV (4,096 ``cudaMemcpyAsync`` for a 2k-token Llama-8B request); one launch is not.

Layers of one geometry share a segment table per request: the manager hands every layer of a request
the same runs tuple, so :class:`MappedPutter` builds the table once and each put only adds the layer's
base addresses.

Loaded only by backends that need it (imports numpy at module level, CuPy and torch lazily); the core
package never imports this module.

The subpackage: :mod:`.segments` (the (src, dst, len) tables of a put, peer windows, allocation extents),
:mod:`.launch` (the kernel, its launcher with an event ring, and the per-link putter), :mod:`.driver` (the
CUDA driver calls through ctypes). Only GPU backends (ucx's CUDA IPC lane, mscclpp) import it.
"""

from __future__ import annotations

from ..errors import TransferError, TransferTimeout
from .driver import Driver
from .launch import KERNEL, MAX_GRID_Y, PLANS, SLEEP_S, SPIN_S, MappedPutter, Mark, SegmentCopier
from .segments import CHUNK, PeerWindows, allocation_extents, segments, split, uniform

__all__ = ["CHUNK", "KERNEL", "MAX_GRID_Y", "PLANS", "SLEEP_S", "SPIN_S", "Driver", "MappedPutter", "Mark",
           "PeerWindows", "SegmentCopier", "TransferError", "TransferTimeout", "allocation_extents", "segments",
           "split", "uniform"]
