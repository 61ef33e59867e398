"""Focused tests written to kill the mutants that survived the mutation run of the core's safety modules
(scripts/mutation.sh, docs/mutation.md): each asserts an exact value or bound that the other tests leave open."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import test_doorbell  # tests/test_doorbell.py (pytest puts tests/ on the path)

import kvtransport as kt
from kvtransport import (
    ForeignSequence,
    InvalidBlockIds,
    KVLayout,
    LayoutError,
    PeerDisconnected,
    ProtocolError,
    SequenceAborted,
    SlotsExhausted,
    TransferError,
    receiving,
    wire,
)
from kvtransport.checks import MAX_TIMEOUT_S, block_id_list, layer_list, timeout_seconds
from kvtransport.coalesce import BlockRun, coalesce, single_runs
from kvtransport.layout import iter_segments, pieces_crc32
from kvtransport.semaphores import SequenceTable
from kvtransport.sidechannel import FramedSocket
from kvtransport.sidecontext import Counters
from kvtransport.testing import inproc
from kvtransport.workload.caches import CacheSpec, HostCache

# ---------------------------------------------------------------------------------------------- coalesce


def test_unsigned_numpy_ids_are_integers() -> None:
    ids = np.array([3, 4], dtype=np.uint64)
    assert coalesce(list(ids), list(ids)) == [BlockRun(3, 3, 2)]
    assert coalesce(list(np.array([7], dtype=np.uint8)), [0]) == [BlockRun(7, 0, 1)]


def test_an_object_named_like_an_int_without_index_is_refused() -> None:
    int_like = type("int_named", (), {})()  # its type's name starts with "int", it has no __index__
    with pytest.raises(InvalidBlockIds, match="must be integers"):
        coalesce([int_like], [0])


def test_single_runs_checks_the_block_ranges_it_is_given() -> None:
    assert single_runs([3, 4], [0, 1], src_num_blocks=5, dst_num_blocks=2) == [BlockRun(3, 0, 1), BlockRun(4, 1, 1)]
    with pytest.raises(InvalidBlockIds, match="beyond the sender's 4 blocks"):
        single_runs([4], [0], src_num_blocks=4)
    with pytest.raises(InvalidBlockIds, match="beyond the receiver's 1 blocks"):
        single_runs([0], [1], dst_num_blocks=1)


# ---------------------------------------------------------------------------------------------- checks


def test_bytes_and_mappings_are_not_lists_of_ids_or_layers() -> None:
    for values in ("01", b"\x00\x01", bytearray(b"\x00"), {0: 1}):
        with pytest.raises(InvalidBlockIds, match=r"^src must be a sequence of ints, got "):
            block_id_list(values, "src")
    for layers in ("01", b"\x00\x01"):
        with pytest.raises(InvalidBlockIds, match=r"^layers must be a sequence of ints or None, got "):
            layer_list(layers, 2)
    assert layer_list([1, 0], 2) == (1, 0) and block_id_list(iter([2, 3]), "dst") == (2, 3)


# ---------------------------------------------------------------------------------------------- layout

BASE = 1 << 20


def test_from_regions_accepts_exactly_its_bounds() -> None:
    one = KVLayout.from_regions(1, [[(1, 0, 1)]])  # one block, base 1, stride 0, one byte: the smallest valid
    assert (one.num_blocks, one.device, one.layers[0].name) == (1, "cpu", "layer.0")
    assert one.layers[0].planes[0].base == 1
    with pytest.raises(LayoutError, match="num_blocks must be >= 1"):
        KVLayout.from_regions(0, [[(BASE, 8, 8)]])
    for plane in ((0, 8, 8), (BASE, -1, 8), (BASE, 8, 0), (0, -1, 8), (0, 8, 0)):
        with pytest.raises(LayoutError, match="invalid plane"):
            KVLayout.from_regions(1, [[plane]])


def test_from_regions_single_plane_overlap_is_named_by_its_own_check() -> None:
    # one block cannot overlap itself, whatever the stride
    assert KVLayout.from_regions(1, [[(BASE, 4, 8)]]).num_blocks == 1
    with pytest.raises(LayoutError, match=r"layer 'k': block_stride 4 < piece 8: blocks overlap"):
        KVLayout.from_regions(2, [[(BASE, 4, 8)]], names=["k"])
    with pytest.raises(LayoutError, match=r"layer 'k': block_stride 4 < piece 8: blocks overlap"):
        KVLayout.from_regions(3, [[(BASE, 4, 8)]], names=["k"])


def test_from_regions_overlapping_planes_name_their_layer() -> None:
    with pytest.raises(LayoutError, match=r"^layer 'kv': pieces overlap"):
        KVLayout.from_regions(2, [[(BASE, 64, 16), (BASE + 8, 64, 16)]], names=["kv"])


def test_from_regions_signature_names_and_keepalive() -> None:
    keep = object()
    layout = KVLayout.from_regions(2, [[(BASE, 16, 8), (BASE + 8, 16, 8)]], names=["a"], keepalive=[keep])
    assert layout.layers[0].signature == '{"planes": [8, 8]}'
    assert layout.layers[0].name == "a"
    assert layout.keepalive == (keep,)
    assert KVLayout.from_regions(1, [[(BASE, 8, 8)]]).keepalive == ()


def test_describe_mismatch_names_the_first_differing_layer() -> None:
    mine = KVLayout.from_regions(1, [[(BASE, 8, 8)], [(2 * BASE, 8, 8)]], names=["l0", "l1"])
    same_first = KVLayout.from_regions(1, [[(BASE, 8, 8)], [(2 * BASE, 16, 16)]])
    assert mine.describe_mismatch(same_first.signature()) == \
        'layer 1 (l1) differs: ours {"planes": [8]}, peer\'s {"planes": [16]}'
    assert mine.describe_mismatch({"version": 2}) == "layer count differs: ours 2, peer's 0"
    assert mine.describe_mismatch({"version": 2, "layers": mine.signature()["layers"]}) == "signatures differ"


def test_extents_merge_touching_spans_and_keep_the_larger_end() -> None:
    layout = KVLayout.from_regions(1, [[(BASE, 0, 8)], [(BASE + 8, 0, 8)]])
    assert layout.extents() == [(BASE, 16)]  # back to back: one extent
    # three separate spans, then one inside the third: the third keeps its own end
    nested = KVLayout.from_regions(1, [[(BASE, 0, 8)], [(2 * BASE, 0, 8)], [(3 * BASE, 0, 64)],
                                       [(3 * BASE + 8, 0, 8)]])
    assert nested.extents() == [(BASE, 8), (2 * BASE, 8), (3 * BASE, 64)]


def test_segments_are_per_block_unless_both_sides_are_dense() -> None:
    sparse = KVLayout.from_regions(4, [[(BASE, 16, 8)]]).layers[0]  # 8-byte pieces every 16 bytes
    dense = KVLayout.from_regions(4, [[(2 * BASE, 8, 8)]]).layers[0]
    runs = [(1, 2, 2)]
    assert list(iter_segments(dense, dense, runs)) == [(2 * BASE + 8, 2 * BASE + 16, 16)]
    assert list(iter_segments(sparse, dense, runs)) == [(BASE + 16, 2 * BASE + 16, 8), (BASE + 32, 2 * BASE + 24, 8)]
    assert list(iter_segments(dense, sparse, runs)) == [(2 * BASE + 8, BASE + 32, 8), (2 * BASE + 16, BASE + 48, 8)]


def test_piece_checksums_are_the_crc32_of_the_pieces_in_order() -> None:
    buf = (ctypes.c_uint8 * 64)(*range(64))
    base = ctypes.addressof(buf)
    layer = KVLayout.from_regions(4, [[(base, 16, 4), (base + 8, 16, 4)]]).layers[0]
    pieces = [bytes(buf[p + b * 16: p + b * 16 + 4]) for p in (0, 8) for b in (1, 2)]
    assert pieces_crc32(layer, [(1, 3, 2)], source=True) == zlib.crc32(b"".join(pieces))
    assert pieces_crc32(layer, [(3, 1, 2)], source=False) == zlib.crc32(b"".join(pieces))


# (planes of one layer, num_blocks, accepted?): the exact edges of the overlap check
OVERLAP_CASES = [
    ([(BASE, 16, 8), (BASE + 23, 32, 1)], 2, False),  # mixed strides, extents share one byte
    ([(BASE, 16, 8), (BASE + 24, 32, 8)], 2, True),  # mixed strides, extents touch
    ([(BASE + 40, 16, 8), (BASE, 32, 8)], 2, True),  # the same, the later plane first
    ([(BASE + 39, 16, 8), (BASE, 32, 8)], 2, False),
    ([(1 << 24, 16, 8), (BASE, 32, 8), (BASE + 4, 32, 8)], 2, False),  # a distant plane, then two that collide
    ([(BASE, 0, 8), (BASE + 4, 0, 8)], 1, False),  # one block each: pieces 4 bytes apart
    ([(BASE, 0, 8), (BASE + 8, 0, 8)], 1, True),
    ([(BASE, 16, 4), (BASE + 12, 16, 8)], 2, False),  # q's block j runs into p's block j+1
    ([(BASE, 16, 4), (BASE + 12, 16, 8)], 1, True),  # ... which one block does not have
    ([(BASE, 16, 4), (BASE + 44, 16, 8)], 4, False),  # ... or into p's block j+3
    ([(BASE, 16, 4), (BASE + 4, 16, 4), (BASE + 8, 16, 8)], 3, True),  # three planes, dense
]


@pytest.mark.parametrize("planes, num_blocks, ok", OVERLAP_CASES)
def test_overlapping_planes_are_refused_at_their_exact_edges(planes: list[tuple[int, int, int]], num_blocks: int,
                                                             ok: bool) -> None:
    if ok:
        assert KVLayout.from_regions(num_blocks, [planes]).layers[0].planes == tuple(
            kt.layout.Plane(*p) for p in planes)
    else:
        with pytest.raises(LayoutError, match="overlap"):
            KVLayout.from_regions(num_blocks, [planes])


class _FakeArray:
    """What _tensor_info reads of a numpy array."""

    def __init__(self, shape: tuple[int, ...], strides: tuple[int, ...], ptr: int = BASE) -> None:
        self.shape, self.strides, self.itemsize, self.dtype = shape, strides, 1, "uint8"
        self.__array_interface__ = {"data": (ptr, False)}


def test_tensor_descriptions_at_their_exact_edges() -> None:
    with pytest.raises(LayoutError, match="no storage"):
        KVLayout.from_tensors([_FakeArray((2, 8), (8, 1), ptr=0)])
    assert KVLayout.from_tensors([_FakeArray((2, 8), (8, 1), ptr=1)]).layers[0].planes[0].base == 1
    assert KVLayout.from_tensors([_FakeArray((1, 8), (0, 1))]).num_blocks == 1  # one block: its stride is moot
    with pytest.raises(LayoutError, match="block dimension has stride 0"):
        KVLayout.from_tensors([_FakeArray((2, 8), (0, 1))])
    one = KVLayout.from_tensors([_FakeArray((4, 1, 8), (8, 0, 1))])  # a size-1 dimension's stride is moot
    assert one.layers[0].planes == (kt.layout.Plane(BASE, 8, 8),)
    heads_outer = KVLayout.from_tensors([_FakeArray((64, 2, 8), (16, 8, 1))], block_dim=1)  # 64 planes: the limit
    assert len(heads_outer.layers[0].planes) == 64
    with pytest.raises(LayoutError, match="at most 64"):
        KVLayout.from_tensors([_FakeArray((65, 2, 8), (16, 8, 1))], block_dim=1)


def test_the_compatibility_signature_and_hash_are_stable() -> None:
    layout = KVLayout.from_tensors({"l0": _FakeArray((2, 4, 8), (32, 8, 1))})
    sig = '{"dtype": "uint8", "itemsize": 1, "order": [0, 1], "planes": [32], "shape": [4, 8]}'
    assert layout.layers[0].signature == sig
    assert layout.signature() == {"version": 1, "layers": [sig]}
    blob = json.dumps({"layers": [sig], "version": 1}, separators=(",", ":")).encode()
    assert layout.compat_hash() == __import__("hashlib").sha256(blob).hexdigest()[:32]
    assert layout.keepalive and layout.keepalive[0] is not None


def test_torch_tensors_give_their_device_dtype_and_any_block_dim_in_range() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(2, 4, 8, dtype=torch.bfloat16)
    layout = KVLayout.from_tensors([t])
    assert layout.device == "cpu" and '"dtype": "bfloat16"' in layout.layers[0].signature
    assert KVLayout.from_tensors([t], block_dim=-3).num_blocks == 2
    with pytest.raises(LayoutError, match="block_dim=3 out of range"):
        KVLayout.from_tensors([t], block_dim=3)
    with pytest.raises(LayoutError, match="block_dim=-4 out of range"):
        KVLayout.from_tensors([t], block_dim=-4)


def test_a_layout_from_the_wire_at_its_exact_edges() -> None:
    good = KVLayout.from_regions(1, [[(BASE, 0, 8)]]).to_wire()  # one block, stride 0
    layout = KVLayout.from_wire(good)
    assert (layout.num_blocks, layout.device, layout.layers[0].planes) == (1, "cpu", (kt.layout.Plane(BASE, 0, 8),))
    planes = [[BASE + 8 * i, 1024, 8] for i in range(64)]  # the most a layer may have
    many = {"num_blocks": 2, "device": "cpu", "layers": [{"name": "l", "sig": "s", "planes": planes}]}
    assert len(KVLayout.from_wire(many).layers[0].planes) == 64
    layer = good["layers"][0]
    for bad in ({**good, "device": 5}, {**good, "num_blocks": "1"}, {**good, "layers": {}},
                {**good, "layers": [{**layer, "name": 5}]}, {**good, "layers": [{**layer, "sig": 5}]}):
        with pytest.raises(LayoutError, match="malformed layout description from peer"):
            KVLayout.from_wire(bad)


def test_check_block_ids_refuses_the_first_id_past_the_end() -> None:
    layout = KVLayout.from_regions(4, [[(BASE, 8, 8)]])
    layout.check_block_ids([0, 3], "destination")
    with pytest.raises(InvalidBlockIds, match="destination block id 4 is beyond the layout"):
        layout.check_block_ids([4], "destination")


# ---------------------------------------------------------------------------------------------- wire


def test_abort_tokens_use_all_64_bits() -> None:
    for token in (0, 2**63, 2**64 - 1):
        assert wire.decode_abort(wire.encode_abort("r", token)) == ("r", token)


def test_error_reports_round_trip_with_their_message_and_an_empty_id_when_none() -> None:
    seq, exc = wire.decode_nack(wire.encode_error("r1", SlotsExhausted("full")))
    assert (seq, type(exc), str(exc)) == ("r1", SlotsExhausted, "peer reported: full")
    seq, exc = wire.decode_nack(wire.encode_error(None, TransferError("gone")))
    assert (seq, type(exc), str(exc)) == ("", TransferError, "peer reported: gone")



def test_metadata_bounds_are_exact() -> None:
    fields = {"instance": "i", "backend": "b", "host": "h", "port": 65535, "capacity": 1, "layout_hash": "x",
              "layout_signature": {}, "layout": {}, "transport": {}, "auth_required": False}
    data = wire.encode_metadata(fields)
    assert data == b"KVTM" + struct.pack("!H", wire.METADATA_VERSION) + json.dumps(
        fields, sort_keys=True, separators=(",", ":")).encode()
    assert wire.decode_metadata(data)["port"] == 65535
    assert wire.decode_metadata(wire.encode_metadata({**fields, "port": 1}))["port"] == 1
    for port in (0, 65536):
        with pytest.raises(ProtocolError, match="port"):
            wire.decode_metadata(wire.encode_metadata({**fields, "port": port}))
    with pytest.raises(kt.VersionMismatch, match="peer metadata version 65535,"):
        wire.decode_metadata(data[:4] + b"\xff\xff" + data[6:])
    with pytest.raises(ProtocolError, match=r"^malformed metadata: JSONDecodeError$"):
        wire.decode_metadata(data[:6])  # the header alone: six bytes are enough to be read as metadata
    padded = data[:6] + b" " * (wire.MAX_METADATA_BYTES - 6)  # exactly the limit: not refused for its size
    with pytest.raises(ProtocolError) as info:
        wire.decode_metadata(padded)
    assert "the limit is" not in str(info.value)


def test_a_frame_of_exactly_the_maximum_size_is_accepted() -> None:
    header = wire.FRAME_HEADER.pack(wire.FRAME_MAGIC, wire.FRAME_VERSION, int(wire.FrameType.PUT), 0,
                                    wire.MAX_FRAME_BYTES)
    assert wire.parse_header(header) == (wire.FrameType.PUT, wire.MAX_FRAME_BYTES)


def test_put_frames_at_their_exact_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wire.decode_put(wire.encode_put("r", 0, [])) == ("r", 0, [])  # a header and no run
    assert wire.decode_put(wire.encode_put("r", 0, [BlockRun(0, 0, 1)])) == ("r", 0, [BlockRun(0, 0, 1)])
    runs = [BlockRun(i, i, 1) for i in range(5)]
    payload = wire.encode_put("r", 1, runs)
    monkeypatch.setattr(wire, "MAX_RUNS_PER_PUT", 5)
    assert wire.decode_put(payload)[2] == runs
    monkeypatch.setattr(wire, "MAX_RUNS_PER_PUT", 4)
    with pytest.raises(ProtocolError):
        wire.decode_put(payload)


def test_put_layers_use_all_32_bits() -> None:
    runs = [BlockRun(1, 2, 3)]
    assert wire.decode_put(wire.encode_put("r", 2**32 - 1, runs)) == ("r", 2**32 - 1, runs)


def test_a_checksum_frame_too_short_for_its_crc_is_named_as_such() -> None:
    head = wire.encode_cancel("r")  # the sequence-id field
    for tail in (b"", b"\0\0\0"):
        with pytest.raises(ProtocolError, match=r"^truncated CHECKSUM frame$"):
            wire.decode_checksum(head + tail)
    with pytest.raises(ProtocolError) as info:  # a whole CRC: what is missing is the PUT part
        wire.decode_checksum(head + b"\0\0\0\0")
    assert "CHECKSUM" not in str(info.value)


def test_signal_encoding_is_exact_for_each_optional_part() -> None:
    head = wire.encode_cancel("r")
    assert wire.encode_signal("r", 3) == head + struct.pack("!i", 3)
    assert wire.encode_signal("r", None, 2**64 - 1) == head + struct.pack("!iQ", -1, 2**64 - 1)
    assert wire.decode_signal_full(wire.encode_signal("r", 1, 0, 5, 0)) == ("r", 1, 0, 5, 0)
    assert wire.decode_signal_full(wire.encode_signal("r", 1, 0, 0, 9)) == ("r", 1, 0, 0, 9)
    assert wire.decode_signal_full(wire.encode_signal("r", 1, 2**64 - 1, 1, 2)) == ("r", 1, 2**64 - 1, 1, 2)
    assert wire.decode_signal_full(wire.encode_signal("r", None, 5)) == ("r", None, 5, 0, 0)


def test_timeouts_at_their_exact_bounds() -> None:
    assert timeout_seconds(0, "t") == 0.0 and timeout_seconds(0.5, "t", zero_ok=False) == 0.5
    assert timeout_seconds(MAX_TIMEOUT_S, "t") == MAX_TIMEOUT_S
    with pytest.raises(kt.InvalidArgument, match=r"^t must be >= 0 seconds, got -1$"):
        timeout_seconds(-1, "t")
    with pytest.raises(kt.InvalidArgument, match=r"^t must be > 0 seconds, got 0$"):
        timeout_seconds(0, "t", zero_ok=False)


def test_an_error_report_without_a_message_and_a_nack_that_is_not_an_object() -> None:
    exc = wire.error_from_wire({"error": "SlotsExhausted"})
    assert (type(exc), str(exc)) == (SlotsExhausted, "peer reported: ")
    seq_field = wire.encode_cancel("r")
    with pytest.raises(ProtocolError, match=r"^malformed NACK: expected a JSON object$"):
        wire.decode_nack(seq_field + b"[1]")
    with pytest.raises(ProtocolError, match=r"^malformed NACK: JSONDecodeError$"):
        wire.decode_nack(seq_field + b"{")

# ---------------------------------------------------------------------------------------------- semaphores


def test_a_share_is_capacity_less_reserve_over_peers_exactly() -> None:
    t = SequenceTable(8, 1)  # reserve 2; two senders: a share of (8 - 2) // 2 = 3
    t.peers = 2
    for i in range(3):
        t.acquire(f"b{i}", peer="B", remote=True)
    for i in range(3):
        t.acquire(f"a{i}", peer="A", remote=True)  # 2 free now: the reserve
    with pytest.raises(SlotsExhausted, match="holds 3 of the receiver's 8"):
        t.acquire("b3", peer="B", remote=True)
    t5 = SequenceTable(5, 1)  # reserve 1; three senders: a share of 4 // 3 = 1
    t5.peers = 3
    for p in "ABC":
        t5.acquire(f"{p}0", peer=p, remote=True)
    t5.acquire("A1", peer="A", remote=True)  # 2 free before it: above the reserve
    with pytest.raises(SlotsExhausted, match="holds 1 of the receiver's 5"):
        t5.acquire("B1", peer="B", remote=True)
    t5.acquire("D0", peer="D", remote=True)  # a sender holding nothing is below its share


def test_released_slots_are_reused_lowest_first_and_tombstones_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtransport import semaphores

    monkeypatch.setattr(semaphores, "TOMBSTONES", 3)
    t = SequenceTable(4, 2)
    slots = [t.acquire(f"s{i}", peer="A", remote=True) for i in range(4)]
    assert [st.slot for st in slots if st is not None] == [0, 1, 2, 3]
    t.release("s2")
    t.release("s0")
    assert t.acquire("n0").slot == 0 and t.acquire("n1").slot == 2  # type: ignore[union-attr]
    t.release("s1")
    t.release("s3")  # tombstones: s2, s0, s1 -> s0, s1, s3 (the oldest goes)
    assert t.acquire("s2", remote=True) is not None  # forgotten: a new sequence
    assert t.acquire("s0", remote=True) is None and t.acquire("s3", remote=True) is None


def test_a_share_rounds_the_reserve_down_first() -> None:
    t = SequenceTable(7, 1)  # reserve 1; two senders: a share of (7 - 1) // 2 = 3
    t.peers = 2
    for i in range(2):
        t.acquire(f"b{i}", peer="B", remote=True)
    for i in range(4):
        t.acquire(f"a{i}", peer="A", remote=True)  # 1 free: the reserve
    t.acquire("b2", peer="B", remote=True)  # B holds 2, below its share


def test_claiming_an_existing_slot_records_its_owner_and_count() -> None:
    t = SequenceTable(8, 1)
    t.acquire("y", peer="A", remote=True)
    st = t.acquire("x")  # claimed here first (a wait), its sender not known yet
    assert st is not None and (st.peer, st.generation) == (None, 1)
    assert t.acquire("x", peer="A", remote=True) is st
    assert (st.peer, t._held) == ("A", {"A": 2})
    with pytest.raises(ForeignSequence):
        t.acquire("x", peer="B", remote=True)


def test_holdings_follow_releases_exactly() -> None:
    t = SequenceTable(8, 1)
    t.peers = 2
    for i in range(3):
        t.acquire(f"a{i}", peer="A", remote=True)
    t.release("a0")
    assert t._held == {"A": 2}
    t.release("a1")
    t.release("a2")
    assert t._held == {}
    with pytest.raises(SequenceAborted, match=r"^sequence 'x' was released before it completed$"):
        t.acquire("x")
        threading.Timer(0.05, t.release, args=("x",)).start()
        t.wait("x", timeout=5)


def test_a_wait_names_what_did_not_land_and_its_layer_bound() -> None:
    t = SequenceTable(2, 2)
    with pytest.raises(kt.TransferTimeout, match=r"^layer 1 of sequence 'q' did not land within"):
        t.wait_layer("q", 1, timeout=0.01)
    with pytest.raises(kt.TransferTimeout, match=r"^sequence 'q' did not land within"):
        t.wait("q", timeout=0.01)
    with pytest.raises(InvalidBlockIds, match=r"layer 2 out of range \[0, 2\)"):
        t.wait_layer("q", 2, timeout=0.01)


def test_a_batch_of_events_applies_those_after_a_refused_or_dropped_one() -> None:
    t = SequenceTable(4, 2)
    t.acquire("mine", peer="A", remote=True)
    t.acquire("gone", peer="B", remote=True)
    t.release("gone")  # later remote events for it are dropped
    refused = t.mark_many([("mine", None), ("gone", 0), ("x", 1), ("mine", 0)], peer="B")
    assert [(seq, layer, type(exc)) for seq, layer, exc in refused] == [("mine", None, ForeignSequence),
                                                                      ("mine", 0, ForeignSequence)]
    slot = t.get("x")
    assert slot is not None and slot.layers == {1} and slot.peer == "B"
    assert not t.get("mine").finished  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------- manager: PUT
# A two-sided receiver in one process: the inproc backend with one_sided off on the receiving manager, its
# inbound link recording what it is asked to receive or discard. The PUT frames are written straight onto the
# side channel, as a two-sided sender would.

SPEC2 = CacheSpec(num_layers=2, num_blocks=8, heads=1, block_size=2, head_dim=4, order="NHD")
TIMEOUT = 7.0


def _until(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = cond()
        if out:
            return out
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


@dataclasses.dataclass
class TwoSided:
    r: kt.CommManager
    calls: list[tuple[str, int, list[BlockRun], float]]
    opened: list[kt.CommManager]

    def sender(self) -> tuple[kt.CommManager, kt.Peer]:
        s = kt.open(HostCache(SPEC2, fill_seed=1).layout, backend="inproc")
        self.opened.append(s)
        return s, s.connect(self.r.metadata())

    def put(self, peer: kt.Peer, seq: str, layer: int, runs: list[BlockRun], expect: str | None) -> None:
        """Send one PUT frame; wait until the link was asked to ``expect`` (receive/discard) it."""
        n = len(self.calls)
        peer._state.conn.send(wire.FrameType.PUT, wire.encode_put(seq, layer, runs))
        if expect is not None:
            _until(lambda: len(self.calls) > n, f"the PUT of {seq!r}")
            assert self.calls[n] == (expect, layer, runs, TIMEOUT)
            assert len(self.calls) == n + 1


@pytest.fixture
def two_sided(monkeypatch: pytest.MonkeyPatch) -> Iterator[TwoSided]:
    calls: list[tuple[str, int, list[BlockRun], float]] = []
    monkeypatch.setattr(inproc._InLink, "receive", lambda self, layer, runs, timeout:
                        calls.append(("receive", layer, list(runs), timeout)), raising=False)
    monkeypatch.setattr(inproc._InLink, "discard", lambda self, layer, runs, timeout:
                        calls.append(("discard", layer, list(runs), timeout)), raising=False)
    r = kt.open(HostCache(SPEC2).layout, backend="inproc", timeout=TIMEOUT, capacity=2)
    r.capabilities = r._ctx.capabilities = dataclasses.replace(r.capabilities, one_sided=False)
    env = TwoSided(r, calls, [])
    try:
        yield env
    finally:
        for m in [*env.opened, r]:
            m.close()


def test_a_put_to_the_last_layer_and_block_is_received_and_counted(two_sided: TwoSided) -> None:
    s, peer = two_sided.sender()
    block_bytes = two_sided.r.layout.layers[1].block_bytes
    two_sided.put(peer, "a", 1, [BlockRun(6, 6, 2)], "receive")  # ends exactly at block 8 on both sides
    st = two_sided.r.stats()
    assert (st["puts_received"], st["bytes_received"]) == (1, 2 * block_bytes)
    two_sided.put(peer, "a", 0, [BlockRun(0, 7, 1)], "receive")
    st = two_sided.r.stats()
    assert (st["puts_received"], st["bytes_received"]) == (2, 3 * block_bytes)
    assert s.instance in two_sided.r.inbound_peers()


@pytest.mark.parametrize("layer, run", [(2, BlockRun(0, 0, 1)), (0, BlockRun(0, 7, 2)), (0, BlockRun(7, 0, 2))],
                         ids=["layer", "dst", "src"])
def test_a_put_one_past_the_layers_or_blocks_drops_the_link(two_sided: TwoSided, layer: int, run: BlockRun) -> None:
    s, peer = two_sided.sender()
    two_sided.put(peer, "a", layer, [run], None)
    _until(lambda: s.instance not in two_sided.r.inbound_peers(), "the link to drop")
    assert two_sided.calls == []


def _refused(s: kt.CommManager, peer: kt.Peer, seq: str) -> BaseException:
    """The error the sender's next signal for ``seq`` raises once the receiver's NACK arrived."""
    def attempt() -> BaseException | None:
        try:
            s.signal(peer, seq)
        except kt.KVTransportError as exc:
            return exc
        return None
    err: BaseException = _until(attempt, f"the NACK for {seq!r}")
    return err


def test_a_put_for_another_senders_sequence_is_discarded_and_refused(two_sided: TwoSided) -> None:
    _, peer = two_sided.sender()
    s2, peer2 = two_sided.sender()
    two_sided.put(peer, "x", 0, [BlockRun(0, 0, 1)], "receive")
    two_sided.put(peer2, "x", 0, [BlockRun(0, 1, 1)], "discard")
    _until(lambda: two_sided.r.stats()["foreign_refused"] == 1, "the refusal to be counted")
    assert isinstance(_refused(s2, peer2, "x"), ForeignSequence)


def test_a_put_for_a_released_sequence_is_discarded_and_the_sender_told(two_sided: TwoSided) -> None:
    s, peer = two_sided.sender()
    two_sided.put(peer, "d", 0, [BlockRun(0, 0, 1)], "receive")
    s.signal(peer, "d")
    two_sided.r.wait("d", timeout=10)
    two_sided.r.release("d")
    two_sided.put(peer, "d", 0, [BlockRun(0, 0, 1)], "discard")
    err = _refused(s, peer, "d")
    assert type(err) is TransferError and "was released by the receiver" in str(err), err


def test_a_put_beyond_the_slots_is_discarded_and_refused(two_sided: TwoSided) -> None:
    s, peer = two_sided.sender()
    two_sided.put(peer, "a", 0, [BlockRun(0, 0, 1)], "receive")
    two_sided.put(peer, "b", 0, [BlockRun(0, 1, 1)], "receive")
    two_sided.put(peer, "c", 0, [BlockRun(0, 2, 1)], "discard")  # capacity 2
    assert isinstance(_refused(s, peer, "c"), SlotsExhausted)


def test_a_put_for_a_finished_sequence_is_discarded_without_a_refusal(two_sided: TwoSided) -> None:
    s, peer = two_sided.sender()
    two_sided.put(peer, "f", 0, [BlockRun(0, 0, 1)], "receive")
    s.signal(peer, "f")
    two_sided.r.wait("f", timeout=10)
    two_sided.put(peer, "f", 1, [BlockRun(0, 0, 1)], "discard")
    s.flush(peer, timeout=10)
    assert two_sided.r.stats()["puts_received"] == 1
    time.sleep(0.2)  # a NACK would have reached the sender's reader by now
    assert "f" not in peer._state._failed  # nothing was refused


# ---------------------------------------------------------------------------------------------- manager: checksums


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[kt.CommManager, kt.CommManager, kt.Peer, HostCache]]:
    monkeypatch.setattr(receiving, "MAX_PENDING_CHECKSUMS", 8)
    src, dst = HostCache(SPEC2, fill_seed=3), HostCache(SPEC2)
    with kt.open(src.layout, backend="inproc", checksum=True) as s, \
            kt.open(dst.layout, backend="inproc", checksum=True) as r:
        yield s, r, s.connect(r.metadata()), dst


def test_each_layers_checksum_is_verified_at_that_layers_signal(checked: Any) -> None:
    s, r, peer, dst = checked
    s.put_layer(peer, "q", 0, [1], [2])
    s.put_layer(peer, "q", 1, [1], [2])
    s.flush(peer, timeout=10)
    byte = ctypes.c_uint8.from_address(dst.layout.layers[1].planes[0].address(2) + 3)
    byte.value ^= 0xFF  # layer 1 corrupted after it landed
    s.signal_layer(peer, "q", 0)
    r.wait_layer("q", 0, timeout=5)  # layer 0 is intact: only its own checksum is due
    s.signal_layer(peer, "q", 1)
    with pytest.raises(kt.TransferError, match=r"^integrity check failed for sequence 'q' layer 1: the bytes that "
                       r"landed differ from what was sent \(silent corruption on the path\)$"):
        r.wait_layer("q", 1, timeout=5)


def test_a_signal_without_checksums_while_others_wait_for_theirs(checked: Any) -> None:
    s, r, peer, _ = checked
    s.put_layer(peer, "a", 0, [1], [2])  # its checksum waits for a's signal
    s.signal(peer, "b")  # b put nothing
    r.wait("b", timeout=5)
    s.signal(peer, "a")
    r.wait("a", timeout=5)


def test_verified_checksums_leave_the_pending_count(checked: Any) -> None:
    s, r, peer, _ = checked
    for i in range(20):  # 20 checksums in all, never more than one pending (the bound is 8 here)
        s.put_layer(peer, f"v{i}", 0, [1], [i % 8])
        s.signal(peer, f"v{i}")
        r.wait(f"v{i}", timeout=5)
        r.release(f"v{i}")
    assert s.instance in r.inbound_peers()


def test_a_signal_does_not_forget_the_checksums_still_pending(checked: Any) -> None:
    s, r, peer, _ = checked
    for i in range(7):
        s.put_layer(peer, f"n{i}", 0, [1], [i])  # 7 pending, never signalled
    s.signal(peer, "b")
    r.wait("b", timeout=5)  # verifies b's (none): 7 still pending
    s.put_layer(peer, "n7", 0, [1], [7])
    s.put_layer(peer, "n8", 0, [1], [0])  # the 9th: beyond the bound of 8
    _until(lambda: s.instance not in r.inbound_peers(), "the link to drop")



def test_exactly_the_bound_of_pending_checksums_is_accepted(checked: Any) -> None:
    s, r, peer, _ = checked
    for i in range(8):
        s.put_layer(peer, f"n{i}", 0, [1], [i])  # 8 pending: the bound, not beyond it
    s.signal(peer, "b")
    r.wait("b", timeout=5)
    assert s.instance in r.inbound_peers()


# ---------------------------------------------------------------------------------------------- manager: frames


@pytest.fixture
def pair1() -> Iterator[tuple[kt.CommManager, kt.CommManager, kt.Peer]]:
    src, dst = HostCache(SPEC2, fill_seed=3), HostCache(SPEC2)
    with kt.open(src.layout, backend="inproc") as s, kt.open(dst.layout, backend="inproc", timeout=TIMEOUT) as r:
        yield s, r, s.connect(r.metadata())


def _still_served(s: kt.CommManager, r: kt.CommManager, peer: kt.Peer, seq: str) -> None:
    s.put_layer(peer, seq, 0, [1], [1])
    s.signal(peer, seq)
    r.wait(seq, timeout=5)
    assert s.instance in r.inbound_peers()


@pytest.mark.parametrize("layer, run", [(2, BlockRun(0, 0, 1)), (0, BlockRun(0, 7, 2))], ids=["layer", "dst"])
def test_a_checksum_frame_one_past_the_layout_drops_the_link(pair1: Any, layer: int, run: BlockRun) -> None:
    s, r, peer = pair1
    peer._state.conn.send(wire.FrameType.CHECKSUM, wire.encode_checksum("c", layer, 0, [run]))
    _until(lambda: s.instance not in r.inbound_peers(), "the link to drop")


def test_a_checksum_frame_at_the_last_layer_and_block_is_kept(pair1: Any) -> None:
    s, r, peer = pair1
    peer._state.conn.send(wire.FrameType.CHECKSUM, wire.encode_checksum("c", 1, 0, [BlockRun(0, 6, 2)]))
    _still_served(s, r, peer, "after")


def test_ping_is_answered_and_other_frames_from_a_connected_peer_drop_it(pair1: Any) -> None:
    s, r, peer = pair1
    peer._state.conn.send(wire.FrameType.PING)
    _still_served(s, r, peer, "after-ping")
    peer._state.conn.send(wire.FrameType.DOORBELL, b"{}")  # an offer without a path: ignored
    _still_served(s, r, peer, "after-doorbell")
    peer._state.conn.send(wire.FrameType.WELCOME, b"{}")
    _until(lambda: s.instance not in r.inbound_peers(), "the link to drop")


def test_a_malformed_doorbell_offer_drops_the_link_saying_so(pair1: Any, caplog: pytest.LogCaptureFixture) -> None:
    s, r, peer = pair1
    s.put_layer(peer, "inflight", 0, [1], [1])
    s.signal_layer(peer, "inflight", 0)
    r.wait_layer("inflight", 0, timeout=5)  # a sequence of this peer in flight: its loss is logged
    with caplog.at_level(logging.WARNING, logger="kvtransport"):
        peer._state.conn.send(wire.FrameType.DOORBELL, b"[]")
        _until(lambda: s.instance not in r.inbound_peers(), "the link to drop")
        _until(lambda: "malformed DOORBELL: expected a JSON object" in caplog.text, "the log line")


def test_a_cancel_fails_the_receivers_wait_even_before_it_waits(pair1: Any) -> None:
    s, r, peer = pair1
    s.cancel(peer, "early")
    s.flush(peer, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(SequenceAborted, match="cancelled by the sender"):
        r.wait("early", timeout=5)
    assert time.monotonic() - t0 < 2


def test_a_cancel_for_a_released_sequence_takes_no_slot(pair1: Any) -> None:
    s, r, peer = pair1
    _still_served(s, r, peer, "done")
    r.release("done")
    s.cancel(peer, "done")
    s.flush(peer, timeout=5)
    _still_served(s, r, peer, "next")
    r.release("next")
    assert r.stats()["slots_in_use"] == 0


def test_a_cancel_from_another_sender_is_refused_and_changes_nothing(pair1: Any) -> None:
    s, r, peer = pair1
    s.put_layer(peer, "owned", 0, [1], [1])
    s.signal_layer(peer, "owned", 0)
    r.wait_layer("owned", 0, timeout=5)
    with kt.open(HostCache(SPEC2).layout, backend="inproc") as s2:
        peer2 = s2.connect(r.metadata())
        s2.cancel(peer2, "owned")
        _until(lambda: r.stats()["foreign_refused"] == 1, "the refusal to be counted")
        s.signal(peer, "owned")
        r.wait("owned", timeout=5)  # not cancelled
        # the NACK names the sequence: s2's own record of it comes to carry ForeignSequence, not only its cancel
        _until(lambda: isinstance(peer2._state._failed.get("owned"), ForeignSequence), "the NACK at the sender")


def test_a_two_sided_receiver_takes_control_frames_as_themselves(two_sided: TwoSided) -> None:
    s, peer = two_sided.sender()
    two_sided.put(peer, "a", 0, [BlockRun(0, 0, 1)], "receive")
    s.cancel(peer, "a")
    with pytest.raises(SequenceAborted, match="cancelled by the sender"):
        two_sided.r.wait("a", timeout=5)
    two_sided.put(peer, "b", 0, [BlockRun(0, 1, 1)], "receive")


def test_a_signal_one_past_the_layers_drops_the_link(pair1: Any) -> None:
    s, r, peer = pair1
    peer._state.conn.send(wire.FrameType.SIGNAL, wire.encode_signal("a", 1))  # the last layer: fine
    r.wait_layer("a", 1, timeout=5)
    peer._state.conn.send(wire.FrameType.SIGNAL, wire.encode_signal("a", 2))
    _until(lambda: s.instance not in r.inbound_peers(), "the link to drop")


def test_one_sided_receivers_count_what_the_signals_report(pair1: Any) -> None:
    s, r, peer = pair1
    block_bytes = r.layout.layers[0].block_bytes
    s.put_layer(peer, "a", 0, [1, 2], [3, 4])
    s.put_layer(peer, "a", 1, [5], [6])
    s.signal(peer, "a")
    r.wait("a", timeout=5)
    assert (r.stats()["puts_received"], r.stats()["bytes_received"]) == (2, 3 * block_bytes)
    s.put_layer(peer, "b", 0, [1], [1])
    s.signal(peer, "b")
    r.wait("b", timeout=5)
    assert (r.stats()["puts_received"], r.stats()["bytes_received"]) == (3, 4 * block_bytes)
    peer._state.conn.send(wire.FrameType.SIGNAL, wire.encode_signal("c", None, 0, 5, 0))  # puts, no bytes
    r.wait("c", timeout=5)
    assert (r.stats()["puts_received"], r.stats()["bytes_received"]) == (8, 4 * block_bytes)


def test_two_sided_receivers_count_puts_themselves_not_from_signals(two_sided: TwoSided) -> None:
    _s, peer = two_sided.sender()
    peer._state.conn.send(wire.FrameType.SIGNAL, wire.encode_signal("c", None, 0, 5, 100))
    two_sided.r.wait("c", timeout=5)
    assert (two_sided.r.stats()["puts_received"], two_sided.r.stats()["bytes_received"]) == (0, 0)


def test_every_signal_of_a_batch_is_applied_before_the_next_frame(pair1: Any) -> None:
    _s, r, peer = pair1
    peer._state.conn.send_many([(wire.FrameType.SIGNAL, wire.encode_signal(f"m{i}", None)) for i in range(4)]
                               + [(wire.FrameType.CANCEL, wire.encode_cancel("m3"))])
    for i in range(4):  # m3 completed before its cancel came: a cancel changes nothing finished
        r.wait(f"m{i}", timeout=5)


def test_a_signal_for_another_senders_sequence_is_refused(pair1: Any) -> None:
    s, r, peer = pair1
    r.expect("owned", sender=s.instance)
    with kt.open(HostCache(SPEC2).layout, backend="inproc") as s2:
        peer2 = s2.connect(r.metadata())
        s2.signal(peer2, "owned")
        _until(lambda: r.stats()["foreign_refused"] == 1, "the refusal to be counted")
        with pytest.raises(kt.TransferTimeout):
            r.wait("owned", timeout=0.2)
    s.signal(peer, "owned")
    r.wait("owned", timeout=5)


# ---------------------------------------------------------------------------------------------- manager: doorbell


# The doorbell's own scenarios (tests/test_doorbell.py: a host-memory stand-in for the device's store) are run
# here too, as the receiver's de-duplication of doorbell and SIGNAL frame is one of the checks mutated.
doorbell_tests: Any = test_doorbell  # (untyped)
bell_pair = test_doorbell.bell_pair


def test_doorbell_completion_before_the_frame_counts_once(bell_pair: Any) -> None:
    doorbell_tests.test_a_receiver_sees_completion_by_doorbell_before_the_frame(bell_pair)


def test_doorbell_layer_signals_and_many_requests(bell_pair: Any) -> None:
    doorbell_tests.test_layer_signals_by_doorbell_and_many_requests(bell_pair)


def test_doorbell_store_that_fails_leaves_frames_to_carry_the_signals(bell_pair: Any,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    doorbell_tests.test_a_failed_doorbell_store_leaves_no_waiter_spinning(bell_pair, monkeypatch)


class _Bell:
    def __init__(self, landed: list[tuple[str, int | None]], in_flight: bool) -> None:
        self._landed, self._in_flight = landed, in_flight

    def landed(self) -> list[tuple[str, int | None]]:
        out, self._landed = self._landed, []
        return out

    def in_flight(self) -> bool:
        return self._in_flight


def _inbound(bell: _Bell | None, apply: Callable[[list[Any]], None]) -> Any:
    ib: Any = receiving.Inbound.__new__(receiving.Inbound)  # only what poll_bell reads
    ib.ctx = type("Ctx", (), {"layout": KVLayout.from_regions(1, [[(BASE, 8, 8)], [(2 * BASE, 8, 8)]]),
                              "counters": Counters()})()
    ib.bell, ib.bell_lock, ib.peer = bell, threading.Lock(), "p"
    ib._apply = apply
    return ib


def test_the_doorbell_poll_applies_valid_layers_and_says_what_it_saw() -> None:
    applied: list[list[Any]] = []
    assert _inbound(None, applied.append).poll_bell() == 0
    assert _inbound(_Bell([], in_flight=True), applied.append).poll_bell() == 1  # copies still running
    assert _inbound(_Bell([], in_flight=False), applied.append).poll_bell() == 0
    # only layers the peer may name pass (0 <= layer < 2, or None for the whole sequence): nothing here
    assert _inbound(_Bell([("a", 2), ("a", -1)], in_flight=True), applied.append).poll_bell() == 0
    assert applied == []
    ib = _inbound(_Bell([("a", None), ("a", 0), ("a", 1), ("a", 2), ("a", -1)], in_flight=True), applied.append)
    assert ib.poll_bell() == 2
    assert applied == [[("a", None), ("a", 0), ("a", 1)]]
    ib.bell = _Bell([("b", 1)], in_flight=False)
    assert ib.poll_bell() == 2
    assert ib.ctx.counters.stats.doorbell_signals == 4


def test_a_doorbell_poll_whose_nack_cannot_be_sent_still_reports_what_it_applied() -> None:
    def failing(events: list[Any]) -> None:
        raise PeerDisconnected("gone")

    assert _inbound(_Bell([("a", 0)], in_flight=False), failing).poll_bell() == 2



def test_json_payloads_are_compact_and_sorted() -> None:
    assert wire.json_payload({"b": 1, "a": [1, 2]}) == b'{"a":[1,2],"b":1}'


# ---------------------------------------------------------------------------------------------- manager: handshake


def _raw_hello(r: kt.CommManager, body: Any, *, secret: bytes | None = None, auth: str | None = None,
               payload: bytes | None = None) -> tuple[wire.FrameType, Any]:
    """Connect to ``r``'s side channel by hand, send one HELLO and return the reply (kind, JSON)."""
    meta = wire.decode_metadata(r.metadata(), secret)
    conn = FramedSocket(socket.create_connection((meta["host"], meta["port"]), timeout=5), "test", 5.0)
    try:
        kind, raw = conn.recv(time.monotonic() + 5)
        assert kind == wire.FrameType.CHALLENGE
        nonce = bytes.fromhex(wire.parse_json_payload(raw, "CHALLENGE")["nonce"])
        text = body if isinstance(body, str) else json.dumps(body)
        if secret is not None and auth is None:
            auth = wire.auth_tag(secret, nonce, text.encode())
        conn.send(wire.FrameType.HELLO, payload if payload is not None else
                  wire.json_payload({"body": text, "auth": auth}))
        kind, raw = conn.recv(time.monotonic() + 5)
        return kind, json.loads(raw)
    finally:
        conn.close()


