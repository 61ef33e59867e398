"""kvtransport.cudacopy on the CPU: the launcher's event ring and marks, driven through a simulated CUDA
driver (launches and event records go to a fake stream whose completion the test decides), and the
vectorised segment helpers. The copy kernel itself runs only on GPU hosts (the gpu/gpu2 conformance)."""

from __future__ import annotations

import ctypes
import itertools
import sys
import types

import pytest

np = pytest.importorskip("numpy")

from kvtransport import cudacopy  # noqa: E402

NOT_READY = cudacopy._Driver.NOT_READY


class FakeDriver:
    """cuLaunchKernel / cuEventRecord / cuEventQuery of one simulated stream: an event is pending from its
    record until the test completes everything recorded before it."""

    NOT_READY = NOT_READY
    last: FakeDriver | None = None

    def __init__(self) -> None:
        FakeDriver.last = self
        self.recorded: list[int] = []  # event ptrs in stream order (re-records append again)
        self.completed = 0  # how many entries of ``recorded`` are done
        self.launches = 0

    def launch(self, *args):
        self.launches += 1
        return 0

    def record(self, ptr, stream):
        self.recorded.append(int(ptr))
        return 0

    def query(self, ptr):
        last = max((i for i, p in enumerate(self.recorded) if p == int(ptr)), default=-1)
        return 0 if last < self.completed else NOT_READY

    def complete(self, upto: int | None = None) -> None:
        self.completed = len(self.recorded) if upto is None else upto

    def ctx_get(self, out):
        out._obj.value = 1
        return 0

    def ctx_set(self, ctx):
        return 0

    def check(self, rc, what):
        if rc != 0:
            raise cudacopy.TransferError(f"{what} failed: CUDA error {rc}")


@pytest.fixture
def copier(monkeypatch):
    ptrs = itertools.count(1000)

    class Event:
        def __init__(self, disable_timing=True):
            self.ptr = next(ptrs)

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RawKernel:
        def __init__(self, code, name):
            self.kernel = types.SimpleNamespace(ptr=1)

        def compile(self):
            pass

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, Device=Device), RawKernel=RawKernel)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cudacopy, "_Driver", FakeDriver)
    monkeypatch.setattr(cudacopy.SegmentCopier, "EVENTS", 4)
    c = cudacopy.SegmentCopier(0)
    c._stream_ptr = lambda: 7
    c.fake = FakeDriver.last
    return c


def _launch(c):
    table = types.SimpleNamespace(data=types.SimpleNamespace(ptr=4096))
    return c.launch(table, 1)


def test_a_mark_reports_its_own_launch_not_a_later_one(copier):
    marks = [_launch(copier) for _ in range(4)]  # the whole ring pending
    assert not any(m.done for m in marks)
    fifth = _launch(copier)  # slot 0's event still pending: the slot gets a fresh event
    assert copier.fresh_events == 1 and fifth.event is not marks[0].event
    copier.fake.complete(1)  # the first launch completed, the rest not
    assert marks[0].done and not marks[1].done and not fifth.done
    copier.fake.complete()
    assert all(m.done for m in [*marks, fifth])


def test_a_re_recorded_slot_leaves_earlier_marks_done(copier):
    first = [_launch(copier) for _ in range(4)]
    copier.fake.complete()
    again = _launch(copier)  # slot 0 completed: re-recorded, generation bumped
    assert again.event is first[0].event and copier.fresh_events == 0
    assert first[0].done, "an earlier mark of a re-recorded event reads the later launch's state"
    assert not again.done
    copier.fake.complete()
    assert again.done


def test_wait_is_bounded_and_returns_when_done(copier):
    mark = _launch(copier)
    with pytest.raises(cudacopy.TransferTimeout):
        copier.wait(mark, 0.01)
    copier.fake.complete()
    copier.wait(mark, 1.0)
    copier.wait(None, 1.0)  # nothing launched: returns


def test_tables_stay_alive_until_their_kernels_completed(copier):
    for _ in range(3):
        _launch(copier)
    assert len(copier.inflight) == 3
    copier.fake.complete()
    _launch(copier)
    assert len(copier.inflight) == 1  # the completed ones were let go at the next launch


def test_split_covers_every_byte_in_chunks():
    chunk = cudacopy.CHUNK
    src = np.array([1000, 5 * chunk], dtype=np.uint64)
    dst = np.array([9000, 0], dtype=np.uint64)
    lens = np.array([3 * chunk + 17, 100], dtype=np.uint64)
    s, d, n = cudacopy.split(src, dst, lens)
    assert n.max() <= chunk and int(n.sum()) == int(lens.sum())
    assert list(s[:4] - 1000) == [0, chunk, 2 * chunk, 3 * chunk] and list(d[:4] - 9000) == list(s[:4] - 1000)


def test_peer_windows_translate_and_refuse_outside():
    w = cudacopy.PeerWindows([(0x10000, 0x1000, 0x900000), (0x20000, 0x2000, 0x700000)])
    assert w.translate_range(0x20010, 0x10) == 0x700010
    got = w.translate(np.array([0x10000, 0x21000], dtype=np.uint64), np.array([16, 0x1000], dtype=np.uint64))
    assert list(got) == [0x900000, 0x701000]
    with pytest.raises(cudacopy.TransferError, match="outside"):
        w.translate_range(0x10ff0, 0x20)  # runs past the first window
    with pytest.raises(cudacopy.TransferError, match="outside"):
        w.translate(np.array([0x30000], dtype=np.uint64), np.array([1], dtype=np.uint64))


def test_ctypes_function_address_is_the_symbol():
    """wait_in_c (ucx) hands the C wait ``cuEventQuery``'s address as ctypes.cast(fn, c_void_p): check the
    idiom on a libc function."""
    libc = ctypes.CDLL(None)
    fn = libc.strlen
    assert ctypes.cast(fn, ctypes.c_void_p).value == ctypes.c_void_p.from_buffer(fn).value
