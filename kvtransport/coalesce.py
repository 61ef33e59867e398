"""Block coalescing: turn (src, dst) block id pairs into maximal runs contiguous on both sides."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .errors import InvalidBlockIds


class BlockRun(NamedTuple):
    """``count`` blocks starting at ``src`` on the sender land at ``dst`` onwards on the receiver."""

    src: int
    dst: int
    count: int  # type: ignore[assignment]


def validate_block_ids(
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    *,
    src_num_blocks: int | None = None,
    dst_num_blocks: int | None = None,
) -> None:
    """Raise :class:`InvalidBlockIds` unless the pair lists can be transferred as given.

    Checks: equal lengths, integer ids, no negative ids, no id beyond the given block counts, no
    destination block named twice (two sources writing one block is always a bug). Sources may repeat.
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise InvalidBlockIds(
            f"{len(src_block_ids)} source block ids but {len(dst_block_ids)} destination block ids; "
            "they are pairs and must have equal length"
        )
    seen: set[int] = set()
    for i, (s, d) in enumerate(zip(src_block_ids, dst_block_ids, strict=True)):
        if type(s) is not int or type(d) is not int:
            if not (_is_int_like(s) and _is_int_like(d)):
                raise InvalidBlockIds(f"block ids must be integers; pair {i} is ({s!r}, {d!r})")
        if s < 0 or d < 0:
            raise InvalidBlockIds(f"negative block id in pair {i}: ({s}, {d})")
        if src_num_blocks is not None and s >= src_num_blocks:
            raise InvalidBlockIds(f"source block id {s} (pair {i}) is beyond the sender's {src_num_blocks} blocks")
        if dst_num_blocks is not None and d >= dst_num_blocks:
            raise InvalidBlockIds(f"destination block id {d} (pair {i}) is beyond the receiver's {dst_num_blocks} blocks")
        if d in seen:
            raise InvalidBlockIds(f"destination block {d} appears twice (pair {i}); each destination block is written once")
        seen.add(d)


def _is_int_like(x: object) -> bool:
    """numpy integer scalars pass; bool, float and str do not."""
    return hasattr(x, "__index__") and not isinstance(x, bool) and type(x).__name__.startswith(("int", "uint"))


def coalesce(
    src_block_ids: Sequence[int],
    dst_block_ids: Sequence[int],
    *,
    src_num_blocks: int | None = None,
    dst_num_blocks: int | None = None,
) -> list[BlockRun]:
    """Merge pairs into maximal runs contiguous on both sides, preserving order.

    Pure function; validates first (see :func:`validate_block_ids`) so nothing moves on bad input. Expanding
    the result (``expand_runs``) gives back exactly the input pairs.
    """
    validate_block_ids(src_block_ids, dst_block_ids, src_num_blocks=src_num_blocks, dst_num_blocks=dst_num_blocks)
    runs: list[BlockRun] = []
    if not src_block_ids:
        return runs
    it = zip(src_block_ids, dst_block_ids, strict=True)
    s0, d0 = next(it)
    start_s, start_d, count = int(s0), int(d0), 1
    for s, d in it:
        s, d = int(s), int(d)
        if s == start_s + count and d == start_d + count:
            count += 1
        else:
            runs.append(BlockRun(start_s, start_d, count))
            start_s, start_d, count = s, d, 1
    runs.append(BlockRun(start_s, start_d, count))
    return runs


def single_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int], **limits: int | None) -> list[BlockRun]:
    """Like :func:`coalesce` but one run per pair (coalescing off; used to measure what coalescing buys)."""
    validate_block_ids(src_block_ids, dst_block_ids, **limits)
    return [BlockRun(int(s), int(d), 1) for s, d in zip(src_block_ids, dst_block_ids, strict=True)]


def expand_runs(runs: Sequence[BlockRun]) -> tuple[list[int], list[int]]:
    """Inverse of :func:`coalesce`: the (src, dst) id lists the runs stand for."""
    src: list[int] = []
    dst: list[int] = []
    for r in runs:
        src.extend(range(r.src, r.src + r.count))
        dst.extend(range(r.dst, r.dst + r.count))
    return src, dst
