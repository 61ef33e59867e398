"""The pushes (:class:`~.metadata.Push`) that put a prefill request's KV into its destinations.

Like-for-like destinations get block pairs, one push per KV cache group (with several groups, pairs where
either side holds vLLM's null block are left out); an unlike decode (other TP size, block size or head order)
gets token ranges with the blocks that hold them, which the workers map (:mod:`kvtransport.reshard`). Planning
only: it reads and advances the records of :mod:`.producer` (what was pushed to each destination), nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .config import ConnectorSettings
from .metadata import NULL_BLOCK, Push

if TYPE_CHECKING:
    from .producer import _Dst, _Source


class PushPlanner:
    """Pushes of this prefill (``block_size``, ``num_groups``) to destinations; ``unlike(engine)`` is a decode
    engine's geometry when it differs from ours (None: like-for-like)."""

    def __init__(self, settings: ConnectorSettings, block_size: int, num_groups: int,
                 unlike: Callable[[str], dict[str, Any] | None]) -> None:
        self.settings = settings
        self.block_size = block_size
        self.num_groups = num_groups
        self.unlike = unlike

    def layer_pushes(self, src: _Source, after: int, out: list[Push]) -> None:
        """Layer-wise: the prompt of ``src`` is computed up to token ``after`` (all of it: the final pushes, which
        signal); queue what its live destinations have not been sent yet."""
        bs = self.block_size
        final = after >= src.prompt_len
        upto = -(-after // bs)  # blocks holding computed tokens (last one maybe partial)
        for d in src.dsts:
            if d.final_sent or d.cancelled:
                continue
            geo = self.unlike(d.engine)
            if geo is not None:
                self._push_tokens(src, d, geo, d.pushed_tok, after, final, out)
                continue
            end = min(upto, d.offset + len(d.blocks), len(src.blocks))
            lo = d.pushed_upto
            if end > lo:
                self._group_pushes(src, d, lo, end, final, out)
                s_ids, d_ids = self._pairs(src.blocks[lo:end], d.blocks[lo - d.offset:end - d.offset])
                out.append(Push(src.req_id, d.seq, d.engine, s_ids, d_ids, final, self._delay(src) if final else 0.0))
                src.puts_issued = True
            elif final:  # nothing left to put, still signal
                out.append(Push(src.req_id, d.seq, d.engine, (), (), True, self._delay(src)))
                src.puts_issued = True
            d.pushed_upto = max(d.pushed_upto, after // bs)
            d.final_sent = final

    def whole_pushes(self, src: _Source, out: list[Push]) -> None:
        """``src`` is complete: queue every live destination's whole KV (final)."""
        n_src = -(-src.prompt_len // self.block_size)
        for d in src.dsts:
            if d.final_sent or d.cancelled:
                continue
            geo = self.unlike(d.engine)
            if geo is not None:
                self._push_tokens(src, d, geo, 0, src.prompt_len, True, out)
                src.puts_issued = True
                continue
            n = max(0, min(len(d.blocks), n_src - d.offset, len(src.blocks) - d.offset))
            self._group_pushes(src, d, d.offset, d.offset + n, True, out)
            s_ids, d_ids = self._pairs(src.blocks[d.offset:d.offset + n], d.blocks[:n])
            out.append(Push(src.req_id, d.seq, d.engine, s_ids, d_ids, True, self._delay(src)))
            d.final_sent = True
            src.puts_issued = True

    def _push_tokens(self, src: _Source, d: _Dst, geo: dict[str, Any], lo: int, hi: int, final: bool,
                     out: list[Push]) -> None:
        """Queue prompt tokens ``[lo, hi)`` of ``src`` for a destination ``d`` of an unlike decode (``geo``): a
        token range with the blocks that hold it on both sides (the workers map heads and blocks). Tokens the
        decode had already (its first ``d.offset`` blocks) and tokens beyond its blocks are left out."""
        bs, dbs = self.block_size, int(geo["block_size"])
        first = d.offset * dbs
        lo = max(lo, first)
        hi = min(hi, src.prompt_len, first + len(d.blocks) * dbs, len(src.blocks) * bs)
        delay = self._delay(src) if final else 0.0
        if hi > lo:
            s_lo, s_hi = lo // bs, -(-hi // bs)
            d_lo, d_hi = (lo - first) // dbs, -(-(hi - first) // dbs)
            for g, (sg, dg) in enumerate(zip(src.extra, d.extra, strict=False), start=1):
                out.append(Push(src.req_id, d.seq, d.engine, tuple(sg[s_lo:s_hi]), tuple(dg[d_lo:d_hi]), final,
                                start=lo, stop=hi, src_first=s_lo * bs, dst_first=first + d_lo * dbs, group=g))
            out.append(Push(src.req_id, d.seq, d.engine, tuple(src.blocks[s_lo:s_hi]), tuple(d.blocks[d_lo:d_hi]),
                            final, delay, start=lo, stop=hi, src_first=s_lo * bs, dst_first=first + d_lo * dbs))
            src.puts_issued = True
        elif final:  # nothing left to put, still signal
            out.append(Push(src.req_id, d.seq, d.engine, (), (), True, delay, start=lo, stop=lo))
            src.puts_issued = True
        d.pushed_tok = max(d.pushed_tok, hi)
        d.final_sent = final

    def _pairs(self, src: list[int], dst: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Group 0's block pairs; with several groups (group 0 may be a sliding window's) null blocks are left out."""
        if self.num_groups == 1:
            return tuple(src), tuple(dst)
        pairs = [(a, b) for a, b in zip(src, dst, strict=False) if a != NULL_BLOCK and b != NULL_BLOCK]
        return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)

    @staticmethod
    def _group_pushes(src: _Source, d: _Dst, lo: int, end: int, final: bool, out: list[Push]) -> None:
        """Like-for-like pushes of prompt blocks ``[lo, end)`` for KV cache groups 1.. (before group 0's, which
        signals): block pairs where neither side holds vLLM's null block (a sliding window's skipped blocks)."""
        for g, (sg, dg) in enumerate(zip(src.extra, d.extra, strict=False), start=1):
            pairs = [(a, b) for a, b in zip(sg[lo:end], dg[lo - d.offset:end - d.offset], strict=False)
                     if a != NULL_BLOCK and b != NULL_BLOCK]
            if pairs:
                out.append(Push(src.req_id, d.seq, d.engine, tuple(a for a, _ in pairs), tuple(b for _, b in pairs),
                                final, group=g))

    def _delay(self, src: _Source) -> float:
        """Test-only pause before ``src``'s final signal (``debug_push_delay`` and ``kvt_debug_delay``)."""
        return self.settings.debug_push_delay if src.debug_delay else 0.0
