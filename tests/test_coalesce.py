"""Property tests of block coalescing (hypothesis)."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtransport import BlockRun, InvalidBlockIds, coalesce, expand_runs
from kvtransport.coalesce import single_runs


@st.composite
def pairs(draw, max_blocks=64, max_len=48):
    n = draw(st.integers(0, max_len))
    dst = draw(st.lists(st.integers(0, max_blocks - 1), min_size=n, max_size=n, unique=True))
    src = draw(st.lists(st.integers(0, max_blocks - 1), min_size=n, max_size=n))
    if draw(st.booleans()) and n:  # bias towards contiguous stretches
        s0, d0 = draw(st.integers(0, 1000)), draw(st.integers(0, 1000))
        k = draw(st.integers(1, n))
        src[:k] = range(s0, s0 + k)
        dst = list(range(d0, d0 + k)) + [d + 2000 for d in dst[k:]]
    return src, dst


def slow_reference(src, dst):
    runs = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [BlockRun(*r) for r in runs]


@given(pairs())
def test_round_trip(p):
    src, dst = p
    assert expand_runs(coalesce(src, dst)) == (src, dst)


@given(pairs())
def test_maximal(p):
    runs = coalesce(*p)
    for a, b in itertools.pairwise(runs):
        assert not (a.src + a.count == b.src and a.dst + a.count == b.dst)


@given(pairs())
def test_run_count_bounded_and_positive(p):
    runs = coalesce(*p)
    assert len(runs) <= len(p[0])
    assert all(r.count >= 1 for r in runs)
    assert sum(r.count for r in runs) == len(p[0])


@given(pairs())
def test_equals_slow_reference(p):
    assert coalesce(*p) == slow_reference(*p)


@given(pairs())
def test_single_runs_round_trip(p):
    assert expand_runs(single_runs(*p)) == p


def test_examples():
    assert coalesce([1, 2, 3, 7, 8], [10, 11, 12, 4, 5]) == [BlockRun(1, 10, 3), BlockRun(7, 4, 2)]
    assert coalesce([], []) == []
    assert coalesce([5, 6], [1, 3]) == [BlockRun(5, 1, 1), BlockRun(6, 3, 1)]


@pytest.mark.parametrize(
    ("src", "dst", "limits", "fragment"),
    [
        ([1, 2], [1], {}, "equal length"),
        ([-1], [0], {}, "negative"),
        ([0], [-3], {}, "negative"),
        ([0, 1], [4, 4], {}, "appears twice"),
        ([9], [0], {"src_num_blocks": 8}, "beyond the sender"),
        ([0], [8], {"dst_num_blocks": 8}, "beyond the receiver"),
        ([0.5], [1], {}, "integers"),
        ([True], [1], {}, "integers"),
        (["1"], [1], {}, "integers"),
    ],
)
def test_invalid_input_is_typed(src, dst, limits, fragment):
    with pytest.raises(InvalidBlockIds, match=fragment):
        coalesce(src, dst, **limits)


def test_numpy_ints_accepted():
    np = pytest.importorskip("numpy")
    src = np.arange(4, dtype=np.int64)
    assert coalesce(list(src), [0, 1, 2, 3]) == [BlockRun(0, 0, 4)]
