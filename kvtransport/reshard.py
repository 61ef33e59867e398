"""Resharding KV between unlike workers: other TP sizes, other block sizes, NHD or HND blocks.

Prefill and decode instances of one model may run at different tensor-parallel sizes and block sizes. A KV
cache block then means different things on the two sides: a prefill rank holds some KV heads of
``block_size_p`` tokens, a decode rank other heads (or the same ones replicated) of ``block_size_d`` tokens.
This module maps one onto the other without touching memory: it only computes *which bytes go where*.

The unit of every mapping is a **unit**: the ``head_size`` elements of one token of one KV head (of K or V when
the two share a block). Inside one block of a worker, units are laid out densely in the physical order of the
block's logical dimensions, outermost first, written as a string over

* ``N``: the token slot in the block (``block_size``),
* ``H``: the KV head among the rank's own heads,
* ``K``: K or V, when they share a block (absent when K and V are separate planes of the layer),

with the head dimension always innermost (vLLM's ``NHD`` is ``"NH"``, ``HND`` is ``"HN"``).

vLLM's CPU attention (``"CPU"``) keeps each (block, head) as K *transposed*, ``[head_size][block_size]``,
followed by V, ``[block_size][head_size]``: there the unit is one element, and a token's K is ``head_size``
elements ``block_size`` apart (one run per element row and block chunk, whole blocks still one run). Unit ``u`` of
block ``b`` has the index ``b * units_per_block + u``: one flat array of units per plane, so that a mapping is a
list of :class:`~kvtransport.coalesce.BlockRun` over unit indices (``count`` units contiguous on both sides),
the same list for every plane of every layer. Same layouts on both sides give one run per contiguous block
range; an NHD side facing a TP split gets one run per token (the finer scatter), HND one per head and block.

KV heads are placed as vLLM places them: with ``tp <= num_kv_heads`` rank ``r`` holds heads
``[r*k, (r+1)*k)`` (``k = num_kv_heads // tp``); with ``tp > num_kv_heads`` every head is replicated on
``tp // num_kv_heads`` consecutive ranks and rank ``r`` holds head ``r // (tp // num_kv_heads)``. A destination
rank receives each of its heads from exactly one source rank (:func:`source_rank`: replicas spread the load).

Pure Python, no imports beyond the standard library and :mod:`kvtransport.coalesce`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .coalesce import BlockRun
from .errors import LayoutError

__all__ = ["ORDERS", "Shard", "kv_heads_of", "reshard_runs", "senders_to", "source_rank"]

ORDERS = ("NH", "HN", "KNH", "KHN", "NKH", "HKN", "NHK", "HNK", "CPU")
"""Every physical order of a block's unit dimensions (outermost first; the head dimension is innermost), and
vLLM's CPU attention layout (element units, see the module docstring)."""
_SIZES_K = 2


