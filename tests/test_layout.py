"""KVLayout: vLLM layouts in every stride permutation, plain regions, rejections, compatibility hash."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvtransport import KVLayout, LayoutError
from kvtransport.layout import iter_segments
from kvtransport.workload.caches import ORDERS, CacheSpec, HostCache

L, B, H, N, D = 3, 10, 4, 16, 8  # layers, blocks, kv heads, block size, head size


def vllm_views(order: str, dtype=torch.bfloat16):
    """One backing buffer; per-layer views [B, H, N, 2D] whose physical order follows vLLM's KVCacheLayout."""
    # physical axis orders of (L, B, H, N, C)
    perms = {"LBNHC": "LBNHC", "LBHNC": "LBHNC", "BLHNC": "BLHNC", "BLNHC": "BLNHC"}
    phys = perms[order]
    sizes = {"L": L, "B": B, "H": H, "N": N, "C": 2 * D}
    buf = torch.arange(np.prod(list(sizes.values())), dtype=torch.float32).to(dtype)
    t = buf.view(*[sizes[c] for c in phys])
    logical = t.permute(*[phys.index(c) for c in "LBHNC"])  # [L, B, H, N, C]
    return buf, {f"model.layers.{i}.attn": logical[i] for i in range(L)}


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC", "BLHNC", "BLNHC"])
def test_vllm_permutations_one_plane_per_layer(order):
    _, views = vllm_views(order)
    layout = KVLayout.from_tensors(views)
    piece = H * N * 2 * D * 2
    assert layout.num_layers == L and layout.num_blocks == B
    for i, layer in enumerate(layout.layers):
        assert len(layer.planes) == 1
        p = layer.planes[0]
        assert p.piece_bytes == piece
        view = views[f"model.layers.{i}.attn"]
        assert p.base == view.data_ptr()
        assert p.block_stride == view.stride(0) * 2
        # the piece really holds that block's data, contiguously
        blk = view[3].contiguous().view(torch.uint8).numpy().tobytes()
        import ctypes

        phys = ctypes.string_at(p.address(3), piece)
        assert sorted(blk) == sorted(phys)  # same bytes; order is the physical one
    assert layout.bytes_per_block == L * piece


def test_physical_order_changes_the_hash():
    hashes = {o: KVLayout.from_tensors(vllm_views(o)[1]).compat_hash() for o in ["LBNHC", "LBHNC", "BLHNC"]}
    assert hashes["LBNHC"] != hashes["LBHNC"]  # NHD vs HND must never exchange bytes
    assert hashes["LBHNC"] == hashes["BLHNC"]  # same per-block bytes; only the block stride differs


def test_hash_ignores_block_count_and_addresses():
    a = HostCache(CacheSpec(2, 10, 2, 4, 8))
    b = HostCache(CacheSpec(2, 30, 2, 4, 8))
    assert a.layout.compat_hash() == b.layout.compat_hash()
    c = HostCache(CacheSpec(2, 10, 2, 4, 16))
    assert a.layout.compat_hash() != c.layout.compat_hash()


def test_kv_split_gives_two_planes():
    cache = HostCache(CacheSpec(2, 6, 2, 4, 8, order="KV_SPLIT"))
    for layer in cache.layout.layers:
        assert len(layer.planes) == 2
        assert layer.planes[1].base - layer.planes[0].base == 6 * 4 * 2 * 8 * 2


def test_heads_outermost_splits_into_planes_and_too_many_is_refused():
    t = torch.zeros(4, 10, 16, 32, dtype=torch.uint8).permute(1, 0, 2, 3)  # [B, H, N, C], H outermost
    layout = KVLayout.from_tensors([t])
    assert len(layout.layers[0].planes) == 4
    t2 = torch.zeros(100, 10, 16, dtype=torch.uint8).permute(1, 0, 2)
    with pytest.raises(LayoutError, match="separate pieces"):
        KVLayout.from_tensors([t2])


@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ([torch.zeros(4, 8).expand(4, 8)[:, :1].expand(4, 8)], "stride 0"),
        ([torch.zeros(8).expand(5, 8)], "stride 0"),
        ([torch.zeros(4, 8), torch.zeros(5, 8)], "same number of blocks"),
        ([], "at least one"),
        ([torch.zeros(0, 8)], "no blocks"),
        (["not a tensor"], "expected a torch tensor"),
        ([torch.zeros(8, 4).as_strided((4, 4), (2, 1))], "overlap"),
    ],
)
def test_rejections(tensors, fragment):
    with pytest.raises(LayoutError, match=fragment):
        KVLayout.from_tensors(tensors)


def test_numpy_and_block_dim():
    arr = np.zeros((2, 7, 3, 5), dtype=np.float16)  # [2(KV), B, N, D]
    layout = KVLayout.from_tensors({"l0": arr}, block_dim=1)
    assert layout.num_blocks == 7 and len(layout.layers[0].planes) == 2
    assert layout.layers[0].planes[0].piece_bytes == 3 * 5 * 2


def test_from_regions_and_wire_round_trip():
    layout = KVLayout.from_regions(8, [[(4096, 128, 128)], [(8192, 256, 64), (8192 + 64, 256, 64)]])
    assert layout.bytes_per_block == 256
    back = KVLayout.from_wire(layout.to_wire())
    assert back.layers == layout.layers and back.num_blocks == 8
    assert layout.extents() == [(4096, 1024), (8192, 7 * 256 + 128)]
    with pytest.raises(LayoutError, match="overlap"):
        KVLayout.from_regions(8, [[(4096, 64, 128)]])
    with pytest.raises(LayoutError):
        KVLayout.from_regions(0, [[(4096, 64, 64)]])


@given(st.recursive(st.none() | st.integers() | st.text(max_size=5), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12))
def test_from_wire_rejects_garbage_with_layout_error(obj):
    try:
        KVLayout.from_wire(obj if isinstance(obj, dict) else {"layers": obj, "num_blocks": 1, "device": "cpu"})
    except LayoutError:
        pass


@pytest.mark.parametrize("order", ORDERS)
def test_segments_cover_exactly_the_pieces(order):
    a = HostCache(CacheSpec(1, 12, 2, 4, 8, order=order), fill_seed=1)
    b = HostCache(CacheSpec(1, 9, 2, 4, 8, order=order))
    runs = [(0, 3, 2), (7, 0, 1)]
    segs = list(iter_segments(a.layout.layers[0], b.layout.layers[0], runs))
    total = sum(n for _, _, n in segs)
    assert total == 3 * a.layout.layers[0].block_bytes
