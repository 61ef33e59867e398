"""Careless callers: every public CommManager method gets random argument types and values (hypothesis).
Only kvtransport's documented errors may come out, nothing may hang, and afterwards a transfer on the same
link still verifies byte for byte. Run over the in-process reference backend and the real ucx and nccl
(gloo) backends, sender and receiver in this process."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvtransport as kt
from kvtransport import checks
from kvtransport.workload.caches import CacheSpec, HostCache

SPEC = CacheSpec(num_layers=3, num_blocks=16, heads=2, block_size=4, head_dim=8, order="NHD")

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.binary(max_size=48), st.lists(st.integers(-3, 40), max_size=6),
    st.lists(st.floats(allow_nan=True), max_size=3), st.lists(st.booleans(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.tuples(st.integers(0, 20)),
    st.just(object()), st.just(b"\x00" * 2000), st.just("x" * 2000), st.just(range(3)),
)
SEQS = st.one_of(st.sampled_from(["a", "b", 7, 0, -1, "final-not"]), JUNK)
LAYERS = st.one_of(st.integers(-2, 4), st.sampled_from([0.0, 1.5, True, False, "1", None, math.nan]), JUNK)
IDS = st.one_of(st.lists(st.integers(-2, 18), max_size=5), JUNK)
# a timeout either invalid, or valid and short (a valid long one would only make the test slow)
TIMEOUTS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1, -1e-9, checks.MAX_TIMEOUT_S * 2, 1e30, "1", None, True]),
    st.floats(0, 0.003), JUNK.filter(lambda v: not isinstance(v, int | float) or isinstance(v, bool)),
)


def _call(cm_s: kt.CommManager, cm_r: kt.CommManager, peer: kt.Peer, name: str, args: list[Any]) -> None:
    """One call with (possibly) junk arguments; ``peer`` stands in where the first argument is a valid peer."""
    target = {"put_layer": cm_s, "put_layers": cm_s, "signal_layer": cm_s, "signal": cm_s, "flush": cm_s,
              "cancel": cm_s, "connect": cm_s, "disconnect": cm_s}.get(name, cm_r)
    fn = getattr(target, name)
    if name in ("flush", "connect"):
        fn(*args[:-1], timeout=args[-1])
    elif name in ("wait", "wait_layer", "abort"):
        fn(*args[:-1], timeout=args[-1])
    elif name == "expect":
        fn(args[0], sender=args[1])
    else:
        fn(*args)


CALLS = st.one_of(
    st.tuples(st.just("put_layer"), st.tuples(st.just("PEER") | JUNK, SEQS, LAYERS, IDS, IDS)),
    st.tuples(st.just("put_layers"), st.tuples(st.just("PEER") | JUNK, SEQS, st.none() | LAYERS | st.lists(LAYERS, max_size=3), IDS, IDS)),
    st.tuples(st.just("signal_layer"), st.tuples(st.just("PEER") | JUNK, SEQS, LAYERS)),
    st.tuples(st.just("signal"), st.tuples(st.just("PEER") | JUNK, SEQS)),
    st.tuples(st.just("flush"), st.tuples(st.just("PEER") | JUNK, TIMEOUTS)),
    st.tuples(st.just("cancel"), st.tuples(st.just("PEER") | JUNK, SEQS)),
    st.tuples(st.just("connect"), st.tuples(JUNK, TIMEOUTS)),
    st.tuples(st.just("disconnect"), st.tuples(JUNK)),
    st.tuples(st.just("wait"), st.tuples(SEQS, TIMEOUTS)),
    st.tuples(st.just("wait_layer"), st.tuples(SEQS, LAYERS, TIMEOUTS)),
    st.tuples(st.just("release"), st.tuples(SEQS)),
    st.tuples(st.just("abort"), st.tuples(SEQS, TIMEOUTS)),
    st.tuples(st.just("expect"), st.tuples(SEQS, JUNK)),
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["inproc", "ucx", "nccl"])
def test_random_arguments_raise_only_documented_errors_and_the_link_still_works(backend: str) -> None:
    src, dst = HostCache(SPEC, fill_seed=5), HostCache(SPEC)
    with kt.open(src.layout, backend=backend, timeout=5) as s, kt.open(dst.layout, backend=backend, timeout=5) as r:
        peer = s.connect(r.metadata())
        escaped: list[str] = []

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(CALLS, min_size=1, max_size=6))
        def calls(batch: list[tuple[str, tuple[Any, ...]]]) -> None:
            for name, raw in batch:
                args = [peer if a == "PEER" else a for a in raw]
                try:
                    _call(s, r, peer, name, args)
                except kt.KVTransportError:
                    pass  # documented
                except Exception as exc:  # anything else escaped the public API
                    escaped.append(f"{name}{tuple(map(repr, raw))}: {type(exc).__name__}: {exc}")

        calls()
        assert escaped == [], escaped[:5]
        # the same link still moves and verifies a request (fresh sequence and destinations)
        pairs = [(1, 12), (2, 13), (3, 14), (9, 15)]
        s.put_layers(peer, "after-the-fuzz", None, [a for a, _ in pairs], [b for _, b in pairs])
        s.signal(peer, "after-the-fuzz")
        r.wait("after-the-fuzz", timeout=30)
        for layer in range(SPEC.num_layers):
            for plane in range(len(src.layout.layers[layer].planes)):
                for a, b in pairs:
                    assert dst.piece(layer, plane, b) == src.piece(layer, plane, a), (layer, plane, a, b)


@pytest.mark.parametrize("value", [math.nan, math.inf, -1, 0, 1e30, "30", True])
def test_open_refuses_a_timeout_that_is_not_a_finite_positive_number(value: Any) -> None:
    layout = HostCache(SPEC).layout
    with pytest.raises(kt.ConfigurationError, match="timeout"):
        kt.open(layout, backend="inproc", timeout=value).close()  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["inf", "nan", "-5", "0", "1e30"])
def test_the_timeout_variable_is_checked_the_same_way(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KV_TRANSPORT_TIMEOUT", value)
    with pytest.raises(kt.ConfigurationError, match="KV_TRANSPORT_TIMEOUT"):
        kt.open(HostCache(SPEC).layout, backend="inproc").close()


def test_a_float_layer_is_refused_and_does_not_break_the_link() -> None:
    src, dst = HostCache(SPEC, fill_seed=3), HostCache(SPEC)
    with kt.open(src.layout, backend="inproc") as s, kt.open(dst.layout, backend="inproc") as r:
        peer = s.connect(r.metadata())
        for bad in (1.0, True, "1", None):
            with pytest.raises(kt.InvalidBlockIds, match="layer must be an int"):
                s.put_layer(peer, "f", bad, [1], [2])  # type: ignore[arg-type]
            with pytest.raises(kt.InvalidBlockIds, match="layer must be an int"):
                s.signal_layer(peer, "f", bad)  # type: ignore[arg-type]
            with pytest.raises(kt.InvalidBlockIds, match="layer must be an int"):
                r.wait_layer("f", bad, timeout=0)  # type: ignore[arg-type]
        s.put_layer(peer, "f", 1, [1], [2])
        s.signal(peer, "f")
        r.wait("f", timeout=10)
        assert dst.piece(1, 0, 2) == src.piece(1, 0, 1)


def test_a_capacity_beyond_the_bound_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(kt.ConfigurationError, match=r"capacity must be 1\.\.1048576"):
        kt.open(HostCache(SPEC).layout, backend="inproc", capacity=10**12)
