"""Every decoder of peer input, fuzzed with *structured* frames (valid framing, hostile values) as well as bytes:
what a decoder accepts must be within its documented bounds, not merely "no other exception". A decoder that
lost a bound (a run count below 1, a sequence id longer than the wire allows, a layout without blocks ...)
fails here."""

from __future__ import annotations

import json
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport import KVLayout, KVTransportError, LayoutError, ProtocolError, wire
from kvtransport.layout import MAX_PLANES_PER_LAYER

I64 = st.integers(-(2**63), 2**63 - 1)
SMALL = st.integers(-3, 6)


@st.composite
def seq_field(draw: Any) -> bytes:
    """A sequence-id field: a length and a JSON text (a str or int as the wire wants, or something else), the
    length right or wrong."""
    value = draw(st.one_of(st.text(max_size=40), st.text(alphabet="ab", min_size=1000, max_size=1100),
                           st.integers(-(2**70), 2**70), st.booleans(), st.none(),
                           st.floats(allow_nan=False), st.lists(st.integers(), max_size=2)))
    raw = json.dumps(value).encode()
    n = draw(st.one_of(st.just(len(raw)), st.integers(0, 0xFFFF)))
    return struct.pack("!H", n) + raw[: max(0, n)]


@st.composite
def put_payload(draw: Any) -> bytes:
    runs = draw(st.lists(st.tuples(st.one_of(SMALL, I64), st.one_of(SMALL, I64), st.one_of(SMALL, I64)),
                         max_size=6))
    nruns = draw(st.one_of(st.just(len(runs)), st.integers(0, 2**32 - 1)))
    layer = draw(st.integers(0, 2**32 - 1))
    body = b"".join(struct.pack("!qqq", *r) for r in runs)
    return draw(seq_field()) + struct.pack("!II", layer, nruns) + body


@st.composite
def signal_payload(draw: Any) -> bytes:
    tail = draw(st.one_of(st.just(b""), st.binary(min_size=8, max_size=8), st.binary(min_size=20, max_size=20),
                          st.binary(max_size=24)))
    layer = draw(st.one_of(st.integers(-10, 10), st.integers(-(2**31), 2**31 - 1)))
    return draw(seq_field()) + struct.pack("!i", layer) + tail


@st.composite
def checksum_payload(draw: Any) -> bytes:
    put = draw(put_payload())
    (n,) = struct.unpack_from("!H", put, 0)
    cut = min(len(put), 2 + n)
    return put[:cut] + struct.pack("!I", draw(st.integers(0, 2**32 - 1))) + put[cut:]


def _check_seq(seq: Any) -> None:
    assert type(seq) in (str, int), seq
    assert len(json.dumps(seq).encode()) <= wire.MAX_SEQ_ID_BYTES


@settings(max_examples=1500)
@given(put_payload())
def test_put_decoder_accepts_only_runs_within_bounds(payload: bytes) -> None:
    try:
        seq, layer, runs = wire.decode_put(payload)
    except ProtocolError:
        return
    _check_seq(seq)
    assert 0 <= layer < 2**32 and len(runs) <= wire.MAX_RUNS_PER_PUT
    assert all(r.src >= 0 and r.dst >= 0 and r.count >= 1 for r in runs), runs


@settings(max_examples=800)
@given(checksum_payload())
def test_checksum_decoder_accepts_only_runs_within_bounds(payload: bytes) -> None:
    try:
        seq, layer, crc, runs = wire.decode_checksum(payload)
    except ProtocolError:
        return
    _check_seq(seq)
    assert 0 <= crc < 2**32 and 0 <= layer < 2**32
    assert all(r.src >= 0 and r.dst >= 0 and r.count >= 1 for r in runs), runs


@settings(max_examples=1000)
@given(signal_payload())
def test_signal_decoder_accepts_only_valid_layers_and_counts(payload: bytes) -> None:
    try:
        seq, layer, ticket, puts, nbytes = wire.decode_signal_full(payload)
    except ProtocolError:
        return
    _check_seq(seq)
    assert layer is None or layer >= 0
    assert ticket >= 0 and puts >= 0 and nbytes >= 0


