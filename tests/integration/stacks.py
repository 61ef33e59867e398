"""Stack dumps of running vLLM instances, for a request that stalls (test-only diagnostics).

A stalled step on the 2-core CI host (docs/notes.md, "TP2 prefill") leaves no evidence: vLLM's own error says only
that its workers did not answer in 300 s, and CI keeps no log directory. :func:`watch` arms a timer around a
request; when the request is still pending after ``after_s`` seconds, every process of the given instances (API
server, engine core, TP workers; found as the process tree under each ``Proc``) is dumped with ``py-spy dump`` (no
pause of the target: ``--nonblocking``), again every ``after_s`` while it stays pending. The full dumps go to
``<log_dir>/stacks-<label>-<time>/``; a short form (each thread's state, the main thread's and every non-idle
thread's top frames) is printed, so the CI output carries it. Without py-spy (``pip install py-spy``;
integration/vllm/ci_setup.sh installs it) one line says so. ``KVT_E2E_STALL_DUMP_S`` sets ``after_s`` (0: off);
``KVT_E2E_STALL_NATIVE=1`` adds C frames (``--native``, which pauses each process while it is read).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

STALL_DUMP_S = float(os.environ.get("KVT_E2E_STALL_DUMP_S", "60"))
NATIVE = os.environ.get("KVT_E2E_STALL_NATIVE", "0") == "1"
SHORT_FRAMES = 8


def py_spy() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc; no dependency)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip().replace("/", "_").replace(":", "_") or "?"
    except OSError:
        return "?"


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def short(dump: str) -> str:
    """Each thread's header line; for the main thread and non-idle threads also their top frames."""
    out: list[str] = []
    keep = 0
    for line in dump.splitlines():
        if line.startswith("Thread "):
            out.append("  " + line)
            keep = SHORT_FRAMES if ("MainThread" in line or "(idle)" not in line) else 0
        elif keep and line.startswith("    "):
            out.append("  " + line)
            keep -= 1
    return "\n".join(out)


def dump(procs: Iterable[Any], log_dir: Path, label: str, native: bool = False) -> str:
    """py-spy every process of ``procs`` (objects with ``.name`` and ``.proc``, like test_e2e_pd.Proc); the full
    dumps under ``log_dir``, the short form returned (and printed)."""
    exe = py_spy()
    if exe is None:
        msg = f"[stacks] {label}: py-spy is not installed (pip install py-spy): no stack dump"
        print(msg, flush=True)
        return msg
    where = Path(log_dir) / f"stacks-{label}-{time.strftime('%H%M%S')}"
    where.mkdir(parents=True, exist_ok=True)
    lines = [f"[stacks] {label}: load {os.getloadavg()}, full dumps in {where}"]
    for proc in procs:
        if proc.proc.poll() is not None:
            lines.append(f"--- {proc.name}: exited ({proc.proc.returncode})")
            continue
        for pid in process_tree(proc.proc.pid):
            # --native (C frames too: a spin in a torch op, a lock) pauses the target while it reads it
            cmd = [exe, "dump", "--pid", str(pid), *(["--native"] if native else ["--nonblocking"])]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
                text = r.stdout + r.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"py-spy failed: {exc!r}"
            name = _comm(pid)
            (where / f"{proc.name}-{name}-{pid}.txt").write_text(text)
            lines.append(f"--- {proc.name} pid {pid} ({name}, cpu {_cpu_s(pid):.1f}s)\n{short(text)}")
    out = "\n".join(lines)
    print("\n" + out, flush=True)
    return out


@contextlib.contextmanager
def watch(procs: Iterable[Any], log_dir: Path, label: str, after_s: float = STALL_DUMP_S) -> Iterator[None]:
    """Dump the stacks of ``procs`` if the block is still running after ``after_s`` s (then every ``after_s``)."""
    if after_s <= 0:
        yield
        return
    done = threading.Event()
    procs = list(procs)

    def run() -> None:
        n = 0
        while not done.wait(after_s):
            n += 1
            try:
                dump(procs, log_dir, f"{label}-{n * after_s:.0f}s", native=NATIVE)
            except Exception as exc:  # diagnostics never fail the test
                print(f"[stacks] {label}: dump failed: {exc!r}", flush=True)

    t = threading.Thread(target=run, name=f"stall-watch-{label}", daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
