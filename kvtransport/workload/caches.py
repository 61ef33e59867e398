"""vLLM-shaped KV caches for tests, demos and benchmarks (numpy on the host, torch on CUDA).

A cache is one backing buffer with per-layer views ``[num_blocks, heads, block_size, 2*head_dim]`` in a
physical order: ``NHD`` (vLLM's default LBNHC: blocks, tokens, heads, channels), ``HND`` (LBHNC: blocks,
heads, tokens, channels), or ``KV_SPLIT`` (per layer ``[2, num_blocks, block_size, heads, head_dim]``: K and V
as separate planes, block dimension 1).
"""

from __future__ import annotations

import ctypes
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..layout import KVLayout

ORDERS = ("NHD", "HND", "KV_SPLIT")


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int
    num_blocks: int
    heads: int
    block_size: int
    head_dim: int
    itemsize: int = 2
    order: str = "NHD"

    @property
    def piece_bytes(self) -> int:
        """Bytes of one (layer, block) piece, K and V together."""
        return self.heads * self.block_size * 2 * self.head_dim * self.itemsize

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.num_blocks * self.piece_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS = {
    # name: (layers, kv heads, head_dim, itemsize) at block size 16
    "llama-3.1-8b": (32, 8, 128, 2),
    "llama-3.1-70b-tp8": (80, 1, 128, 2),
    "qwen3-8b": (36, 8, 128, 2),
    "deepseek-v3-mla": (61, 1, 288, 2),  # latent 576 = 2 x 288 packed in the last dim
    "one-layer": (1, 8, 128, 2),  # Llama-8B-sized pieces in a single layer: one contiguous put of any size
}


def preset(name: str, num_blocks: int, order: str = "NHD") -> CacheSpec:
    layers, heads, head_dim, itemsize = PRESETS[name]
    return CacheSpec(layers, num_blocks, heads, 16, head_dim, itemsize, order)


def _shape_order(spec: CacheSpec) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(physical shape of one layer, permutation to the logical view, block dim of the view)."""
    n, h, t, c = spec.num_blocks, spec.heads, spec.block_size, 2 * spec.head_dim * spec.itemsize
    if spec.order == "NHD":  # physical [B, N, H, C] -> logical [B, H, N, C]
        return (n, t, h, c), (0, 2, 1, 3), 0
    if spec.order == "HND":  # physical [B, H, N, C] == logical
        return (n, h, t, c), (0, 1, 2, 3), 0
    if spec.order == "KV_SPLIT":  # physical [2, B, N, H, D]
        d = spec.head_dim * spec.itemsize
        return (2, n, t, h, d), (0, 1, 2, 3, 4), 1
    raise ValueError(f"unknown order {spec.order!r}; choose from {ORDERS}")


class HostCache:
    """A cache in host memory (numpy). Views are uint8 with the channel bytes innermost."""

    def __init__(self, spec: CacheSpec, fill_seed: int | None = None) -> None:
        self.spec = spec
        shape, perm, self.block_dim = _shape_order(spec)
        per_layer = int(np.prod(shape))
        if fill_seed is None:
            self.backing = np.zeros(spec.num_layers * per_layer, dtype=np.uint8)
        else:
            self.backing = np.random.default_rng(fill_seed).integers(0, 256, spec.num_layers * per_layer, dtype=np.uint8)
        self.views = {
            f"layers.{i}": self.backing[i * per_layer : (i + 1) * per_layer].reshape(shape).transpose(perm)
            for i in range(spec.num_layers)
        }
        self.layout = KVLayout.from_tensors(self.views, block_dim=self.block_dim)

    def piece(self, layer: int, plane: int, block: int) -> bytes:
        p = self.layout.layers[layer].planes[plane]
        return ctypes.string_at(p.address(block), p.piece_bytes)


class CudaCache:
    """The same cache in CUDA memory (torch), for GPU runs."""

    def __init__(self, spec: CacheSpec, device: str, fill_seed: int | None = None) -> None:
        import torch

        self.spec = spec
        host = HostCache(spec, fill_seed)
        self.block_dim = host.block_dim
        self.backing = torch.from_numpy(host.backing).to(device)
        shape, perm, _ = _shape_order(spec)
        per_layer = int(np.prod(shape))
        self.views = {
            f"layers.{i}": self.backing[i * per_layer : (i + 1) * per_layer].view(shape).permute(perm)
            for i in range(spec.num_layers)
        }
        self.layout = KVLayout.from_tensors(self.views, block_dim=self.block_dim)

    def to_host(self) -> HostCache:
        host = HostCache(self.spec)
        host.backing[:] = self.backing.cpu().numpy()
        return host


def make_cache(spec: CacheSpec, device: str = "cpu", fill_seed: int | None = None) -> HostCache | CudaCache:
    if device == "cpu":
        return HostCache(spec, fill_seed)
    return CudaCache(spec, device, fill_seed)


def host_copy(cache: HostCache | CudaCache) -> HostCache:
    return cache if isinstance(cache, HostCache) else cache.to_host()


def verify_transfer(
    received: HostCache, sent: HostCache, pairs: dict[int, list[tuple[int, int]]]
) -> list[str]:
    """Compare every transferred piece, and check that every other receiver block is still zero.

    ``pairs`` maps layer -> [(src, dst), ...]. Returns a list of problems (empty when all is right)."""
    problems: list[str] = []
    for layer in range(received.spec.num_layers):
        dsts = {}
        for src, dst in pairs.get(layer, []):
            dsts[dst] = src
        nplanes = len(received.layout.layers[layer].planes)
        for block in range(received.spec.num_blocks):
            for plane in range(nplanes):
                got = received.piece(layer, plane, block)
                if block in dsts:
                    want = sent.piece(layer, plane, dsts[block])
                    if got != want:
                        problems.append(f"layer {layer} plane {plane} block {block} (from {dsts[block]}): bytes differ")
                elif any(got):
                    problems.append(f"layer {layer} plane {plane} block {block}: written but not a destination")
            if len(problems) > 20:
                return problems
    return problems


def _block_index(cache: HostCache | CudaCache, block: int) -> tuple[Any, ...]:
    return (slice(None),) * cache.block_dim + (block,)


def read_block(cache: HostCache | CudaCache, layer: int, block: int) -> bytes:
    """One (layer, block) piece in logical order, as bytes (works for host and CUDA caches)."""
    v = cache.views[f"layers.{layer}"][_block_index(cache, block)]
    if isinstance(cache, CudaCache):
        return bytes(v.cpu().contiguous().numpy().tobytes())
    return bytes(np.ascontiguousarray(v).tobytes())


def zero_block(cache: HostCache | CudaCache, block: int) -> None:
    """Overwrite one block in every layer with zeros (what a reusing server does before handing it out).

    Returns once the zeros are in memory: on CUDA the writes are kernels on this process's stream, and a block
    handed to a peer before they ran would have the peer's fresh puts wiped by them later (seen with two
    processes sharing one GPU, whose kernels are time-sliced: earlier layers of a new sequence zeroed)."""
    for name in cache.views:
        cache.views[name][_block_index(cache, block)] = 0
    if isinstance(cache, CudaCache):
        import torch

        torch.cuda.synchronize(cache.backing.device)