def kv_heads_of(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """The global KV heads rank ``tp_rank`` of ``tp_size`` holds, in their local order (see module doc).
    Raises :class:`LayoutError` for a split vLLM cannot run either."""
    if num_kv_heads < 1 or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutError(f"invalid shard: {num_kv_heads} KV heads, tp rank {tp_rank} of {tp_size}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise LayoutError(f"{num_kv_heads} KV heads cannot be split over tp {tp_size}")
        per = num_kv_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % num_kv_heads:
        raise LayoutError(f"tp {tp_size} is not a multiple of the {num_kv_heads} KV heads (replication)")
    return (tp_rank // (tp_size // num_kv_heads),)


def source_rank(head: int, num_kv_heads: int, src_tp: int, dst_rank: int) -> int:
    """The source rank (of ``src_tp``) that sends global KV ``head`` to destination rank ``dst_rank``: its only
    holder, or when the source replicates the head, replica ``dst_rank % replicas`` (spreads the sends)."""
    if not 0 <= head < num_kv_heads:
        raise LayoutError(f"KV head {head} out of range (model has {num_kv_heads})")
    if src_tp <= num_kv_heads:
        kv_heads_of(num_kv_heads, src_tp, 0)  # validates the split
        return head // (num_kv_heads // src_tp)
    replicas = src_tp // num_kv_heads
    kv_heads_of(num_kv_heads, src_tp, 0)
    return head * replicas + dst_rank % replicas


@dataclass(frozen=True, slots=True)
class Shard:
    """One worker's KV cache as the mapping sees it (see the module docstring for ``order``)."""

    tp_size: int
    tp_rank: int
    num_kv_heads: int
    block_size: int
    order: str = "NH"
    head_size: int = 1
    """Elements per head (used by the ``"CPU"`` order only, whose unit is one element)."""

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise LayoutError(f"unknown block order {self.order!r}; expected one of {', '.join(ORDERS)}")
        if self.block_size < 1 or self.head_size < 1:
            raise LayoutError(f"block_size and head_size must be >= 1, got {self.block_size}, {self.head_size}")
        kv_heads_of(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def heads(self) -> tuple[int, ...]:
        return kv_heads_of(self.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def kv_inside(self) -> bool:
        """Whether K and V share a block (``K`` in ``order``): then a unit index also says which of the two."""
        return "K" in self.order

    def _sizes(self) -> dict[str, int]:
        return {"N": self.block_size, "H": len(self.heads), "K": _SIZES_K}

    @property
    def units_per_block(self) -> int:
        if self.order == "CPU":
            return len(self.heads) * 2 * self.block_size * self.head_size
        n = 1
        for c in self.order:
            n *= self._sizes()[c]
        return n

    def _strides(self) -> dict[str, int]:
        sizes, out, acc = self._sizes(), {}, 1
        for c in reversed(self.order):
            out[c] = acc
            acc *= sizes[c]
        return out

    def unit(self, block: int, slot: int, local_head: int, kv: int = 0, elem: int = 0) -> int:
        """Flat unit index of token ``slot`` of ``block``, local head ``local_head``, K (0) or V (1) (and for the
        ``"CPU"`` order, element ``elem`` of the head)."""
        if self.order == "CPU":
            n, d = self.block_size, self.head_size
            base = block * self.units_per_block + local_head * 2 * n * d
            return base + (elem * n + slot if kv == 0 else n * d + slot * d + elem)
        s = self._strides()
        return block * self.units_per_block + slot * s["N"] + local_head * s["H"] + kv * s.get("K", 0)

    @property
    def token_stride(self) -> int:
        """How far apart (in units) two consecutive tokens of one head are inside a block."""
        return self._strides()["N"]


def senders_to(src_tp: int, dst: Shard) -> dict[int, tuple[int, ...]]:
    """Source rank -> the global heads it sends to destination ``dst`` (every head of ``dst`` exactly once)."""
    out: dict[int, list[int]] = {}
    for h in dst.heads:
        out.setdefault(source_rank(h, dst.num_kv_heads, src_tp, dst.tp_rank), []).append(h)
    return {r: tuple(hs) for r, hs in sorted(out.items())}


def reshard_runs(
    src: Shard,
    dst: Shard,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    start: int,
    stop: int,
    *,
    src_first_token: int = 0,
    dst_first_token: int = 0,
    skip_block: int | None = None,
) -> list[BlockRun]:
    """The unit runs source rank ``src`` sends to destination rank ``dst`` for tokens ``[start, stop)``.

    ``src_blocks[i]`` holds the source's tokens ``src_first_token + i*src.block_size`` onwards, ``dst_blocks[j]``
    the destination's tokens ``dst_first_token + j*dst.block_size`` onwards. Only the heads that ``src`` sends
    to ``dst`` (:func:`senders_to`) are covered: empty when it sends none. Runs are sorted by source unit and
    maximal (contiguous on both sides). Tokens whose source or destination block is ``skip_block`` (vLLM's null
    block: a sliding window's tokens that left the window) are left out. Raises :class:`LayoutError` for peers that cannot exchange units
    (other head counts, K/V shared on one side only) or block lists that do not cover the range.
    """
    if src.num_kv_heads != dst.num_kv_heads:
        raise LayoutError(f"KV head counts differ: source {src.num_kv_heads}, destination {dst.num_kv_heads}")
    if (src.order == "CPU") != (dst.order == "CPU") or (src.order == "CPU" and src.head_size != dst.head_size):
        raise LayoutError(f"units differ: source order {src.order!r} (head size {src.head_size}), destination "
                          f"{dst.order!r} (head size {dst.head_size})")
    if src.kv_inside != dst.kv_inside:
        raise LayoutError(f"K and V share a block on one side only (source order {src.order!r}, destination "
                          f"{dst.order!r})")
    if start < 0 or stop < start:
        raise LayoutError(f"invalid token range [{start}, {stop})")
    if stop == start:
        return []
    if start < src_first_token or start < dst_first_token:
        raise LayoutError(f"tokens [{start}, {stop}) begin before the blocks given (source from token "
                          f"{src_first_token}, destination from {dst_first_token})")
    if stop > src_first_token + len(src_blocks) * src.block_size:
        raise LayoutError(f"{len(src_blocks)} source blocks of {src.block_size} tokens from token {src_first_token}"
                          f" do not reach token {stop}")
    if stop > dst_first_token + len(dst_blocks) * dst.block_size:
        raise LayoutError(f"{len(dst_blocks)} destination blocks of {dst.block_size} tokens from token "
                          f"{dst_first_token} do not reach token {stop}")
    heads = senders_to(src.tp_size, dst).get(src.tp_rank, ())
    if not heads:
        return []
    src_local = {h: i for i, h in enumerate(src.heads)}
    dst_local = {h: i for i, h in enumerate(dst.heads)}
    cpu = src.order == "CPU"
    kvs = range(_SIZES_K) if src.kv_inside else range(1)
    ss, ds = (0, 0) if cpu else (src.token_stride, dst.token_stride)
    pieces: list[tuple[int, int, int]] = []
    t = start
    while t < stop:
        si, so = divmod(t - src_first_token, src.block_size)
        di, do = divmod(t - dst_first_token, dst.block_size)
        n = min(stop - t, src.block_size - so, dst.block_size - do)
        sb, db = int(src_blocks[si]), int(dst_blocks[di])
        if skip_block is not None and skip_block in (sb, db):
            t += n
            continue
        for h in heads:
            if cpu:
                _cpu_pieces(src, dst, sb, so, src_local[h], db, do, dst_local[h], n, pieces)
                continue
            for kv in kvs:
                s0 = src.unit(sb, so, src_local[h], kv)
                d0 = dst.unit(db, do, dst_local[h], kv)
                if ss == 1 and ds == 1:
                    pieces.append((s0, d0, n))
                else:
                    pieces.extend((s0 + i * ss, d0 + i * ds, 1) for i in range(n))
        t += n
    if not pieces:
        return []
    pieces.sort()
    runs: list[BlockRun] = []
    cs, cd, cn = pieces[0]
    for s, d, c in pieces[1:]:
        if s == cs + cn and d == cd + cn:
            cn += c
        else:
            runs.append(BlockRun(cs, cd, cn))
            cs, cd, cn = s, d, c
    runs.append(BlockRun(cs, cd, cn))
    return runs


def _cpu_pieces(src: Shard, dst: Shard, sb: int, so: int, sh: int, db: int, do: int, dh: int, n: int,
                pieces: list[tuple[int, int, int]]) -> None:
    """``n`` tokens of one head in vLLM's CPU layout: K one run per element row, V one run."""
    for e in range(src.head_size):
        pieces.append((src.unit(sb, so, sh, 0, e), dst.unit(db, do, dh, 0, e), n))
    pieces.append((src.unit(sb, so, sh, 1, 0), dst.unit(db, do, dh, 1, 0), n * src.head_size))
