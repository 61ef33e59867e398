"""kvtransport.gpu (the device copy path) on the CPU: the launcher's event ring and marks, driven through a simulated CUDA
driver (launches and event records go to a fake stream whose completion the test decides), and the
vectorised segment helpers. The copy kernel itself runs only on GPU hosts (the gpu/gpu2 conformance)."""

from __future__ import annotations

import ctypes
import itertools
import sys
import types

import pytest

np = pytest.importorskip("numpy")

from kvtransport import gpu as cudacopy  # noqa: E402

NOT_READY = cudacopy.Driver.NOT_READY


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
        self.grids: list[tuple[int, int]] = []
        self.cupy_launches: list[tuple[int, tuple[int, ...]]] = []
        self.fail_launches = 0  # the next launches return this CUDA error count down
        self.bells: list[tuple[int, int]] = []
        self.stream_waits: list[tuple[int, int]] = []
        self.registered: dict[int, int] = {}

    def host_register(self, address, size, flags):
        self.registered[address] = size
        return 0

    def host_device_pointer(self, out, address, flags):
        out._obj.value = address
        return 0

    def host_unregister(self, address):
        self.registered.pop(address)
        return 0

    def stream_wait_event(self, stream, event, flags):
        self.stream_waits.append((stream.value, event))
        return 0

    def launch(self, func, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        """Runs the kernel on host memory (the tests' "device" pointers are host addresses)."""
        if self.fail_launches:
            self.fail_launches -= 1
            return 1  # CUDA_ERROR_INVALID_VALUE
        self.launches += 1
        self.grids.append((gx, gy))
        if func.value == 3:  # the doorbell: store a word
            word, value = (ctypes.c_uint64.from_address(params[i]).value for i in range(2))
            ctypes.c_uint64.from_address(word).value = value
            self.bells.append((stream.value, value))
            return 0
        arg = [params[i] for i in range(4 if func.value == 1 else 3)]
        table = ctypes.c_uint64.from_address(arg[0]).value
        n = ctypes.c_int32.from_address(arg[1]).value
        if table < 1 << 16:  # the event-ring tests launch with a dummy table
            return 0
        segs = (ctypes.c_uint64 * (3 * n)).from_address(table)
        if func.value == 1:
            bases = [(ctypes.c_uint64.from_address(arg[2]).value, ctypes.c_uint64.from_address(arg[3]).value)]
        else:
            flat = (ctypes.c_uint64 * (2 * gy)).from_address(ctypes.c_uint64.from_address(arg[2]).value)
            bases = [(flat[2 * y], flat[2 * y + 1]) for y in range(gy)]
        for src_base, dst_base in bases:
            for i in range(n):
                ctypes.memmove((dst_base + segs[3 * i + 1]) % (1 << 64), (src_base + segs[3 * i]) % (1 << 64), segs[3 * i + 2])
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

        def record(self, stream=None):
            FakeDriver.last.recorded.append(self.ptr)

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RawKernel:
        def __init__(self, code, name):
            self.kernel = types.SimpleNamespace(ptr={"kvt_segment_copy": 1, "kvt_segment_copy_layers": 2}.get(name, 3))

        def compile(self):
            pass

        def __call__(self, grid, block, args):  # CuPy's own launch (the fallback path)
            FakeDriver.last.cupy_launches.append((self.kernel.ptr, grid))

    class HostArray:  # cupy.asarray's stand-in: "device" memory is host memory here
        def __init__(self, values):
            self.values = np.ascontiguousarray(values)
            self.data = types.SimpleNamespace(ptr=self.values.ctypes.data)

    class Stream:
        def __init__(self, ptr):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, Device=Device, ExternalStream=Stream),
                                      RawKernel=RawKernel, asarray=HostArray)
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cudacopy.driver, "_Driver", FakeDriver)
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
    k = copier.TRACK_CHECK
    for _ in range(k):
        _launch(copier)
    assert len(copier.inflight) == k
    copier.fake.complete(k - 1)
    _launch(copier)
    assert len(copier.inflight) == 2  # the completed ones were let go at the next launch, the pending one kept


