"""Plots a reader can trust: whiskers from the repeated measurements, shared scales where panels compare."""

from __future__ import annotations

import math

import pytest

from kvtransport.bench import report


def test_spread_is_the_rate_of_the_slowest_and_fastest_sample():
    row = {"samples_s": [0.5, 0.25, 1.0], "min_s": 9, "max_s": 9}
    assert report.spread(row, 100.0) == (100.0, 400.0)
    assert report.spread({"min_s": 0.5, "max_s": 2.0}, 10.0) == (5.0, 20.0)
    lo, hi = report.spread({}, 1.0)
    assert math.isnan(lo) and math.isnan(hi)


def test_whiskers_are_distances_and_zero_when_unknown():
    assert report._whiskers([3.0, 5.0], [(1.0, 4.0), (float("nan"), 6.0)]) == [[2.0, 0.0], [1.0, 1.0]]


def _result() -> dict:
    rows = []
    for system in ("kvtransport/ucx", "kvtransport/nccl"):
        scale = 1.0 if system.endswith("ucx") else 100.0  # a 100x difference must stay visible
        for size in (4096, 1 << 20):
            rows.append({"workload": "sweep", "system": system, "bytes": size, "gbps": size / 1e-3 / 1e9 / scale,
                         "median_s": 1e-3 * scale, "samples_s": [1e-3 * scale, 2e-3 * scale]})
        for tokens in (128, 2048):
            rows.append({"workload": "overlap", "system": system, "case": {"preset": "llama-3.1-8b", "tokens": tokens},
                         "exposed_s": 0.001 * scale, "serialized_s": 0.01 * scale,
                         "samples_exposed_s": [0.001 * scale, 0.002 * scale], "samples_serialized_s": [0.01 * scale]})
            for coal in (True, False):
                rows.append({"workload": "kv", "system": system, "bytes": 1 << 20, "pct_of_ceiling": 50.0 / scale,
                             "median_s": 1.0, "samples_s": [1.0, 2.0],
                             "case": {"preset": "llama-3.1-8b", "tokens": tokens, "ids": "random", "coalesce": coal}})
    return {"rows": rows, "machine": {"device": "cpu", "date": "2026-12-01"},
            "ceiling": {"method": "memcpy", "by_size": {"4096": {"gbps": 10.0}, str(1 << 20): {"gbps": 10.0}}}}


def test_plots_share_scales_and_keep_legends_off_the_data(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    figures = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1])
    monkeypatch.setattr(plt, "close", lambda fig: None)
    files = report.plots(_result(), str(tmp_path))
    assert [f.rsplit("/", 1)[1] for f in files] == ["bandwidth_vs_size.png", "exposed_vs_prompt.png",
                                                   "kv_requests.png"]
    for fig, axes in figures:
        grid = axes.flat if hasattr(axes, "flat") else [axes]
        panels = [ax for ax in grid if ax.has_data()]
        for ax in panels:
            assert ax.get_legend() is None  # legends are the figure's, outside the axes
            assert any(c.__class__.__name__ == "ErrorbarContainer" or getattr(c, "errorbar", None) is not None
                       for c in ax.containers), "no whiskers"
        assert len(fig.legends) == 1
        if len(panels) > 1:
            assert len({ax.get_ylim() for ax in panels}) == 1  # one scale for the panels compared
