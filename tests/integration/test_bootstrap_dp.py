"""Issue 28: Mooncake's ``/query`` under data parallelism. DP engine 0 serves the endpoint for every DP engine of
the instance; the others file themselves in a per-instance directory (bootstrap.DPRegistry). Pure Python (no vLLM
process; test_e2e_dp reads ``/query`` of a real DP=2 prefill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

boot = pytest.importorskip("kvtransport_vllm.bootstrap", reason="kvtransport-vllm is not installed")


def test_engine_zero_answers_for_every_filed_engine(tmp_path: Path) -> None:
    zero, one, two = (boot.DPRegistry(f"inst-42_dp{r}", str(tmp_path)) for r in range(3))
    assert zero.dir == one.dir == two.dir  # one directory per instance
    one.register(1, "inst-42_dp1", "10.0.0.5", 7001)
    two.register(2, "inst-42_dp2", "10.0.0.5", 7002)
    own = boot.query_answer("inst-42_dp0", "10.0.0.5", 7000, 0)
    got = boot.dp_query_answer(own, zero)
    assert got == {
        "0": {"engine_id": "inst-42_dp0@10.0.0.5:7000", "worker_addr": {"0": {"0": "10.0.0.5:7000"}}},
        "1": {"engine_id": "inst-42_dp1@10.0.0.5:7001", "worker_addr": {"0": {"0": "10.0.0.5:7001"}}},
        "2": {"engine_id": "inst-42_dp2@10.0.0.5:7002", "worker_addr": {"0": {"0": "10.0.0.5:7002"}}},
    }
    assert oct(zero.dir.stat().st_mode & 0o777) == "0o700"
    two.remove()  # a stopped engine leaves the answer
    assert sorted(boot.dp_query_answer(own, zero)) == ["0", "1"]
    other = boot.DPRegistry("inst-43_dp0", str(tmp_path))  # another instance: another directory
    assert other.dir != zero.dir and other.entries() == {}


def test_a_dead_engines_file_and_garbage_are_ignored(tmp_path: Path) -> None:
    reg = boot.DPRegistry("inst_dp0", str(tmp_path))
    reg.register(1, "inst_dp1", "h", 7001)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that exited
    (reg.dir / "2.json").write_text(json.dumps({"rank": 2, "engine_id": "inst_dp2", "host": "h", "port": 7002,
                                                "pid": pid}))
    for name, body in (("3.json", "{not json"), ("4.json", json.dumps([1])),
                       ("5.json", json.dumps({"rank": 5, "engine_id": "e", "host": "h", "port": 0, "pid": os.getpid()})),
                       ("6.json", json.dumps({"rank": True, "engine_id": "e", "host": "h", "port": 1,
                                              "pid": os.getpid()})),
                       ("7.json", "x" * (boot.MAX_ENTRY_BYTES + 1)), ("notes.txt", "hello")):
        (reg.dir / name).write_text(body)
    assert reg.entries() == {1: {"engine_id": "inst_dp1", "host": "h", "port": 7001}}


def test_the_instance_id_drops_only_vllms_dp_suffix() -> None:
    assert boot.instance_of("abc_dp3") == boot.instance_of("abc_dp0") == "abc"
    assert boot.instance_of("abc_dp") == "abc_dp" and boot.instance_of("x_dp1_y") == "x_dp1_y"


def test_dp_scheduler_sides_file_themselves_and_engine_zero_serves_the_instance(tmp_path: Path, monkeypatch) -> None:
    """Two DP engines of one prefill instance with ``bootstrap_port``: engine 1 files its side channel and serves
    nothing; engine 0 serves ``/query`` on that port, with both engines; an engine that shuts down leaves it."""
    import socket
    import tempfile
    import urllib.request

    pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
    from kvtransport_vllm.config import resolve_settings
    from kvtransport_vllm.scheduler import SchedulerSide

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the registry's directory
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = resolve_settings({"bootstrap_port": port}, env={})

    def side(rank: int) -> SchedulerSide:
        return SchedulerSide(settings=settings, engine_id=f"inst-9_dp{rank}", block_size=16, producer=True,
                             consumer=False, compat_info={"model": "m"}, dp_route=(rank, 2))

    def query() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/query", timeout=10) as r:
            return json.loads(r.read())

    one = side(1)
    try:
        assert one.bootstrap is None and one.dp_registry is not None
        assert one.dp_registry.entries() == {1: {"engine_id": "inst-9_dp1", "host": one.host, "port": one.port}}
        zero = side(0)
        try:
            assert zero.bootstrap is not None and (zero.bootstrap.host, zero.bootstrap.port) == (zero.host, port)
            assert zero.dp_registry is not None and zero.dp_registry.dir == one.dp_registry.dir
            assert query() == {**boot.query_answer("inst-9_dp0", zero.host, zero.port, 0),
                               **boot.query_answer("inst-9_dp1", one.host, one.port, 1)}
            one.shutdown()
            assert query() == boot.query_answer("inst-9_dp0", zero.host, zero.port, 0)
        finally:
            zero.shutdown()
    finally:
        one.shutdown()
    single = SchedulerSide(settings=settings, engine_id="solo", block_size=16, producer=True, consumer=False,
                           compat_info={"model": "m"})
    try:  # one engine (no DP): its own answer, no registry
        assert single.dp_registry is None
        assert query() == boot.query_answer("solo", single.host, single.port, 0)
    finally:
        single.shutdown()
