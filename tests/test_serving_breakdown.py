"""benchmarks/serving.py's breakdown of a P/D request's time from the milestones the instances and the proxy
record (kvtransport_vllm.trace's format), and its report. Runs anywhere: synthetic milestones, no vLLM."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def serving(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("benchmarks/serving.py")


def request(xfer: str, seq: str, t0: float, bind: float = 0.002, phase: str = "during") -> list[dict[str, Any]]:
    """The milestones of one first-token-flow request, spaced as named below (seconds after ``t0``); its
    destination reaches the prefill worker ``bind`` seconds after the decode allocated it."""
    at = {"proxy.recv": 0.0, "proxy.sent": 0.001, "p.new": 0.003, "d.new": 0.0035, "d.alloc": 0.004,
          "w.bind": 0.004 + bind, "p.dst": 0.0065, "p.scheduled": 0.0055, "p.finished": 0.0605, "p.signal": 0.0606,
          "d.landed": 0.0607, "proxy.prefill_done": 0.0625, "p.first_sent": 0.0606, "d.first": 0.061,
          "proxy.first_out": 0.063, "d.reported": 0.0612, "d.scheduled": 0.0627, "proxy.decode_first": 0.068}
    rows = []
    for ev, dt in at.items():
        key = seq if ev in ("p.signal", "d.landed", "d.reported", "d.scheduled") else xfer
        row: dict[str, Any] = {"t": t0 + dt, "ev": ev, "key": key}
        if ev in ("d.new", "d.alloc", "d.first"):
            row["seq"] = seq
        if ev == "w.bind":
            row["phase"] = phase
        rows.append(row)
    return rows


def test_breakdown_gives_the_median_of_each_segment_inside_the_window(serving: ModuleType) -> None:
    rows = request("x1", "cmpl-1", 100.0, 0.001, "before") + request("x2", "cmpl-2", 101.0, 0.002) \
        + request("x3", "cmpl-3", 102.0, 0.003) + request("late", "cmpl-9", 500.0, 0.0, "after")  # outside
    rows.sort(key=lambda r: r["t"])
    b = serving.breakdown(rows, 99.0, 103.0)
    assert b["proxy_in"] == {"p50_ms": 1.0, "n": 3}
    assert b["prefill_forward"] == {"p50_ms": 55.0, "n": 3}
    assert b["ttft_at_proxy"] == {"p50_ms": 63.0, "n": 3}
    assert b["landed_after_signal"] == {"p50_ms": pytest.approx(0.1, abs=1e-3), "n": 3}  # joined via d.alloc
    assert b["decode_answer"] == {"p50_ms": pytest.approx(6.8, abs=1e-3), "n": 3}
    assert b["reported_to_scheduled"] == {"p50_ms": pytest.approx(1.5, abs=1e-3), "n": 3}  # joined via d.alloc
    assert b["scheduled_to_answer"] == {"p50_ms": pytest.approx(5.3, abs=1e-3), "n": 3}
    assert b["second_token_after_first"] == {"p50_ms": 5.0, "n": 3}
    assert b["dst_to_worker"] == {"p50_ms": pytest.approx(2.0, abs=1e-3), "n": 3}
    assert b["dst_to_scheduler"] == {"p50_ms": pytest.approx(2.5, abs=1e-3), "n": 3}
    assert b["bound"] == {"before": 1, "during": 2}
    assert serving.breakdown(rows, 0.0, 1.0) == {}


def test_the_report_shows_the_breakdown(serving: ModuleType, tmp_path: Path) -> None:
    rows = request("x1", "cmpl-1", 100.0)
    data = {"phase": "gpu", "configs": {
        "single": {"2k-c1": {"median_ttft_ms": 60.0, "p99_ttft_ms": 61.0, "median_itl_ms": 5.0, "completed": 1}},
        "push-mscclpp": {"2k-c1": {"median_ttft_ms": 61.2, "p99_ttft_ms": 62.0, "median_itl_ms": 5.0, "completed": 1,
                                   "breakdown": serving.breakdown(rows, 0, 1e9), "connector": {}}}}}
    f = tmp_path / "serving.json"
    f.write_text(json.dumps(data))
    serving.report([f], tmp_path)
    md = (tmp_path / "serving.md").read_text()
    assert "| gpu | push-mscclpp | 2k-c1 | 61.2 | 62.0 | 5.0 | 2.0 |" in md  # +2.0% over the single instance
    assert "Where the time went" in md and "| push-mscclpp | 2k-c1 | 1.0 | 2.0 |" in md


def test_interleaved_rounds_are_judged_against_their_own_rounds_baseline(serving: ModuleType, tmp_path: Path) -> None:
    def res(ttft: float) -> dict[str, Any]:
        return {"2k-c1": {"median_ttft_ms": ttft, "p99_ttft_ms": ttft + 1, "median_itl_ms": 5.0, "completed": 40,
                          "connector": {"prefill": {"layerwise": 40.0}, "decode": {"hold_s_sum": 0.1, "hold_n": 40}}}}

    # the baseline drifts 60 -> 50 -> 55 ms; the P/D pair stays 2% / 4% / 10% above the baseline of its round
    data = {"phase": "gpu", "configs": {
        "single": res(60.0), "push-ucx": res(61.2), "single#2": res(50.0), "push-ucx#2": res(52.0),
        "single#3": res(55.0), "push-ucx#3": res(60.5), "single-again": res(54.0)}}
    f = tmp_path / "serving.json"
    f.write_text(json.dumps(data))
    rows = serving.summarize([f])
    assert [(r["config"], r["round"], r["ttft_overhead_pct"]) for r in rows if r["config"].startswith("push")] == [
        ("push-ucx", 1, 2.0), ("push-ucx#2", 2, 4.0), ("push-ucx#3", 3, 10.0)]
    assert serving.paired(rows) == [
        {"config": "single", "setting": "2k-c1", "rounds": 3, "ttft_p50_ms_median": 55.0,
         "ttft_p50_ms_range": [50.0, 60.0], "overhead_pct_median": None, "overhead_pct_range": None},
        {"config": "push-ucx", "setting": "2k-c1", "rounds": 3, "ttft_p50_ms_median": 60.5,
         "ttft_p50_ms_range": [52.0, 61.2], "overhead_pct_median": 4.0, "overhead_pct_range": [2.0, 10.0]}]
    serving.report([f], tmp_path)
    md = (tmp_path / "serving.md").read_text()
    assert "| push-ucx | 2k-c1 | 3 | 60.5 | [52.0, 61.2] | 4.0 | [2.0, 10.0] |" in md


def test_vllms_own_request_metrics_are_read_on_the_instance_that_computed_the_prompt(
        serving: ModuleType, tmp_path: Path) -> None:
    def engine(ttft_s: float, queue_s: float, prefill_s: float, n: float) -> dict[str, float]:
        return {"engine_ttft_s_sum": ttft_s, "engine_ttft_n": n, "queue_s_sum": queue_s, "queue_n": n,
                "prefill_s_sum": prefill_s, "prefill_n": n}

    # the decode observes its own TTFT too (a much smaller one): it must not be mixed into the prefill's figures
    data = {"phase": "gpu", "configs": {
        "single": {"2k-c1": {"median_ttft_ms": 56.0, "mean_ttft_ms": 56.5, "connector": {
            "single": engine(2.0, 0.02, 1.9, 40)}}},
        "push-ucx": {"2k-c1": {"median_ttft_ms": 59.0, "mean_ttft_ms": 59.4, "connector": {
            "decode-ucx": engine(0.4, 0.01, 0.2, 40), "prefill-ucx": engine(2.08, 0.04, 1.92, 40)}}},
        "nixl": {"2k-c1": {"median_ttft_ms": 70.0, "connector": {}}}}}
    f = tmp_path / "serving.json"
    f.write_text(json.dumps(data))
    rows = {r["config"]: r for r in serving.summarize([f])}
    assert rows["single"]["engine"] == {"engine_ttft": 50.0, "queue": 0.5, "prefill": 47.5, "outside": 6.5}
    assert rows["push-ucx"]["engine"] == {"engine_ttft": 52.0, "queue": 1.0, "prefill": 48.0, "outside": 7.4}
    assert rows["nixl"]["engine"] is None
    serving.report([f], tmp_path)
    md = (tmp_path / "serving.md").read_text()
    assert "| push-ucx | 2k-c1 | 59.4 | 52.0 | 1.0 | 48.0 | 7.4 |" in md
    assert "| single | 2k-c1 | 56.5 | 50.0 | 0.5 | 47.5 | 6.5 |" in md
