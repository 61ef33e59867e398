"""Tests for the UCP one-sided RMA binding (backends/ucx/kvtransport_ucx/_ucp.py).

Real two-process tests use the multiprocessing *spawn* context: UCX must never
be initialised in a process that later forks.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import subprocess
import time
from array import array
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
from kvtransport_ucx import _ucp

_reason = _ucp.load_error()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"libucp unavailable: {_reason}")

MiB = 1 << 20
SEG = 16 * 1024
NSEG = 1000
NSLOTS = 2048  # scattered segments land in random slots of a 32 MiB area
BIG = 64 * MiB
SEED = 1234


def _expected(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic payloads both processes can compute: (big, segs[NSEG, SEG], slots)."""
    rng = np.random.default_rng(seed)
    big = rng.integers(0, 256, BIG, dtype=np.uint8)
    segs = rng.integers(0, 256, (NSEG, SEG), dtype=np.uint8)
    slots = rng.permutation(NSLOTS)[:NSEG].astype(np.uint64)
    return big, segs, slots


# ----------------------------------------------------------------------------- process bodies
def _receiver(conn: Connection, result: Connection, tls: str | None, progress_before_go: bool) -> None:
    try:
        ctx = _ucp.UcpContext(tls=tls)
        worker = ctx.create_worker()
        buf = np.zeros(BIG + NSLOTS * SEG, dtype=np.uint8)
        counter = np.zeros(1, dtype=np.uint64)
        mem = worker.mem_map(buf.ctypes.data, buf.nbytes)
        cmem = worker.mem_map(counter.ctypes.data, 8)
        conn.send((worker.address(), mem.pack_rkey(), buf.ctypes.data, cmem.pack_rkey(), counter.ctypes.data))
        msg: Any = None
        while msg is None:
            if progress_before_go:
                # Idle-friendly: sleeps on the worker's event fd between checks.
                worker.wait_for_events(0.01)
            if conn.poll(0 if progress_before_go else None):
                msg = conn.recv()
                if msg == "progress":  # sender asks us to start progressing
                    progress_before_go = True
                    msg = None
        assert msg == "done"
        big, segs, slots = _expected(SEED)
        ok_big = bool(np.array_equal(buf[:BIG], big))
        area = buf[BIG:].reshape(NSLOTS, SEG)
        ok_segs = bool(np.array_equal(area[slots.astype(np.int64)], segs))
        untouched = np.setdiff1d(np.arange(NSLOTS), slots.astype(np.int64))
        ok_rest = not area[untouched].any()
        result.send({"ok_big": ok_big, "ok_segs": ok_segs, "ok_rest": ok_rest, "counter": int(counter[0])})
        conn.send("verified")  # sender may close its endpoint after this
        while not conn.poll(0):  # keep progressing: endpoint close over TCP needs the peer
            worker.wait_for_events(0.01)
        assert conn.recv() == "bye"
        ctx.close()
    except BaseException as e:  # report, don't hang the parent
        result.send({"error": repr(e)})
        raise


def _sender(conn: Connection, result: Connection, tls: str | None, timeout_probe: bool) -> None:
    try:
        ctx = _ucp.UcpContext(tls=tls)
        worker = ctx.create_worker()
        raddr, packed, rbase, cpacked, caddr = conn.recv()
        ep = worker.create_endpoint(raddr)
        rkey = ep.unpack_rkey(packed)
        crkey = ep.unpack_rkey(cpacked)
        big, segs, slots = _expected(SEED)
        res: dict[str, Any] = {"transports": ep.transports(), "lanes": ep.transport_list()}
        if timeout_probe:
            # Receiver is not progressing: a flush over TCP cannot complete.
            ep.put(big.ctypes.data, MiB, rbase, rkey)
            t0 = time.monotonic()
            try:
                ep.flush(timeout_s=0.5)
                res["timeout_raised"] = False
            except TimeoutError:
                res["timeout_raised"] = True
            res["timeout_elapsed"] = time.monotonic() - t0
            conn.send("progress")
        seg_base = segs.ctypes.data
        local = np.arange(NSEG, dtype=np.uint64) * np.uint64(SEG) + np.uint64(seg_base)
        remote = slots * np.uint64(SEG) + np.uint64(rbase + BIG)
        ep.put_batch(local, remote, SEG, rkey)
        ep.put(big.ctypes.data, BIG, rbase, rkey)
        for _ in range(10):
            ep.atomic_add64(caddr, crkey, 7)
        ep.flush(timeout_s=60)
        conn.send("done")
        assert conn.recv() == "verified"
        ep.close()
        result.send(res)
        conn.send("bye")
        ctx.close()
    except BaseException as e:
        result.send({"error": repr(e)})
        raise


