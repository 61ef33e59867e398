"""The tables of a put for a device copy: every contiguous (source, destination, length) piece of its coalesced
runs, split into chunks; the peer's registered windows (remote to local addresses); allocation extents."""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence

import numpy as np

from ..coalesce import BlockRun
from ..errors import TransferError
from ..layout import KVLayout, LayerRegion
from . import driver as _driver

CHUNK = 64 << 10
"""Largest piece one CTA copies; longer segments are split so a big contiguous put fills the GPU."""


def segments(local: LayerRegion, remote: LayerRegion, runs: Sequence[BlockRun]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised (src, dst, len) uint64 arrays of every contiguous copy of a put (see layout.iter_segments)."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    srcs, dsts, lens = [], [], []
    for lp, rp in zip(local.planes, remote.planes, strict=True):
        size = lp.piece_bytes
        if lp.block_stride == size and rp.block_stride == size:
            srcs.append(lp.base + r[:, 0] * size)
            dsts.append(rp.base + r[:, 1] * size)
            lens.append(r[:, 2] * size)
        else:
            counts = r[:, 2]
            offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
            srcs.append(lp.base + (np.repeat(r[:, 0], counts) + offs) * lp.block_stride)
            dsts.append(rp.base + (np.repeat(r[:, 1], counts) + offs) * rp.block_stride)
            lens.append(np.full(len(offs), size, dtype=np.int64))
    return (np.concatenate(srcs).astype(np.uint64), np.concatenate(dsts).astype(np.uint64),
            np.concatenate(lens).astype(np.uint64))


def uniform(layout: KVLayout) -> bool:
    """All layers have the same planes relative to their first plane (true for vLLM caches)."""
    def shape(layer: LayerRegion) -> list[tuple[int, int, int]]:
        b0 = layer.planes[0].base
        return [(p.base - b0, p.block_stride, p.piece_bytes) for p in layer.planes]

    first = shape(layout.layers[0])
    return all(shape(layer) == first for layer in layout.layers[1:])


def split(src: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split segments longer than CHUNK into CHUNK-sized pieces (vectorised)."""
    if not (lens > CHUNK).any():
        return src, dst, lens
    pieces = ((lens + CHUNK - 1) // CHUNK).astype(np.int64)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    k = (np.arange(int(pieces.sum())) - first).astype(np.uint64)
    off = k * np.uint64(CHUNK)
    rep_src, rep_dst, rep_len = np.repeat(src, pieces), np.repeat(dst, pieces), np.repeat(lens, pieces)
    return rep_src + off, rep_dst + off, np.minimum(rep_len - off, np.uint64(CHUNK))


class PeerWindows:
    """The peer's KV extents as mapped into this process: translates peer addresses to local pointers.

    ``rows`` are (peer start address, length, local mapped pointer of that start)."""

    def __init__(self, rows: Sequence[tuple[int, int, int]]) -> None:
        ordered = sorted((int(a), int(a) + int(n), int(p)) for a, n, p in rows)
        self._rows = ordered
        self._starts = [r[0] for r in ordered]
        self.starts = np.array([r[0] for r in ordered], dtype=np.uint64)
        self.ends = np.array([r[1] for r in ordered], dtype=np.uint64)
        self.local = np.array([r[2] for r in ordered], dtype=np.uint64)

    def translate_range(self, remote: int, nbytes: int) -> int:
        """Local pointer for the peer range ``[remote, remote + nbytes)``; it must lie in one extent."""
        local, room = self.locate(remote)
        if nbytes > room:
            raise TransferError("a put targets memory outside the peer's registered KV cache")
        return local

    def locate(self, remote: int) -> tuple[int, int]:
        """(local pointer of peer address ``remote``, bytes its extent holds from there on); TransferError
        when no extent holds it."""
        i = bisect.bisect_right(self._starts, remote) - 1
        if i < 0 or remote >= self._rows[i][1]:
            raise TransferError("a put targets memory outside the peer's registered KV cache")
        start, end, local = self._rows[i]
        return local + (remote - start), end - remote

    def translate(self, remote: np.ndarray, lens: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.starts, remote, side="right") - 1
        if (idx < 0).any() or ((remote + lens) > self.ends[np.maximum(idx, 0)]).any():
            raise TransferError("a put targets memory outside the peer's registered KV cache")
        return self.local[idx] + (remote - self.starts[idx])


def allocation_extents(extents: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``extents`` cut at CUDA allocation boundaries (needs the device's context current, e.g. after
    ``torch.cuda.set_device``). A layout's extents merge regions that are adjacent in the address space,
    and the caching allocator hands out separate ``cudaMalloc`` blocks back to back; CUDA IPC maps and
    RDMA registers one allocation at a time, so mapping a merged extent maps only its first allocation
    (writes past it fault on the peer)."""
    drv = _driver._Driver()
    out: list[tuple[int, int]] = []
    for start, length in extents:
        pos, end = start, start + length
        while pos < end:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            drv.check(drv.address_range(ctypes.byref(base), ctypes.byref(size), pos), "cuMemGetAddressRange")
            stop = min(end, base.value + size.value)
            if stop <= pos:
                raise TransferError(f"CUDA reports an empty allocation at {pos:#x}")
            out.append((pos, stop - pos))
            pos = stop
    return out

