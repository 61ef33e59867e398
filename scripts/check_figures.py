"""Every GB/s and % figure in README.md and docs/benchmarks.md must come from a committed log or JSON.

Each figure is looked up only in the files that its own part of the document cites, not in every log of the
repository (a global search would find "33%" somewhere for any figure):

* the part is the figure's block (a paragraph, a table, a code block, a list item); its citations are the
  links and paths in the block, else (a table or code block) in the paragraph just before it, else (not for
  a code block: a transcript names its own log) in its section (the text under its heading, then the
  headings above);
* a cited file under docs/cpu-runs/ or docs/gpu-runs/ stands for its whole run directory (the JSON next to a
  cited table, the logs next to a cited README); a cited directory for every file in it;
* evidence is what those directories hold, except prose (README.md, NEXT.md) and images: the numbers of logs
  and tables, and of JSON. A % figure needs a number written with % in a log or table, or a JSON value under a
  key with ``pct``, ``percent`` or ``share`` (a share as a percentage); a GB/s figure any other number (tables
  give their units in the headers).

A figure matches a number of the evidence that rounds to it at the figure's own precision ("4.25" matches
4.2534, "83%" matches 83.3; the sign is not compared: "+22.0%" and "-19.5%" are changes). Figures:

* a number (or a range, ``26-48%`` with a hyphen or an en dash, or a list, ``1.72 / 2.01 / 2.40 GB/s``) written with ``%``, ``points``
  (percentage points) or ``GB/s``;
* in a table that mentions GB/s, the number before ``(NN%)`` in a cell, and bare numbers under a header
  that says GB/s.

Not figures: a percentage after a comparison or a target (``≥ 80%``, ``above 50%``, ``target 90%``) is a
threshold, not a measurement, and so is one before "mark", "larger" or "share of".

docs/figures-derived.toml lists the figures computed from logged numbers (a ratio or a difference of two of
them; percentage points always are) with the computation, and the few targets the threshold rule cannot tell
from a measurement ("The 80% is missed"). An entry that matches no figure fails the check too.

    python scripts/check_figures.py            # exit 1 and the list when a figure has no source
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/benchmarks.md"]
ALLOW_LIST = "docs/figures-derived.toml"
RUN_ROOTS = ("docs/cpu-runs", "docs/gpu-runs")
PROSE = {"README.md", "NEXT.md"}
EVIDENCE_SUFFIXES = {".json", ".txt", ".log", ".md", ".csv"}

NUM = r"\d[\d,]*(?:\.\d+)?"
MINUS, EN_DASH = "\u2212", "\u2013"  # as the docs write them
DASH = rf"\s*[{EN_DASH}-]\s*"
PCT = re.compile(rf"(?<![\w.])([+{MINUS}-]?{NUM})(?:{DASH}({NUM}))?(\s*%|\s+points?\b)")
GBS = re.compile(rf"(?<![\w.])({NUM}(?:\s*(?:/|{DASH})\s*{NUM})*)\s*GB/s")
CELL_PCT = re.compile(rf"^\**({NUM})\**\s*(?:GB/s\s*)?\**\s*\([+{MINUS}-]?{NUM}%\)")
BARE = re.compile(rf"^\**({NUM})\**\*?$")
THRESHOLD = re.compile(r"(≥|≤|>|<|\bat (least|most)|\babove|\bbelow|\bunder|\bover|\btarget|\bup to|\bthan)\s*$",
                       re.IGNORECASE)
# ... or before one: "the 70% mark", "a pool 25% larger", "the 60% share of memory the bench allows itself"
THRESHOLD_AFTER = re.compile(r"^\s*(mark\b|larger\b|smaller\b|share of\b|of MemAvailable\b)")
LINK = re.compile(r"\]\(([^)#\s]+)[^)]*\)")
PATH = re.compile(r"(?<![\w/.])((?:docs/)?(?:cpu-runs|gpu-runs|img)/[\w./-]+)")


@dataclass
class Block:
    doc: str
    line: int  # 1-based line of the block's first line
    lines: list[str]
    kind: str  # "para", "table", "code"
    sections: list[int]  # indices into the document's section list, innermost first
    cites: set[Path] = field(default_factory=set)


@dataclass
class Figure:
    doc: str
    line: int
    text: str  # as written, e.g. "4.25 GB/s" or "26-48%"
    value: str  # one number of it, as written
    unit: str  # "%", "points" (percentage points: a difference, never logged as such) or "GB/s"
    context: str  # the source line

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _number(text: str) -> tuple[float, int]:
    """(value, decimals) of a number as written ("1,253" -> 1253, 0)."""
    text = text.replace(",", "").replace(MINUS, "-").lstrip("+-")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return float(text), decimals


def parse(doc: str, text: str) -> tuple[list[Block], list[set[Path]]]:
    """The document's blocks and, per section, the paths its text cites."""
    blocks: list[Block] = []
    section_cites: list[set[Path]] = [set()]
    stack: list[tuple[int, int]] = [(0, 0)]  # (heading level, section index)
    cur: Block | None = None
    in_code = False
    base = (ROOT / doc).parent
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if in_code:
                in_code = False
                cur = None
                continue
            in_code = True
            cur = Block(doc, n, [], "code", [s for _, s in reversed(stack)])
            blocks.append(cur)
            continue
        if in_code:
            assert cur is not None
            cur.lines.append(line)
            continue
        heading = re.match(r"^(#+)\s", line)
        if heading:
            level = len(heading.group(1))
            while stack and stack[-1][0] >= level:
                stack.pop()
            section_cites.append(set())
            stack.append((level, len(section_cites) - 1))
            section_cites[-1] |= cites(line, base)
            cur = None
            continue
        if not stripped:
            cur = None
            continue
        kind = "table" if stripped.startswith("|") else "para"
        new_item = kind == "para" and re.match(r"^([*-]|\d+\.)\s", stripped) is not None
        if cur is None or cur.kind != kind or new_item:
            cur = Block(doc, n, [], kind, [s for _, s in reversed(stack)])
            blocks.append(cur)
        cur.lines.append(line)
        found = cites(line, base)
        cur.cites |= found
        section_cites[stack[-1][1]] |= found
    for b in blocks:
        if b.kind == "code":
            b.cites = set().union(*(cites(line, base) for line in b.lines)) if b.lines else set()
    return blocks, section_cites