def _run_pair(tls: str | None, timeout_probe: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    spawn = mp.get_context("spawn")
    a, b = spawn.Pipe()
    rx_res_r, rx_res_w = spawn.Pipe(duplex=False)
    tx_res_r, tx_res_w = spawn.Pipe(duplex=False)
    rx = spawn.Process(target=_receiver, args=(a, rx_res_w, tls, not timeout_probe), daemon=True)
    tx = spawn.Process(target=_sender, args=(b, tx_res_w, tls, timeout_probe), daemon=True)
    rx.start()
    tx.start()
    try:
        out = []
        for r in (rx_res_r, tx_res_r):
            if not r.poll(100):
                raise AssertionError("child process did not report within 100 s")
            out.append(r.recv())
        rx.join(20)
        tx.join(20)
        return out[0], out[1]
    finally:
        for p in (rx, tx):
            if p.is_alive():
                p.kill()
                p.join(5)


# ----------------------------------------------------------------------------- tests
@pytest.mark.timeout(120)
def test_two_process_put_batch_and_big_put_over_shm() -> None:
    rx, tx = _run_pair(tls=None, timeout_probe=False)
    assert "error" not in rx, rx
    assert "error" not in tx, tx
    assert rx["ok_segs"], "scattered 16 KiB segments mismatch"
    assert rx["ok_big"], "64 MiB contiguous put mismatch"
    assert rx["ok_rest"], "bytes outside the written segments were modified"
    assert rx["counter"] == 70
    # Same host, host memory, no error handling: shared memory / CMA lanes, no TCP.
    lanes = tx["transports"]
    assert any(t in lanes for t in ("cma", "sysv", "posix", "xpmem", "knem")), lanes
    assert "tcp" not in lanes, lanes
    names = {t for t, _ in tx["lanes"]}
    assert names and "tcp" not in names, tx["lanes"]


@pytest.mark.timeout(120)
def test_flush_timeout_raises_instead_of_hanging() -> None:
    rx, tx = _run_pair(tls="tcp", timeout_probe=True)
    assert "error" not in rx, rx
    assert "error" not in tx, tx
    assert tx["timeout_raised"], tx
    assert tx["timeout_elapsed"] < 10, tx
    assert "tcp" in tx["transports"]
    # After the receiver starts progressing everything completes and is correct.
    assert rx["ok_segs"] and rx["ok_big"] and rx["ok_rest"], rx
    assert rx["counter"] == 70


@pytest.fixture
def loopback() -> Any:
    """One context, two workers, an endpoint between them, and a mapped 1 MiB target."""
    ctx = _ucp.UcpContext()
    w_tx, w_rx = ctx.create_worker(), ctx.create_worker()
    dst = np.zeros(MiB, dtype=np.uint8)
    mem = w_rx.mem_map(dst.ctypes.data, dst.nbytes)
    ep = w_tx.create_endpoint(w_rx.address())
    rkey = ep.unpack_rkey(mem.pack_rkey())
    yield ctx, ep, rkey, dst
    ctx.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("impl", ["c", "python"])
@pytest.mark.parametrize("kind", ["numpy", "array", "list", "scalar_len"])
def test_put_batch_input_kinds(loopback: Any, monkeypatch: pytest.MonkeyPatch, impl: str, kind: str) -> None:
    _ctx, ep, rkey, dst = loopback
    if impl == "python":
        monkeypatch.setattr("kvtransport_ucx._ucp_helper._helper", None)
        monkeypatch.setattr("kvtransport_ucx._ucp_helper._helper_tried", True)
    elif _ucp.batch_impl() != "c":
        pytest.skip("no C compiler for the batch helper")
    src = np.random.default_rng(1).integers(0, 256, 64 * 1024, dtype=np.uint8)
    n, seg = 16, 4096
    order = np.random.default_rng(2).permutation(n).astype(np.uint64)
    local: Any = np.arange(n, dtype=np.uint64) * np.uint64(seg) + np.uint64(src.ctypes.data)
    remote: Any = order * np.uint64(seg) + np.uint64(dst.ctypes.data)
    lens: Any = np.full(n, seg, dtype=np.uint64)
    if kind == "array":
        local, remote, lens = array("Q", local.tolist()), array("Q", remote.tolist()), array("Q", lens.tolist())
    elif kind == "list":
        local, remote, lens = local.tolist(), remote.tolist(), lens.tolist()
    elif kind == "scalar_len":
        lens = seg
    ep.put_batch(local, remote, lens, rkey)
    ep.flush(timeout_s=10)
    got = dst[: n * seg].reshape(n, seg)
    assert np.array_equal(got[order.astype(np.int64)], src[: n * seg].reshape(n, seg))


@pytest.mark.timeout(120)
def test_put_batch_length_mismatch(loopback: Any) -> None:
    _ctx, ep, rkey, _dst = loopback
    with pytest.raises(ValueError):
        ep.put_batch([1, 2], [3], 8, rkey)


@pytest.mark.timeout(120)
def test_errors_are_ucp_error() -> None:
    with pytest.raises(_ucp.UcpError) as ei:
        _ucp.UcpContext(config={"NO_SUCH_UCX_OPTION_XYZ": "1"})
    assert ei.value.status is not None and ei.value.status < 0
    assert "ucp_config_modify" in str(ei.value)
    with pytest.raises(_ucp.UcpError) as ei2:
        _ucp.UcpContext(tls="no_such_transport_xyz")
    assert ei2.value.status is not None and ei2.value.status < 0
    ctx = _ucp.UcpContext()
    w = ctx.create_worker()
    ep = w.create_endpoint(ctx.create_worker().address())
    ep.close()
    with pytest.raises(_ucp.UcpError, match="closed"):
        ep.flush(1)
    ctx.close()
    with pytest.raises(_ucp.UcpError, match="closed"):
        w.progress()


@pytest.mark.timeout(120)
def test_idle_wait_burns_no_cpu() -> None:
    ctx = _ucp.UcpContext()
    w = ctx.create_worker()
    t0, c0 = time.monotonic(), time.process_time()
    while time.monotonic() - t0 < 0.5:
        w.wait_for_events(0.5)
    cpu = time.process_time() - c0
    assert cpu < 0.1, f"idle wait used {cpu:.3f} s CPU in 0.5 s"
    ctx.close()


# ----------------------------------------------------------------------------- layouts
def _include_dir() -> str | None:
    try:
        import libucx  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    inc = os.path.join(os.path.dirname(libucx.__file__), "include")
    return inc if os.path.exists(os.path.join(inc, "ucp", "api", "ucp.h")) else None


# Fields our ctypes struct has but older verified headers lack (we never set them).
_NEWER_FIELDS = {
    ("ucp_request_param_t", "remote_datatype"),
    ("ucp_request_param_t", "remote"),
    ("ucp_request_param_t", "remote_count"),
}
# ctypes struct deliberately larger than the C one (slack at the end).
_OVERSIZED = {"ucp_request_param_t"}


@pytest.mark.timeout(120)
def test_struct_layouts_match_installed_headers(tmp_path: Any) -> None:
    inc = _include_dir()
    cc = shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("needs the libucx wheel headers and a C compiler")
    newer_ok = _ucp.ucx_version()[:2] >= (1, 22)
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ucp/api/ucp.h>", "int main(void) {"]
    expected: dict[str, int] = {"ucs_status_t.sizeof": ctypes.sizeof(_ucp.c_status)}
    lines.append('printf("ucs_status_t.sizeof %zu\\n", sizeof(ucs_status_t));')
    for cname, cls in _ucp.STRUCTS.items():
        lines.append(f'printf("{cname}.sizeof %zu\\n", sizeof({cname}));')
        expected[f"{cname}.sizeof"] = ctypes.sizeof(cls)
        for field in cls._fields_:
            fname = field[0]
            if fname.startswith("_") or ((cname, fname) in _NEWER_FIELDS and not newer_ok):
                continue
            lines.append(f'printf("{cname}.{fname} %zu\\n", offsetof({cname}, {fname}));')
            expected[f"{cname}.{fname}"] = getattr(cls, fname).offset
    lines.append("return 0; }")
    src = tmp_path / "probe.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "probe"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True, capture_output=True)
    got = dict(
        line.rsplit(" ", 1)
        for line in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    )
    for key, off in expected.items():
        c_val = int(got[key])
        if key.endswith(".sizeof") and key.split(".")[0] in _OVERSIZED:
            assert off >= c_val, key
        else:
            assert off == c_val, f"{key}: ctypes {off} != C {c_val}"


# ----------------------------------------------------------------------------- loading
_LOAD_PROBE = """
import sys
{prelude}
from kvtransport_ucx import _ucp
{patch}
print(_ucp.load_error())
"""


def _load_error_in_subprocess(prelude: str = "", patch: str = "") -> str:
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE.format(prelude=prelude, patch=patch)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    return out.stdout.strip()


@pytest.mark.timeout(120)
def test_unverified_version_is_refused() -> None:
    msg = _load_error_in_subprocess(patch="from kvtransport_ucx import _ucp_lib; _ucp_lib.VERIFIED_VERSIONS = frozenset({(9, 99)})")
    assert "not a version" in msg and "9.99" in msg, msg


@pytest.mark.timeout(120)
def test_missing_wheel_names_the_install_command() -> None:
    msg = _load_error_in_subprocess(prelude="sys.modules['libucx'] = None")
    assert "pip install ucxx-cu12" in msg, msg
