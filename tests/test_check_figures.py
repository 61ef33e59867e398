"""scripts/check_figures.py: a figure passes only when a log or JSON that its own section cites holds it."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def checker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load_script: Callable[[str], ModuleType]) -> ModuleType:
    monkeypatch.delitem(sys.modules, "check_figures", raising=False)  # (restored after the test)
    mod = load_script("scripts/check_figures.py")
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    run = tmp_path / "docs" / "cpu-runs" / "run1"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps({"rows": [{"gbps": 4.2534, "pct_of_ceiling": 43.04}]}))
    (run / "table.md").write_text("| x | 1.87 (69%) |\n")
    (run / "README.md").write_text("prose: 9.99 GB/s\n")
    (tmp_path / "docs" / "other").mkdir()
    (tmp_path / "docs" / "other" / "log.txt").write_text("7.77 GB/s\n")
    return mod


def _failing(mod: ModuleType, text: str, allow: str = "") -> list[str]:
    (mod.ROOT / "docs" / "b.md").write_text(text)
    (mod.ROOT / "allow.toml").write_text(allow)
    failing, stale, _ = mod.check(["docs/b.md"], mod.ROOT / "allow.toml")
    return sorted(f.value for f, _ in failing) + [f"stale {e['figure']}" for e in stale]


def test_figures_match_the_run_their_section_cites(checker: ModuleType) -> None:
    text = "## A\n\nSee [run](cpu-runs/run1/table.md).\n\n4.25 GB/s at 43% of the ceiling; 1.87 GB/s (69%).\n"
    assert _failing(checker, text) == []


def test_a_figure_elsewhere_or_in_prose_or_uncited_fails(checker: ModuleType) -> None:
    text = ("## A\n\nSee [run](cpu-runs/run1/table.md): 7.77 GB/s, 9.99 GB/s, 4.4 GB/s, 44%.\n\n"
            "## B\n\n4.25 GB/s, nothing cited here.\n")
    assert _failing(checker, text) == ["4.25", "4.4", "44", "7.77", "9.99"]


def test_a_percentage_needs_a_percentage(checker: ModuleType) -> None:
    text = "## A\n\n[run](cpu-runs/run1/results.json): 4.25% is no share.\n"  # 4.2534 is a GB/s value
    assert _failing(checker, text) == ["4.25"]


def test_tables_give_their_gbs_figures_by_cell(checker: ModuleType) -> None:
    text = ("## A\n\n[run](cpu-runs/run1/)\n\n| system | GB/s |\n|---|---|\n| ucx | 1.87 (69%) |\n"
            "| ceiling | 4.25 |\n| nccl | 2.5 (70%) |\n")
    assert _failing(checker, text) == ["2.5", "70"]


def test_thresholds_are_not_figures_and_derived_ones_need_an_entry(checker: ModuleType) -> None:
    text = "## A\n\n[run](cpu-runs/run1/)\n\nTarget: at least 80%, ≥ 90%; missed by 37 points, 2 points short.\n"
    allow = '[[derived]]\ndoc = "docs/b.md"\nfigure = "37"\nnear = "missed by 37"\nhow = "80 - 43.04"\n'
    assert _failing(checker, text, allow) == ["2"]
    stale = allow.replace("37", "38")
    assert _failing(checker, text, stale) == ["2", "37", "stale 38"]


def test_a_transcript_needs_its_own_citation(checker: ModuleType) -> None:
    text = "## A\n\n[run](cpu-runs/run1/)\n\nIt printed:\n\n```\n4.25 GB/s\n```\n"
    assert _failing(checker, text) == ["4.25"]
    cited = "## A\n\nIt printed ([log](cpu-runs/run1/results.json)):\n\n```\n4.25 GB/s\n```\n"
    assert _failing(checker, cited) == []