def cites(line: str, base: Path) -> set[Path]:
    """Paths a line links or names, resolved (README.md's are relative to the root, benchmarks.md's to docs/)."""
    out = set()
    for target in LINK.findall(line) + PATH.findall(line):
        for start in (base, ROOT, ROOT / "docs"):
            p = (start / target).resolve()
            if p.exists() and ROOT in p.parents:
                out.add(p)
                break
    return out


def evidence_files(cited: set[Path]) -> set[Path]:
    files: set[Path] = set()
    for p in cited:
        rel = p.relative_to(ROOT).as_posix()
        root = next((r for r in RUN_ROOTS if rel.startswith(r + "/")), None)
        if root is not None:  # the whole run directory: docs/gpu-runs/<run>/
            p = ROOT / root / rel[len(root) + 1:].split("/")[0]
        if p.is_dir():
            files |= {f for f in p.rglob("*") if f.is_file()}
        elif root is not None:
            files.add(p)
    return {f for f in files if f.suffix in EVIDENCE_SUFFIXES and f.name not in PROSE}


_numbers_cache: dict[Path, dict[str, list[float]]] = {}
PCT_AFTER = re.compile(r"\s*%")
PCT_KEY = re.compile(r"pct|percent|share")


def numbers(path: Path) -> dict[str, list[float]]:
    """The numbers of an evidence file by unit: "%" (written with %, or in JSON under a key with pct, percent or
    share: a share as a percentage) and "GB/s" (every other number: units of tables are in their headers)."""
    if path not in _numbers_cache:
        out: dict[str, list[float]] = {"%": [], "GB/s": []}
        if path.suffix == ".json":
            _walk(json.loads(path.read_text()), "", out)
        else:
            text = path.read_text(errors="replace")
            for m in re.finditer(NUM, text):
                out["%" if PCT_AFTER.match(text, m.end()) else "GB/s"].append(_number(m.group(0))[0])
        _numbers_cache[path] = out
    return _numbers_cache[path]


def _walk(obj: Any, key: str, out: dict[str, list[float]]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, str(k), out)
    elif isinstance(obj, list):
        for v in obj:
            _walk(v, key, out)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if PCT_KEY.search(key):
            out["%"].append(100.0 * obj if "share" in key else float(obj))
        else:
            out["GB/s"].append(float(obj))
    elif isinstance(obj, str):
        for m in re.finditer(NUM, obj):
            out["%" if PCT_AFTER.match(obj, m.end()) else "GB/s"].append(_number(m.group(0))[0])


