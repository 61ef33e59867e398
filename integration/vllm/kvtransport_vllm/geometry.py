"""What a worker's KV cache looks like to unlike peers: its geometry, and the *unit layout* registered with
kvtransport so that peers with other TP sizes, block sizes or NHD/HND orders can exchange KV.

vLLM 0.32 hands every attention layer as a view ``[num_blocks, kv_heads, block_size, 2*head_size]`` (K and V
side by side in the last dimension) in some physical order. When each layer's blocks are dense (one block's
``kv_heads * block_size`` rows back to back, blocks back to back: vLLM's per-layer ``LBHNC``/``LBNHC`` layouts),
the layer is one flat array of *units* of ``2*head_size`` elements (one token of one KV head, K and V), and
:mod:`kvtransport.reshard` maps any source worker's units onto any destination worker's. The unit layout's
compatibility signature holds only the unit size and the dtype: a TP size, a block size or a head order may
differ between peers, a dtype or head size may not. vLLM's CPU attention reads the same view as ``[blocks,
heads, 2*block_size, head_size]``, K rows then V rows, and stores K transposed: its unit is one element (order
``"CPU"`` of :mod:`kvtransport.reshard`). Cross-layer layouts (block outermost over all layers) are
not dense per layer: they keep the block layout, and only like-for-like peers.

No vLLM import (unit-tested on its own).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtransport import KVLayout
from kvtransport.layout import LayerRegion, Plane
from kvtransport.reshard import Shard

SUBSEQ = "#kvt-p"
"""Sequence id of one source rank's part when a destination rank hears from several: ``{req}#kvt-p{rank}``."""


@dataclass(frozen=True)
class Geometry:
    """One worker's cache as unlike peers need it."""

    order: str  # "HN" (vLLM's HND), "NH" (NHD) or "CPU" (vLLM's CPU attention: element units)
    heads: int  # KV heads this rank holds
    block_size: int
    unit_bytes: int  # 2 * head_size * itemsize; CPU: itemsize
    num_blocks: int
    head_size: int = 1

    @property
    def units_per_block(self) -> int:
        if self.order == "CPU":
            return self.heads * self.block_size * 2 * self.head_size
        return self.heads * self.block_size

    def shard(self, tp_size: int, tp_rank: int, num_kv_heads: int) -> Shard:
        return Shard(tp_size, tp_rank, num_kv_heads, self.block_size, self.order, self.head_size)


def describe(kv_caches: Mapping[str, Any], block_dim: int, cpu_attn: bool = False) -> Geometry | None:
    """The geometry of per-layer views ``[blocks, heads, block_size, 2*head]`` with dense blocks, the same for
    every layer; None for anything else (older layouts, cross-layer blocks). ``cpu_attn``: the caches belong to
    vLLM's CPU attention (HND blocks whose interior it lays out itself)."""
    out: Geometry | None = None
    for t in kv_caches.values():
        if block_dim != 0 or len(t.shape) != 4:
            return None
        nb, h, n, c = (int(x) for x in t.shape)
        s0, s1, s2, s3 = (int(x) for x in t.stride())
        if c > 1 and s3 != 1:
            return None
        hn = (n == 1 or s2 == c) and (h == 1 or s1 == n * c)
        nh = (h == 1 or s1 == c) and (n == 1 or s2 == h * c)
        if not (hn or nh) or (nb > 1 and s0 != h * n * c):
            return None
        item = int(t.element_size())
        if cpu_attn:
            if not hn or c % 2:
                return None
            g = Geometry("CPU", h, n, item, nb, c // 2)
        else:
            g = Geometry("HN" if hn else "NH", h, n, c * item, nb)
        if out is not None and g != out:
            return None
        out = g
    return out


def unit_layout(kv_caches: Mapping[str, Any], g: Geometry) -> KVLayout:
    """The caches as units (see the module docstring): one plane per layer, ``num_blocks * units_per_block``
    units of ``unit_bytes``."""
    layers = []
    devices = set()
    for name, t in kv_caches.items():
        devices.add(str(t.device))
        sig = json.dumps({"unit_bytes": g.unit_bytes, "dtype": str(t.dtype).removeprefix("torch.")}, sort_keys=True)
        layers.append(LayerRegion(name, (Plane(int(t.data_ptr()), g.unit_bytes, g.unit_bytes),), sig))
    return KVLayout(tuple(layers), g.num_blocks * g.units_per_block, devices.pop(), tuple(kv_caches.values()))


def part_seq(seq: str, src_rank: int, senders: int) -> str:
    """The sequence id a source rank puts a destination rank's KV under: ``seq`` itself when that destination
    rank hears from one source rank only, else one part per source rank."""
    return seq if senders == 1 else f"{seq}{SUBSEQ}{src_rank}"


def base_seq(seq: str) -> str:
    """Inverse of :func:`part_seq`."""
    return seq.split(SUBSEQ, 1)[0]
