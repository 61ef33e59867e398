"""Wire format: round trips, and fuzzing of every decoder (typed errors only, never a crash)."""

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransport import BlockRun, ProtocolError, VersionMismatch, wire


def test_signal_tickets_round_trip_and_old_signals_decode():
    assert wire.decode_signal_ticket(wire.encode_signal("r", 3, 77)) == ("r", 3, 77)
    assert wire.decode_signal_ticket(wire.encode_signal("r", None)) == ("r", None, 0)
    assert wire.decode_signal(wire.encode_signal(5, None, 9)) == (5, None)


def test_put_and_signal_round_trip():
    runs = [BlockRun(1, 2, 3), BlockRun(10, 0, 1)]
    assert wire.decode_put(wire.encode_put("req-1", 5, runs)) == ("req-1", 5, runs)
    assert wire.decode_signal(wire.encode_signal(42, None)) == (42, None)
    assert wire.decode_signal(wire.encode_signal("x", 3)) == ("x", 3)


def test_metadata_round_trip_and_version():
    fields = {k: (v() if v is not bool else False) for k, v in
              {"instance": str, "backend": str, "host": str, "capacity": int, "layout_hash": str,
               "layout_signature": dict, "layout": dict, "transport": dict, "auth_required": bool}.items()}
    fields.update(port=1234, capacity=4)
    data = wire.encode_metadata(fields)
    assert wire.decode_metadata(data) == fields
    with pytest.raises(VersionMismatch, match="same kvtransport version"):
        wire.decode_metadata(data[:4] + struct.pack("!H", 99) + data[6:])
    with pytest.raises(ProtocolError, match="bad magic"):
        wire.decode_metadata(b"pickle" + data)
    with pytest.raises(ProtocolError, match="port"):
        wire.decode_metadata(wire.encode_metadata({**fields, "port": 0}))
    with pytest.raises(ProtocolError, match="auth_required"):
        wire.decode_metadata(wire.encode_metadata({**fields, "auth_required": 1}))


def test_frame_header_checks():
    good = wire.frame(wire.FrameType.PING)
    assert wire.parse_header(good[: wire.FRAME_HEADER.size]) == (wire.FrameType.PING, 0)
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.parse_header(wire.FRAME_HEADER.pack(b"KVTF", 1, 5, 0, wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(VersionMismatch):
        wire.parse_header(wire.FRAME_HEADER.pack(b"KVTF", 9, 5, 0, 0))
    with pytest.raises(ProtocolError, match="unknown frame type"):
        wire.parse_header(wire.FRAME_HEADER.pack(b"KVTF", 1, 200, 0, 0))


def test_error_reports_never_instantiate_arbitrary_types():
    exc = wire.error_from_wire({"error": "SystemExit", "message": "x"})
    assert type(exc).__name__ == "TransferError"
    assert type(wire.error_from_wire({"error": "SlotsExhausted", "message": "full"})).__name__ == "SlotsExhausted"


DECODERS = [wire.decode_metadata, wire.decode_put, wire.decode_signal_ticket, wire.decode_nack,
            lambda b: wire.parse_header(b[: wire.FRAME_HEADER.size].ljust(wire.FRAME_HEADER.size, b"\0"))]


def _mutations():
    seeds = [
        wire.encode_put("r", 1, [BlockRun(1, 2, 3)]),
        wire.encode_signal("abc", 2),
        wire.encode_metadata({"instance": "i", "backend": "b", "host": "h", "port": 1, "capacity": 1,
                              "layout_hash": "x", "layout_signature": {}, "layout": {}, "transport": {},
                              "auth_required": False}),
        wire.frame(wire.FrameType.HELLO, b"{}"),
    ]
    return st.one_of(
        st.binary(max_size=300),
        st.tuples(st.sampled_from(seeds), st.integers(0, 400), st.binary(max_size=8)).map(
            lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + len(t[2]):]),
        st.tuples(st.sampled_from(seeds), st.integers(0, 400)).map(lambda t: t[0][: t[1]]),
        st.sampled_from([b"KVTM\x00\x01" + json.dumps(x).encode() for x in ([], 1, "s", None, {"a": [1] * 3})]),
        st.just(b"KVTM\x00\x01" + b"[" * 100000),
    )


@settings(max_examples=2500)
@given(_mutations())
def test_decoders_fuzzed(data):
    """>= 10,000 generated inputs in total (2,500 x 5 decoders): only typed errors come out."""
    for dec in DECODERS:
        try:
            dec(data)
        except ProtocolError:
            pass


def test_secret_hmac():
    tag = wire.auth_tag(b"s3cret", b"nonce", b"body")
    assert wire.auth_ok(b"s3cret", b"nonce", b"body", tag)
    assert not wire.auth_ok(b"other", b"nonce", b"body", tag)
    assert not wire.auth_ok(b"s3cret", b"nonce", b"body", None)
