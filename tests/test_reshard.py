"""kvtransport.reshard: every destination byte comes from the right source byte, for random TP pairs, KV head
counts, block-size ratios and NHD/HND (and K/V-sharing) block orders, checked against a slow numpy reference
that knows nothing of unit indices (it places tokens with numpy transposes)."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport import BlockRun, LayoutError
from kvtransport.reshard import ORDERS, Shard, kv_heads_of, reshard_runs, senders_to, source_rank

# ------------------------------------------------------------------ the slow reference


def truth(t: int, h: int, kv: int, d: int) -> np.ndarray:
    """The head_size values of token t, global head h, K/V kv: unique over the whole model (never 0 or -1)."""
    base = ((t * 64 + h) * 2 + kv) * d + 1
    return np.arange(base, base + d, dtype=np.int32)


def physical(logical: np.ndarray, order: str) -> np.ndarray:
    """A logical cache [blocks, N, H, (K,) D] laid out in ``order`` (outermost first, D innermost), contiguous.
    ``"CPU"``: per block and head, K transposed [D][N] then V [N][D] (vLLM's CPU attention)."""
    if order == "CPU":
        nb, n, h, _, d = logical.shape
        k = np.transpose(logical[:, :, :, 0, :], (0, 2, 3, 1)).reshape(nb, h, d * n)
        v = np.transpose(logical[:, :, :, 1, :], (0, 2, 1, 3)).reshape(nb, h, n * d)
        return np.ascontiguousarray(np.concatenate([k, v], axis=2))
    axes = {"N": 1, "H": 2, "K": 3}
    return np.ascontiguousarray(np.transpose(logical, [0, *[axes[c] for c in order], logical.ndim - 1]))


def two(shard: Shard) -> bool:
    """Whether K and V are told apart (they share a block, or vLLM's CPU layout)."""
    return shard.kv_inside or shard.order == "CPU"


def units(phys: np.ndarray, shard: Shard, d: int) -> np.ndarray:
    """The flat unit array the runs index: elements for the CPU layout, head_size elements otherwise."""
    return phys.reshape(-1, 1) if shard.order == "CPU" else phys.reshape(-1, d)


def logical_cache(shard: Shard, num_blocks: int, d: int) -> np.ndarray:
    shape = [num_blocks, shard.block_size, len(shard.heads)] + ([2] if two(shard) else []) + [d]
    return np.full(shape, -1, dtype=np.int32)


def fill(cache: np.ndarray, shard: Shard, blocks: list[int], first: int, tokens: range, d: int) -> None:
    """The slow way: token by token, head by head."""
    kvs = (0, 1) if two(shard) else (0,)
    for t in tokens:
        b, slot = divmod(t - first, shard.block_size)
        for j, h in enumerate(shard.heads):
            for kv in kvs:
                idx = (blocks[b], slot, j, kv) if two(shard) else (blocks[b], slot, j)
                cache[idx] = truth(t, h, kv, d)


# ------------------------------------------------------------------ strategies

HEADS = [1, 2, 3, 4, 6, 8]


def valid_tps(k: int) -> list[int]:
    return [tp for tp in (1, 2, 3, 4, 6, 8, 12, 16) if (tp <= k and k % tp == 0) or (tp > k and tp % k == 0)]


@st.composite
def cases(draw):
    k = draw(st.sampled_from(HEADS))
    src_tp = draw(st.sampled_from(valid_tps(k)))
    dst_tp = draw(st.sampled_from(valid_tps(k)))
    base = draw(st.sampled_from([1, 2, 4, 8]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    src_bs, dst_bs = (base, base * ratio) if draw(st.booleans()) else (base * ratio, base)
    kind = draw(st.sampled_from(["plain", "kv", "cpu"]))
    orders = ["CPU"] if kind == "cpu" else [o for o in ORDERS if o != "CPU" and ("K" in o) == (kind == "kv")]
    src_order, dst_order = draw(st.sampled_from(orders)), draw(st.sampled_from(orders))
    d = draw(st.sampled_from([1, 2, 3]))
    total = draw(st.integers(1, 40))
    start = draw(st.integers(0, total))
    stop = draw(st.integers(start, total))
    dst_first = draw(st.integers(0, start // dst_bs)) * dst_bs
    n_src = -(-total // src_bs)
    n_dst = -(-(total - dst_first) // dst_bs)
    src_pool = n_src + draw(st.integers(0, 3))
    dst_pool = n_dst + draw(st.integers(0, 3))
    src_blocks = draw(st.permutations(range(src_pool)))[:n_src]
    dst_blocks = draw(st.permutations(range(dst_pool)))[:n_dst]
    return dict(k=k, src_tp=src_tp, dst_tp=dst_tp, src_bs=src_bs, dst_bs=dst_bs, src_order=src_order,
                dst_order=dst_order, d=d, total=total, start=start, stop=stop, dst_first=dst_first,
                src_pool=src_pool, dst_pool=dst_pool, src_blocks=list(src_blocks), dst_blocks=list(dst_blocks))


# ------------------------------------------------------------------ the property


@settings(max_examples=500)
@given(cases())
def test_every_destination_byte_comes_from_the_right_source_byte(c):
    k, d = c["k"], c["d"]
    srcs = [Shard(c["src_tp"], r, k, c["src_bs"], c["src_order"], d) for r in range(c["src_tp"])]
    dsts = [Shard(c["dst_tp"], r, k, c["dst_bs"], c["dst_order"], d) for r in range(c["dst_tp"])]
    # source caches: the whole prompt, the slow way, then laid out physically and seen as flat units
    src_units = []
    for s in srcs:
        cache = logical_cache(s, c["src_pool"], d)
        fill(cache, s, c["src_blocks"], 0, range(c["total"]), d)
        src_units.append(units(physical(cache, s.order), s, d))
    for dshard in dsts:
        got = units(physical(logical_cache(dshard, c["dst_pool"], d), dshard.order), dshard, d)
        writer = np.full(len(got), -1)  # which source rank wrote each destination unit
        writes = np.zeros(len(got), dtype=np.int64)
        for s in srcs:
            runs = reshard_runs(s, dshard, c["src_blocks"], c["dst_blocks"], c["start"], c["stop"],
                                dst_first_token=c["dst_first"])
            prev_end = -1
            for r in runs:
                assert r.count >= 1 and r.src >= prev_end  # sorted by source, disjoint
                prev_end = r.src + r.count
                got[r.dst:r.dst + r.count] = src_units[s.tp_rank][r.src:r.src + r.count]
                writes[r.dst:r.dst + r.count] += 1
                writer[r.dst:r.dst + r.count] = s.tp_rank
            # maximal: no two runs could merge
            for a, b in itertools.pairwise(runs):
                assert not (a.src + a.count == b.src and a.dst + a.count == b.dst)
        # the slow reference: only the range's tokens of this rank's own heads, everything else untouched
        expect = logical_cache(dshard, c["dst_pool"], d)
        fill(expect, dshard, c["dst_blocks"], c["dst_first"], range(c["start"], c["stop"]), d)
        expect_units = units(physical(expect, dshard.order), dshard, d)
        np.testing.assert_array_equal(got, expect_units)
        written = (expect_units != -1).all(axis=1)
        assert ((writes == 1) == written).all() and (writes <= 1).all()  # each unit written once, or never
        # every written unit came from a rank that holds its head, the one source_rank names
        senders = senders_to(c["src_tp"], dshard)
        for rank, heads in senders.items():
            for h in heads:
                assert h in srcs[rank].heads and source_rank(h, k, c["src_tp"], dshard.tp_rank) == rank
        assert sorted(h for hs in senders.values() for h in hs) == sorted(dshard.heads)
        assert set(np.unique(writer[written]).tolist()) <= set(senders)


# ------------------------------------------------------------------ exact examples


def test_kv_head_placement_matches_vllm():
    assert kv_heads_of(8, 2, 1) == (4, 5, 6, 7)
    assert kv_heads_of(2, 4, 0) == (0,) and kv_heads_of(2, 4, 1) == (0,) and kv_heads_of(2, 4, 2) == (1,)
    assert kv_heads_of(1, 2, 1) == (0,)
    with pytest.raises(LayoutError, match="cannot be split"):
        kv_heads_of(6, 4, 0)
    with pytest.raises(LayoutError, match="not a multiple"):
        kv_heads_of(4, 6, 0)


def test_replicated_source_heads_spread_over_replicas():
    # 2 KV heads, source TP 4 (each head twice), destination TP 4: rank d gets head d//2 from replica d%2
    assert [senders_to(4, Shard(4, r, 2, 16)) for r in range(4)] == [{0: (0,)}, {1: (0,)}, {2: (1,)}, {3: (1,)}]
    # destination TP 1 takes both heads, one from each holder's first replica
    assert senders_to(4, Shard(1, 0, 2, 16)) == {0: (0,), 2: (1,)}


def test_identical_shards_are_one_run_per_contiguous_block_range():
    a = Shard(2, 1, 4, 16, "HN")
    assert a.units_per_block == 32
    runs = reshard_runs(a, a, [3, 4, 5, 9], [7, 8, 9, 2], 0, 64)
    assert runs == [BlockRun(3 * 32, 7 * 32, 96), BlockRun(9 * 32, 2 * 32, 32)]


def test_tp1_to_tp2_nhd_is_one_run_per_token_and_hnd_one_per_head_and_block():
    src = Shard(1, 0, 2, 2, "NH")
    dst = Shard(2, 1, 2, 2, "NH")  # head 1 only
    # source units of block 5: (slot0,h0)=20 (slot0,h1)=21 (slot1,h0)=22 (slot1,h1)=23; destination block 1 units 2,3
    assert reshard_runs(src, dst, [5], [1], 0, 2) == [BlockRun(21, 2, 1), BlockRun(23, 3, 1)]
    src_h, dst_h = Shard(1, 0, 2, 2, "HN"), Shard(2, 1, 2, 2, "HN")
    # HND: head 1 of block 5 is units 22..23, contiguous on both sides
    assert reshard_runs(src_h, dst_h, [5], [1], 0, 2) == [BlockRun(22, 2, 2)]


def test_block_size_ratio_two():
    src = Shard(1, 0, 1, 16, "HN")
    dst = Shard(1, 0, 1, 32, "HN")
    # two source blocks fill one destination block: halves land back to back
    # (sorted by source unit: block 1 holds tokens 16..31, block 4 tokens 0..15)
    assert reshard_runs(src, dst, [4, 1], [3], 0, 32) == [BlockRun(16, 112, 16), BlockRun(64, 96, 16)]
    # and back: one 32-token block feeds two 16-token ones; a partial last block moves only its tokens
    assert reshard_runs(dst, src, [3], [4, 1], 0, 20) == [BlockRun(96, 64, 16), BlockRun(112, 16, 4)]


def test_refusals_name_the_problem():
    with pytest.raises(LayoutError, match="KV head counts differ"):
        reshard_runs(Shard(1, 0, 2, 16), Shard(1, 0, 4, 16), [0], [0], 0, 1)
    with pytest.raises(LayoutError, match="one side only"):
        reshard_runs(Shard(1, 0, 2, 16, "KNH"), Shard(1, 0, 2, 16, "NH"), [0], [0], 0, 1)
    with pytest.raises(LayoutError, match="do not reach token 17"):
        reshard_runs(Shard(1, 0, 2, 16), Shard(1, 0, 2, 32), [0], [0], 0, 17)
    with pytest.raises(LayoutError, match="unknown block order"):
        Shard(1, 0, 2, 16, "NHD")
    assert reshard_runs(Shard(1, 0, 2, 16), Shard(1, 0, 2, 16), [0], [0], 3, 3) == []


def test_cpu_layout_k_rows_and_v_block():
    # vLLM's CPU attention: per block and head K as [head_size][block_size], then V as [block_size][head_size]
    src, dst = Shard(1, 0, 1, 2, "CPU", 3), Shard(1, 0, 1, 4, "CPU", 3)
    assert src.units_per_block == 12 and dst.units_per_block == 24
    # source block 1 (units 12..23): K rows at 12+e*2, V at 12+6..; destination block 0, tokens 2..3 (slots 2, 3)
    assert reshard_runs(src, dst, [0, 1], [0], 2, 4) == [
        BlockRun(12, 2, 2), BlockRun(14, 6, 2), BlockRun(16, 10, 2), BlockRun(18, 18, 6)]
    # like blocks: the whole block is one run
    assert reshard_runs(src, src, [3], [5], 0, 2) == [BlockRun(36, 60, 12)]
    with pytest.raises(LayoutError, match="units differ"):
        reshard_runs(src, Shard(1, 0, 1, 2, "HN"), [0], [0], 0, 1)


def test_null_blocks_are_skipped():
    # vLLM's null block (a sliding window's skipped blocks) on either side: those tokens are not moved
    a = Shard(1, 0, 1, 2, "HN")
    assert reshard_runs(a, a, [0, 5], [7, 0], 0, 4, skip_block=0) == []
    assert reshard_runs(a, a, [0, 5, 6], [7, 3, 4], 0, 6, skip_block=0) == [BlockRun(10, 6, 4)]
    assert reshard_runs(a, a, [0, 5], [7, 3], 0, 4) == [BlockRun(0, 14, 2), BlockRun(10, 6, 2)]
