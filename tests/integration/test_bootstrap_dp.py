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