@settings(max_examples=500)
@given(seq_field(), st.binary(max_size=12))
def test_abort_cancel_and_nack_decoders(seq: bytes, tail: bytes) -> None:
    for decode, payload in ((wire.decode_abort, seq + tail), (wire.decode_cancel, seq + tail[:0]),
                            (wire.decode_nack, seq + b'{"error":"SlotsExhausted","message":"x"}')):
        try:
            out = decode(payload)
        except ProtocolError:
            continue
        if decode is wire.decode_cancel:
            _check_seq(out)
        else:
            _check_seq(out[0])
        if decode is wire.decode_abort:
            assert 0 <= out[1] < 2**64
        if decode is wire.decode_nack:
            assert isinstance(out[1], KVTransportError)


@settings(max_examples=500)
@given(st.integers(0, 255), st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 2**32 - 1),
       st.sampled_from([wire.FRAME_MAGIC, b"KVTX", b"\0\0\0\0"]))
def test_frame_headers_accept_only_known_types_within_the_size_bound(version: int, kind: int, reserved: int,
                                                                     length: int, magic: bytes) -> None:
    header = wire.FRAME_HEADER.pack(magic, version, kind, reserved, length)
    try:
        ftype, n = wire.parse_header(header)
    except ProtocolError:
        return
    assert magic == wire.FRAME_MAGIC and version == wire.FRAME_VERSION and reserved == 0
    assert ftype in set(wire.FrameType) and 0 <= n <= wire.MAX_FRAME_BYTES


FIELD_VALUES = st.one_of(st.integers(-2, 70000), st.text(max_size=4), st.booleans(), st.none(),
                         st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.lists(st.integers()))


@settings(max_examples=800)
@given(st.dictionaries(st.sampled_from(sorted(wire.REQUIRED_METADATA)), FIELD_VALUES))
def test_metadata_decoder_accepts_only_typed_in_range_fields(fields: dict[str, Any]) -> None:
    try:
        meta = wire.decode_metadata(wire.encode_metadata(fields))
    except ProtocolError:
        return
    for key, typ in wire.REQUIRED_METADATA.items():
        assert isinstance(meta[key], typ) and (isinstance(meta[key], bool) is (typ is bool))
    assert 0 < meta["port"] < 65536 and meta["capacity"] >= 1


PLANE = st.one_of(st.lists(st.integers(0, 5), min_size=3, max_size=3),  # mostly well-formed, some not
                  st.lists(st.integers(-3, 5), min_size=3, max_size=3), st.lists(st.integers(0, 5), max_size=4))
ACCEPTED: list[int] = []


@settings(max_examples=800)
@given(st.integers(-2, 4), st.lists(st.fixed_dictionaries({"name": st.text(max_size=3), "sig": st.text(max_size=3),
                                                           "planes": st.one_of(st.lists(PLANE, max_size=3),
                                                                               st.lists(PLANE, min_size=60, max_size=66))}),
                                    max_size=3))
def test_layouts_from_the_wire_have_blocks_layers_and_non_negative_planes(num_blocks: int, layers: list[Any]) -> None:
    try:
        layout = KVLayout.from_wire({"num_blocks": num_blocks, "device": "cpu", "layers": layers})
    except LayoutError:
        return
    ACCEPTED.append(1)
    assert layout.num_blocks >= 1 and layout.num_layers >= 1
    for layer in layout.layers:
        assert 1 <= len(layer.planes) <= MAX_PLANES_PER_LAYER
        assert all(min(p.base, p.block_stride, p.piece_bytes) >= 0 for p in layer.planes), layer.planes


def test_the_layout_fuzzing_reached_accepted_layouts() -> None:
    """(Runs after the fuzzing above: its assertions on accepted layouts ran, not only the rejections.)"""
    if not ACCEPTED:
        test_layouts_from_the_wire_have_blocks_layers_and_non_negative_planes()
    assert len(ACCEPTED) >= 20, len(ACCEPTED)
