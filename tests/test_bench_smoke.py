"""``kvtransport bench --smoke``: every workload runs through every usable backend and the outputs are written.

Asserts nothing about speed. Runs the CLI in a subprocess (the bench spawns role processes of its own).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the nccl backend, the raw send/recv baseline and the compute proxy need it

WORKLOADS = ("sweep", "kv", "overlap", "latency")


@pytest.mark.timeout(600)
def test_bench_smoke_writes_json_table_and_plots(tmp_path: Path) -> None:
    out = os.path.join(str(tmp_path), "bench")
    proc = subprocess.run([sys.executable, "-m", "kvtransport.cli", "bench", "--smoke", "--device", "cpu", "--out", out],
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"

    with open(os.path.join(out, "results.json")) as f:
        result = json.load(f)
    assert not result["errors"], result["errors"]
    machine = result["machine"]
    for key in ("cpu_count", "mem_total_bytes", "torch", "date", "kvtransport", "gpus"):
        assert key in machine, key

    used = [b["name"] for b in result["backends"] if b["used"] == "yes"]
    assert used, f"no backend ran: {result['backends']}"
    assert "inproc" not in used
    rows = result["rows"]
    for backend in used:
        system = f"kvtransport/{backend}"
        for workload in WORKLOADS:
            mine = [r for r in rows if r["system"] == system and r["workload"] == workload]
            assert mine, f"{system} produced no {workload} rows"
        kv = [r for r in rows if r["system"] == system and r["workload"] == "kv"]
        assert {r["case"]["coalesce"] for r in kv} == {True, False}
        assert backend in result["paths"]
    raw = [r for r in rows if r["system"].startswith("torch.distributed/")]
    assert {r["workload"] for r in raw} == {"sweep", "kv"}
    for r in rows:
        if r["workload"] in ("sweep", "kv"):
            assert r["gbps"] > 0 and r["pct_of_ceiling"] > 0 and r["verified"], r
    if result["nixl"] == "not installed":
        assert any(s["what"] == "NIXL baseline" for s in result["skipped"])
    else:  # installed (GPU hosts, or pip install nixl-cu12/13): its rows must be there, not an error
        assert {r["workload"] for r in rows if r["system"] == "nixl"} == {"sweep", "kv"}
    # Mooncake's transfer engine: scripts/setup.sh installs it (the non-CUDA wheel and libibverbs1), so it runs
    # here; its rows (checked above: bytes verified at the receiver) sit beside ours in the same run
    assert result["mooncake"].startswith("installed"), result["mooncake"]
    assert {r["workload"] for r in rows if r["system"] == "mooncake"} == {"sweep", "kv"}
    assert result["paths"]["mooncake"] == "mooncake TCP (P2P handshake) 127.0.0.1 -> 127.0.0.1"

    for name in ("table.txt", "table.md"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert "Summary" in proc.stdout
    if importlib.util.find_spec("matplotlib") is None:
        assert "skipped" in str(result.get("plots", "")) or "matplotlib" in proc.stdout
    else:
        for png in ("bandwidth_vs_size.png", "exposed_vs_prompt.png", "kv_requests.png"):
            path = os.path.join(out, png)
            with open(path, "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", path


@pytest.mark.timeout(180)
def test_host_path_diagnostic_runs() -> None:
    """benchmarks/host_path.py (the host-path simulation of a GPU push) still runs against the manager."""
    from kvtransport import registry

    if not any(b.name == "ucx" and b.available for b in registry.available_backends()):
        pytest.skip("ucx backend unavailable")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_path.py"
    proc = subprocess.run([sys.executable, str(script), "--layers", "4", "--blocks", "8", "--requests", "2", "--json"],
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["layers"] == 4 and res["host_issue_us_per_layer"] > 0 and 0 < res["copy_share_pct"] <= 100


def test_mooncake_pieces_contiguous_on_both_sides_are_merged() -> None:
    """What the Mooncake baseline sends per request: neighbours contiguous on both sides become one entry (as
    vLLM's MooncakeConnector merges contiguous blocks), anything else stays apart, order kept."""
    from kvtransport.bench.baselines import merged_runs

    assert merged_runs([0, 10, 20, 50, 60], [100, 110, 120, 130, 140], [10, 10, 10, 10, 10]) == (
        [0, 50], [100, 130], [30, 20])  # the fourth piece is contiguous on the receiver only
    assert merged_runs([0, 10], [100, 200], [10, 10]) == ([0, 10], [100, 200], [10, 10])  # the sender only
    assert merged_runs([30, 20], [130, 120], [10, 10]) == ([30, 20], [130, 120], [10, 10])  # backwards: apart
    assert merged_runs([0, 16, 32], [0, 16, 40], [16, 16, 8]) == ([0, 32], [0, 40], [32, 8])  # mixed lengths
    assert merged_runs([], [], []) == ([], [], [])
