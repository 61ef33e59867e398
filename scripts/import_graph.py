#!/usr/bin/env python3
"""The project's import graph: cycles among its modules and imports of another module's ``_private`` names.

    python scripts/import_graph.py            # report; exit 1 when there is a cycle or a private import
    python scripts/import_graph.py --dot      # the graph in Graphviz dot (docs/architecture.md is drawn from it)

Every ``import``/``from ... import`` of the packages below counts, wherever it stands: at the top, inside a
function (a lazy import is still a dependency), under ``if TYPE_CHECKING:`` (a type-only import still couples the
two modules). A package's ``__init__`` is a module like any other; ``from pkg import name`` depends on
``pkg.name`` when that is a module, else on ``pkg`` itself. Reads the sources only (imports nothing), so it runs
anywhere in a second. tests/test_import_graph.py runs it in CI.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "kvtransport": "kvtransport",
    "kvtransport_ucx": "backends/ucx/kvtransport_ucx",
    "kvtransport_mscclpp": "backends/mscclpp/kvtransport_mscclpp",
    "kvtransport_nccl": "backends/nccl/kvtransport_nccl",
    "kvtransport_vllm": "integration/vllm/kvtransport_vllm",
}


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    names: tuple[str, ...]  # the names imported from dst (empty for ``import dst``)


def modules(root: Path | None = None) -> dict[str, Path]:
    """Every module of the packages under ``root`` (default: this checkout): dotted name -> file."""
    out: dict[str, Path] = {}
    for pkg, rel in PACKAGES.items():
        base = (root or ROOT) / rel
        for f in sorted(base.rglob("*.py")):
            parts = [pkg, *f.relative_to(base).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _package_of(mod: str, path: Path) -> str:
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def edges(mods: dict[str, Path]) -> list[Edge]:
    """Every import from one project module of another (or of a name in another)."""
    out: list[Edge] = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _owner(alias.name, mods)
                    if target is not None and target != mod:
                        out.append(Edge(mod, target, node.lineno, ()))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _package_of(mod, path).split(".")
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    name = ".".join([*base, node.module] if node.module else base)
                else:
                    name = node.module or ""
                for alias in node.names:
                    sub = f"{name}.{alias.name}"
                    if sub in mods:  # ``from pkg import module``
                        if sub != mod:
                            out.append(Edge(mod, sub, node.lineno, ()))
                        continue
                    target = _owner(name, mods)
                    if target is not None and target != mod:
                        out.append(Edge(mod, target, node.lineno, (alias.name,)))
    return out


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` is, or lives in; None when it is not the project's."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def graph_of(es: Iterable[Edge], mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules it imports."""
    g: dict[str, set[str]] = {m: set() for m in mods}
    for e in es:
        g[e.src].add(e.dst)
    return g


def private_imports(es: Iterable[Edge]) -> list[Edge]:
    """Imports of a ``_name`` (not a dunder) from another module of the project."""
    return [e for e in es if any(n.startswith("_") and not n.startswith("__") for n in e.names)]


def report(root: Path | None = None) -> tuple[list[list[str]], list[Edge]]:
    """(the cycles, the private imports) of the checkout at ``root`` (default: this one)."""
    mods = modules(root)
    es = edges(mods)
    return cycles(graph_of(es, mods)), private_imports(es)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot")
    args = ap.parse_args(argv)
    mods = modules()
    es = edges(mods)
    if args.dot:
        print("digraph imports {")
        for src, dst in sorted({(e.src, e.dst) for e in es}):
            print(f'  "{src}" -> "{dst}";')
        print("}")
        return 0
    cyc, priv = cycles(graph_of(es, mods)), private_imports(es)
    for comp in cyc:
        inside = set(comp)
        print(f"cycle of {len(comp)} modules: {', '.join(comp)}")
        for e in sorted({(e.src, e.dst, e.line) for e in es if e.src in inside and e.dst in inside}):
            print(f"    {e[0]} -> {e[1]}  ({mods[e[0]].relative_to(ROOT)}:{e[2]})")
    for e in priv:
        print(f"private import: {e.src} imports {', '.join(e.names)} from {e.dst} "
              f"({mods[e.src].relative_to(ROOT)}:{e.line})")
    print(f"{len(mods)} modules, {len({(e.src, e.dst) for e in es})} imports: {len(cyc)} cycle(s), "
          f"{len(priv)} private import(s)")
    return 1 if cyc or priv else 0


if __name__ == "__main__":
    sys.exit(main())