def _refusal(message: str) -> tuple[wire.FrameType, dict[str, str]]:
    return wire.FrameType.REFUSE, {"error": "ProtocolError", "message": message}


def test_a_raw_peers_malformed_hellos_are_refused_with_their_exact_reason(pair1: Any) -> None:
    _, r, _ = pair1
    assert _raw_hello(r, None, payload=b"[]") == _refusal("malformed HELLO: expected a JSON object")
    assert _raw_hello(r, "[]") == _refusal("malformed HELLO body: expected a JSON object")
    assert _raw_hello(r, {"metadata": {}, "request": 5}) == _refusal("HELLO body lacks metadata/request")


def test_hellos_without_the_secret_are_counted_and_a_hello_without_a_nonce_refused() -> None:
    secret = b"k" * 16
    with kt.open(HostCache(SPEC2).layout, backend="inproc", secret=secret) as r, \
            kt.open(HostCache(SPEC2).layout, backend="inproc", secret=secret) as s:
        for _ in range(2):
            kind, reply = _raw_hello(r, "{}", secret=secret, auth="00" * 32)
            assert kind == wire.FrameType.REFUSE and "authentication failed" in reply["message"]
        assert r.stats()["refused_peers"] == 2
        body: dict[str, Any] = {"metadata": s._metadata_fields(), "request": {"pid": os.getpid()}}  # no "nonce"
        assert _raw_hello(r, body, secret=secret) == _refusal("HELLO without a nonce of 16 bytes or more")
        body["nonce"] = "zz"
        assert _raw_hello(r, body, secret=secret) == _refusal("malformed HELLO: its nonce is not hex")