def figures(block: Block) -> Iterator[Figure]:
    table_gbs = block.kind == "table" and any("GB/s" in line for line in block.lines)
    header: list[str] = []
    for i, line in enumerate(block.lines):
        n = block.line + i
        for m in PCT.finditer(line):
            if THRESHOLD.search(line[: m.start()]) or THRESHOLD_AFTER.match(line[m.end():]):
                continue
            unit = "%" if m.group(3).strip() == "%" else "points"
            for g in (m.group(1), m.group(2)):
                if g:
                    yield Figure(block.doc, n, m.group(0), g, unit, line)
        for m in GBS.finditer(line):
            for g in re.findall(NUM, m.group(1)):
                yield Figure(block.doc, n, m.group(0), g, "GB/s", line)
        if block.kind != "table":
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if i == 0:
            header = cells
        if not table_gbs or i == 0 or set(line) <= set("|-: "):
            continue
        for col, cell in enumerate(cells):
            if "GB/s" in cell:
                continue  # found above
            cm = CELL_PCT.match(cell)
            if cm is None and col < len(header) and "GB/s" in header[col]:
                cm = BARE.match(cell)
            if cm:
                yield Figure(block.doc, n, cell, cm.group(1), "GB/s", line)


def matches(value: str, evidence: list[float]) -> bool:
    v, decimals = _number(value)
    tol = 0.5 * 10 ** -decimals + 1e-9
    return any(abs(abs(x) - v) <= tol for x in evidence)


def load_allow_list(path: Path) -> list[dict[str, str]]:
    """[[derived]] entries (doc, figure, near, how: the computation from logged numbers) and [[target]] entries
    (doc, figure, near, how: whose target or setting it is), one list."""
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text())
    entries: list[dict[str, str]] = data.get("derived", []) + data.get("target", [])
    for e in entries:
        missing = {"doc", "figure", "near", "how"} - set(e)
        if missing:
            raise SystemExit(f"{path}: an entry lacks {sorted(missing)}: {e}")
    return entries


def check(docs: list[str], allow_path: Path) -> tuple[list[tuple[Figure, list[Path]]], list[dict[str, str]], int]:
    """(figures without a source with the files searched, allow-list entries that matched nothing, figures seen)."""
    allow = load_allow_list(allow_path)
    used = [False] * len(allow)
    failing: list[tuple[Figure, list[Path]]] = []
    seen = 0
    for doc in docs:
        blocks, section_cites = parse(doc, (ROOT / doc).read_text())
        for idx, block in enumerate(blocks):
            cited = block.cites
            if not cited and block.kind in ("table", "code") and idx > 0 and blocks[idx - 1].kind == "para" \
                    and blocks[idx - 1].sections == block.sections:
                cited = blocks[idx - 1].cites
            for s in block.sections if block.kind != "code" else []:  # its section, then the headings above
                if cited:
                    break
                cited = section_cites[s]
            files = sorted(evidence_files(cited))
            evidence = {u: [x for f in files for x in numbers(f)[u]] for u in ("%", "GB/s")}
            evidence["points"] = []
            for fig in figures(block):
                seen += 1
                if matches(fig.value, evidence[fig.unit]):
                    continue
                hit = [i for i, e in enumerate(allow) if e["doc"] == fig.doc and e["figure"] == fig.value
                       and e["near"] in fig.context]
                for i in hit:
                    used[i] = True
                if not hit:
                    failing.append((fig, files))
    stale = [e for e, u in zip(allow, used, strict=True) if not u]
    return failing, stale, seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs", nargs="*", default=DOCS)
    ap.add_argument("--allow-list", type=Path, default=ROOT / ALLOW_LIST)
    ap.add_argument("-v", "--verbose", action="store_true", help="also list the files searched for each figure")
    args = ap.parse_args(argv)
    failing, stale, seen = check(args.docs, args.allow_list)
    for fig, files in failing:
        print(f"{fig.where()}: {fig.value} (in {fig.text!r}) is in no log or JSON its section cites"
              + ("" if files else " (it cites none)"))
        if args.verbose:
            for f in files:
                print(f"    searched {f.relative_to(ROOT)}")
    for e in stale:
        print(f"{args.allow_list.name}: the entry for {e['figure']} near {e['near']!r} in {e['doc']} matches no figure")
    status = "ok" if not failing and not stale else "FAILED"
    print(f"check_figures: {status}: {seen} figures, {len(failing)} without a source, {len(stale)} stale allow-list "
          "entries", file=sys.stderr)
    return 1 if failing or stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
