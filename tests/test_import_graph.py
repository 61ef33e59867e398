"""scripts/import_graph.py: no import cycle among the project's modules (type-only imports included) and no import
of another module's private name (issue 31)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def graph(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("scripts/import_graph.py")


def test_the_project_has_no_new_import_cycle_or_private_import(graph: ModuleType) -> None:
    cycles, private = graph.report()
    assert cycles == []
    assert {(e.src, e.dst, n) for e in private for n in e.names} == set()


def test_every_package_is_read(graph: ModuleType) -> None:
    """The report covers the core, the three backends and the connector (a package left out would pass)."""
    mods = graph.modules()
    for name in ("kvtransport.manager", "kvtransport_ucx.transport", "kvtransport_mscclpp.spec",
                 "kvtransport_nccl.transport", "kvtransport_vllm.scheduler"):
        assert name in mods, name
    assert len(mods) > 80


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cycles_through_lazy_type_only_and_relative_imports_are_found(graph: ModuleType, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph, "PACKAGES", {"pkg": "src/pkg"})
    _tree(tmp_path, {
        "src/pkg/__init__.py": "",
        "src/pkg/a.py": "from .b import thing\n",
        "src/pkg/b.py": "def f():\n    from pkg import c\n",  # lazy
        "src/pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",  # type-only
        "src/pkg/d.py": "from pkg.e import _secret, __version__\nimport pkg.a\n",
        "src/pkg/e.py": "_secret = 1\n__version__ = '1'\n",
        "src/pkg/sub/__init__.py": "from ..e import _secret\n",
    })
    cycles, private = graph.report(tmp_path)
    assert cycles == [["pkg.a", "pkg.b", "pkg.c"]]
    assert sorted((e.src, e.dst, e.names) for e in private) == [("pkg.d", "pkg.e", ("_secret",)),
                                                                ("pkg.sub", "pkg.e", ("_secret",))]


def test_the_script_exits_non_zero_on_a_cycle(graph: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(graph, "PACKAGES", {"pkg": "pkg"})
    monkeypatch.setattr(graph, "ROOT", tmp_path)
    _tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "import pkg.a\n"})
    assert graph.main([]) == 1
    out = capsys.readouterr().out
    assert "cycle of 2 modules: pkg.a, pkg.b" in out and "pkg/a.py:1" in out
    _tree(tmp_path, {"pkg/b.py": "import os\n"})
    assert graph.main([]) == 0