def test_a_receiver_refusing_before_its_backend_answers_tells_the_sender_why(
        pair1: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, r, _ = pair1

    def refuse(meta: dict[str, Any]) -> None:
        raise kt.IncompatiblePeer("refused for the test")

    monkeypatch.setattr(r._ctx, "check_compatible", refuse)
    with kt.open(HostCache(SPEC2).layout, backend="inproc") as s2, \
            pytest.raises(kt.IncompatiblePeer, match="refused for the test"):
        s2.connect(r.metadata())


def test_the_receiver_counts_its_connected_senders_and_names_their_threads(pair1: Any) -> None:
    _, r, _ = pair1
    assert r._table.peers == 1
    assert [t.name[:7] for t in r._threads if t.is_alive()] == ["kvt-in-"]
    with kt.open(HostCache(SPEC2).layout, backend="inproc") as s2:
        s2.connect(r.metadata())
        _until(lambda: r._table.peers == 2, "two senders counted")


def test_a_sender_alone_may_use_every_slot() -> None:
    with kt.open(HostCache(SPEC2).layout, backend="inproc", capacity=4) as r, \
            kt.open(HostCache(SPEC2).layout, backend="inproc") as s:
        peer = s.connect(r.metadata())
        for i in range(4):
            s.signal(peer, f"q{i}")
        for i in range(4):
            r.wait(f"q{i}", timeout=5)


def test_the_bound_on_connected_senders_is_exact(pair1: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _, r, _ = pair1
    monkeypatch.setattr(receiving, "MAX_INBOUND", 1)
    with kt.open(HostCache(SPEC2).layout, backend="inproc") as s2, \
            pytest.raises(ProtocolError, match="already serves 1 senders"):
        s2.connect(r.metadata())


def test_with_every_handshake_slot_busy_hellos_wait_and_admission_still_refuses() -> None:
    done: list[Any] = []
    with kt.open(HostCache(SPEC2).layout, backend="inproc") as r, \
            kt.open(HostCache(SPEC2).layout, backend="inproc") as s2:
        r._receiver.handshakes = threading.BoundedSemaphore(1)  # (no handshake has run on this receiver yet)
        r._receiver.handshakes.acquire()  # the only slot, held
        t = threading.Thread(target=lambda: done.append(s2.connect(r.metadata(), timeout=15)), daemon=True)
        t.start()
        time.sleep(0.3)
        assert not done, "a HELLO was served without a handshake slot"
        t0 = time.monotonic()  # the admission thread is not blocked by the waiting HELLO
        assert _raw_hello(r, None, payload=b"[]") == _refusal("malformed HELLO: expected a JSON object")
        assert time.monotonic() - t0 < 5
        r._receiver.handshakes.release()
        t.join(15)
        assert done and s2.instance in r.inbound_peers()


def test_a_receiver_that_drops_a_link_fails_its_sequences_saying_why(pair1: Any) -> None:
    s, r, peer = pair1
    s.put_layer(peer, "inflight", 0, [1], [1])
    s.signal_layer(peer, "inflight", 0)
    r.wait_layer("inflight", 0, timeout=5)
    peer._state.conn.send(wire.FrameType.SIGNAL, wire.encode_signal("inflight", 2))
    with pytest.raises(PeerDisconnected, match=rf"^peer {s.instance} lost: SIGNAL for layer 2 beyond"):
        r.wait("inflight", timeout=5)
    assert r.stats()["failures"] == 1


def test_a_receiver_thread_that_crashes_fails_its_senders_sequences(pair1: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    s, r, peer = pair1
    s.put_layer(peer, "inflight", 0, [1], [1])
    s.signal_layer(peer, "inflight", 0)
    r.wait_layer("inflight", 0, timeout=5)

    def crash(self: Any, kind: Any, payload: bytes, two_sided: bool) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(receiving.Inbound, "_on_frame", crash)
    peer._state.conn.send(wire.FrameType.PING)
    with pytest.raises(PeerDisconnected, match=r"^receiver error: boom$"):
        r.wait("inflight", timeout=5)
