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

from kvtransport import KVLayout, LayoutError
from kvtransport.layout import LayerRegion, Plane
from kvtransport.reshard import Shard, kv_heads_of, senders_to

SUBSEQ = "#kvt-p"
"""Sequence id of one source rank's part when a destination rank hears from several: ``{req}#kvt-p{rank}``."""

KV_ORDERS = ("HN", "NH", "CPU")
"""The head orders a peer's geometry may name (:class:`Geometry`); None: its layout serves like-for-like peers only."""
MAX_PEER_TP = 64
"""The largest TP size a peer may claim (a decode's geometry, a prefill's ``senders``). vLLM runs one engine's TP
group on one NVLink domain (8 GPUs per host, up to 72 per rack), and past its KV head count a TP size only replicates
heads: 64 ranks cover every deployment we know of. Each claimed rank costs a prefill worker a link (a socket and a
connect thread, ``pusher.MAX_LINKS_PER_PEER``) and one push per rank in every expansion: a decode claiming 1,024 ranks
of 1-token blocks made one 2,048-token push 131,072 unit runs (~10 s on the pusher thread, whose GIL the forward
shares: issue 29)."""
MAX_PEER_BLOCK_SIZE = 1 << 20
"""The largest block size a peer may claim (tokens per block; vLLM's largest is 256; the scheduler's own bound)."""
MAX_PIECES_PER_TOKEN = 8
"""Pieces one prompt token may cost the expansion of a push towards one unlike peer, summed over the peer's ranks this
worker sends to (:func:`served_ranks`). A piece is one of our KV heads over a stretch of tokens between two block
boundaries of either side: what :func:`kvtransport.reshard.reshard_runs` maps one at a time, 5-16 us each on the
pusher thread, whose GIL the forward shares (2-core VM, idle to loaded; vLLM's CPU layout costs ``head_size + 1``
times that, a property of our own cache). Per token: (1/our block size + 1/theirs) per head per rank. Legitimate
mappings cost 0.1 to 1 (8 heads at TP1 towards TP 2..8, 16-token blocks: a 2,048-token push in 10-20 ms); 8 allows
a decode of 64 ranks at 16-token blocks (0.08-0.3 s per 2,048 tokens). Smaller decode blocks on many ranks drive it
up: 64 ranks of 1-token blocks cost 68 (and 1,024 such ranks ~10 s for that push: issue 29). The bound is raised for
a rank holding many heads in small blocks (to 4 x its heads / its block size: a like-TP peer at half our block size
costs 3 x its heads / its block size)."""


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


def _brief(value: Any) -> str:
    """A peer-supplied value for an error message: short, never raising (a 5,000-digit int cannot be ``repr``'d)."""
    if isinstance(value, bool) or value is None or (isinstance(value, int) and abs(value) < 1 << 63):
        return repr(value)
    if isinstance(value, str) and len(value) <= 16:
        return repr(value)
    return f"a {type(value).__name__}"


def _count(value: Any, name: str, limit: int, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise LayoutError(f"{name} {_brief(value)} is not an int in 1..{limit}{why}")
    return value


def check_peer_geometry(raw: Any) -> dict[str, Any]:
    """A peer's geometry (``tp_size``, ``block_size``, ``kv_order``, as its hello says and the scheduler forwards it)
    checked for types and ranges: a clean copy. Raises LayoutError naming the field and the fix. O(1)."""
    if not isinstance(raw, Mapping):
        raise LayoutError(f"geometry must be an object with tp_size, block_size and kv_order, got {_brief(raw)}")
    tp = _count(raw.get("tp_size"), "tp_size", MAX_PEER_TP, " (MAX_PEER_TP: run that decode at a TP size of at most "
                f"{MAX_PEER_TP})")
    bs = _count(raw.get("block_size"), "block_size", MAX_PEER_BLOCK_SIZE)
    order = raw.get("kv_order")
    if order is not None and order not in KV_ORDERS:
        raise LayoutError(f"kv_order {_brief(order)} is none of {', '.join(KV_ORDERS)}")
    return {"tp_size": tp, "block_size": bs, "kv_order": order}


def served_ranks(local: Shard, geo: Mapping[str, Any]) -> list[int]:
    """The ranks of an unlike peer of geometry ``geo`` (from :func:`check_peer_geometry`) that the worker of shard
    ``local`` sends to (those it holds heads for), once it is known that the peer's split fits the model, that the
    units match, and that a push's expansion stays within MAX_PIECES_PER_TOKEN. Raises LayoutError naming the fix.
    O(tp_size) <= O(MAX_PEER_TP)."""
    tp, bs, order = int(geo["tp_size"]), int(geo["block_size"]), geo["kv_order"]
    if order is None:
        raise LayoutError("its KV cache layout serves like-for-like peers only (not [blocks, heads, block, head] dense "
                          "per layer: MLA's latent cache, cross-layer blocks): run both sides with the same TP size "
                          "and block size")
    if (order == "CPU") != (local.order == "CPU"):
        raise LayoutError(f"kv_order {order} against ours {local.order}: vLLM's CPU attention exchanges KV only with "
                          "CPU attention")
    kv_heads_of(local.num_kv_heads, tp, 0)  # the split fits the model (raises LayoutError naming it)
    ranks: list[int] = []
    cost = 0.0
    for rank in range(tp):
        dst = Shard(tp, rank, local.num_kv_heads, bs, order, local.head_size)
        heads = senders_to(local.tp_size, dst).get(local.tp_rank, ())
        if heads:
            ranks.append(rank)
            cost += len(heads) * (1.0 / local.block_size + 1.0 / bs)  # pieces per token (MAX_PIECES_PER_TOKEN)
    limit = max(MAX_PIECES_PER_TOKEN, 4 * len(local.heads) / local.block_size)
    if cost > limit:
        raise LayoutError(f"mapping our KV onto tp_size {tp}, block_size {bs} costs {cost:g} pieces per prompt token "
                          f"(limit {limit:g}, MAX_PIECES_PER_TOKEN): run that decode with larger blocks or fewer ranks")
    return ranks


def check_senders(senders: Mapping[int, str], num_kv_heads: int | None) -> None:
    """A prefill's ``senders`` (its tp rank -> kvtransport instance id, from its welcome) as a decode worker binds a
    request to them: at most MAX_PEER_TP ranks, exactly ``0..n-1`` (a gap would bind only some heads), and, when
    the model's KV head count is known, a TP split of it. Raises LayoutError naming the fix. O(1) past the size
    check, O(MAX_PEER_TP) at most."""
    n = len(senders)
    if not 1 <= n <= MAX_PEER_TP:
        raise LayoutError(f"the prefill names {n} worker ranks: 1..{MAX_PEER_TP} expected (MAX_PEER_TP)")
    if set(senders) != set(range(n)):
        raise LayoutError(f"the prefill's worker ranks are not 0..{n - 1}: {[_brief(r) for r in list(senders)[:8]]}")
    if num_kv_heads is not None:
        kv_heads_of(num_kv_heads, n, 0)