def _putter(copier, cut_window_at=None):
    """A MappedPutter between two host caches, the peer "mapped" at its own addresses (optionally in two
    windows cut at ``cut_window_at`` bytes into the peer's backing)."""
    from kvtransport.coalesce import coalesce
    from kvtransport.workload.caches import CacheSpec, HostCache

    spec = CacheSpec(num_layers=4, num_blocks=40, heads=2, block_size=4, head_dim=16, order="NHD")
    src, dst = HostCache(spec, fill_seed=3), HostCache(spec)
    start, size = dst.backing.ctypes.data, dst.backing.nbytes
    rows = [(start, size, start)] if cut_window_at is None else [
        (start, cut_window_at, start), (start + cut_window_at, size - cut_window_at, start + cut_window_at)]
    putter = cudacopy.MappedPutter(src.layout, dst.layout, cudacopy.PeerWindows(rows), copier)
    rng = np.random.default_rng(0)
    s_ids, d_ids = rng.permutation(40)[:17].tolist(), rng.permutation(40)[:17].tolist()
    runs = tuple(coalesce(s_ids, d_ids, src_num_blocks=40, dst_num_blocks=40))
    return src, dst, putter, runs, s_ids, d_ids


def _expected(src, dst_blank, layers, s_ids, d_ids):
    want = {name: v.copy() for name, v in dst_blank.views.items()}
    for layer in layers:
        name = f"layers.{layer}"
        for s, d in zip(s_ids, d_ids, strict=True):
            want[name][d] = src.views[name][s]
    return want


def test_put_layers_moves_every_layer_in_one_launch(copier):
    src, dst, putter, runs, s_ids, d_ids = _putter(copier)
    want = _expected(src, dst, [3, 1, 2], s_ids, d_ids)
    putter.put_layers([3, 1, 2], runs)
    assert copier.fake.launches == 1 and copier.fake.grids[-1][1] == 3  # one kernel, a grid row per layer
    for name, view in dst.views.items():
        assert np.array_equal(view, want[name]), name
    putter.put_layers([3, 1, 2], runs)  # the second request with these layers reuses the uploaded bases
    assert copier.fake.launches == 2 and len(putter._layer_bases) == 1


def test_put_layers_falls_back_per_layer_when_a_layer_spans_two_peer_allocations(copier):
    src, dst, putter, runs, s_ids, d_ids = _putter(copier, cut_window_at=int(1.5 * (40 * 2 * 4 * 2 * 16 * 2)))
    want = _expected(src, dst, range(4), s_ids, d_ids)
    putter.put_layers(range(4), runs)
    assert copier.fake.launches == 4  # one launch per layer; layer 1 translated segment by segment
    for name, view in dst.views.items():
        assert np.array_equal(view, want[name]), name


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


def test_doorbell_store_follows_the_copies_of_every_stream(copier):
    from kvtransport import doorbell

    _, _, putter, runs, _, _ = _putter(copier)
    bell = doorbell.BellWriter()
    try:
        dev = putter.doorbell_map(bell.address, doorbell.SIZE)
        assert dev == bell.address and copier.fake.registered == {bell.address: doorbell.SIZE}
        putter.put(0, runs)  # on stream 7
        copier._stream_ptr = lambda: 8
        putter.put(1, runs)  # on stream 8
        putter.doorbell_write(dev + doorbell.WORD_OFFSET, 5)
        assert copier.fake.bells == [(8, 5)] and bell.completed() == 5
        assert [w[0] for w in copier.fake.stream_waits] == [8]  # stream 8 waits for stream 7's last copy
        putter.doorbell_write(dev + doorbell.WORD_OFFSET, 6)
        assert len(copier.fake.stream_waits) == 1  # nothing new on stream 7, and the last store was on 8
        copier._stream_ptr = lambda: 9
        putter.doorbell_write(dev + doorbell.WORD_OFFSET, 7)
        # a store from another stream waits for the previous store: stores run in order, the word only grows
        assert copier.fake.stream_waits[-1] == (9, copier._bell_done.ptr)
        putter.doorbell_unmap(bell.address)
        assert copier.fake.registered == {bell.address: doorbell.SIZE}  # a store still pending: left pinned
        copier.fake.complete()
        putter.doorbell_unmap(bell.address)
        assert copier.fake.registered == {}
    finally:
        bell.close()


def test_a_first_direct_launch_that_fails_falls_back_to_cupy_for_both_kernels(copier):
    copier.fake.fail_launches = 1
    mark = _launch(copier)
    assert not copier.fast and copier.fake.cupy_launches == [(1, (1,))] and copier.fake.launches == 0
    table = types.SimpleNamespace(data=types.SimpleNamespace(ptr=4096))
    copier.launch_layers(table, 3, table, 2)
    assert copier.fake.cupy_launches[-1] == (2, (3, 2))  # the layers kernel goes the same way
    copier.fake.complete()
    assert mark.done


def test_a_direct_launch_failing_after_one_succeeded_is_an_error(copier):
    _launch(copier)
    copier.fake.fail_launches = 1
    with pytest.raises(cudacopy.TransferError, match="copy kernel launch"):
        _launch(copier)
    assert copier.fast and copier.fake.cupy_launches == []
