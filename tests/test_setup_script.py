"""scripts/setup.sh: silent and near-instant when its inputs did not change; a failing step's output in full."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INPUTS = ["pyproject.toml", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("backends/*/pyproject.toml")),
          "backends/ucx/setup.py", "backends/ucx/kvtransport_ucx/_ucp_batch.c", "scripts/setup.sh"]


def checkout(tmp: Path) -> Path:
    """The set-up's inputs in a scratch directory (no real install happens in these tests)."""
    for rel in INPUTS:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp / rel)
    return tmp


def executable(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def setup(repo: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    return proc, time.monotonic() - t0


def test_unchanged_inputs_skip_everything_silently(tmp_path):
    repo = checkout(tmp_path)
    executable(repo / ".venv/bin/python", "exit 0\n")
    digest = hashlib.sha256(b"".join((repo / rel).read_bytes() for rel in INPUTS)).hexdigest()
    (repo / ".venv/.setup-stamp").write_text(digest + "\n")
    proc, took = setup(repo)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert took < 5.0  # the acceptance bound before the demo; it measures ~0.02 s
    with open(repo / "backends/ucx/pyproject.toml", "a") as f:  # an input changed: no skip
        f.write("# changed\n")
    proc, _ = setup(repo)
    assert proc.stdout.startswith("set-up: install inputs changed since the last set-up")


def test_a_failing_step_prints_its_output_in_full(tmp_path):
    repo = checkout(tmp_path)
    fake = repo / "fakebin"
    executable(fake / "python", 'echo "pip says: line 1"; echo "pip says: line 2" >&2; exit 1\n')
    executable(repo / ".venv/bin/python", "exit 0\n")
    (repo / ".venv/bin/activate").write_text(f'export PATH="{fake}:$PATH"\n')
    proc, _ = setup(repo)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["set-up failed while upgrading pip: python -m pip install -q --upgrade pip",
                                        "pip says: line 1", "pip says: line 2"]
    assert not (repo / ".venv/.setup-stamp").exists()


def test_a_python_without_venv_is_reported(tmp_path):
    repo = checkout(tmp_path)
    proc, _ = setup(repo, PYTHON="false")
    assert proc.returncode == 1
    assert "set-up failed while creating .venv with false" in proc.stderr


def test_a_successful_install_prints_two_lines_and_the_next_run_nothing(tmp_path):
    repo = checkout(tmp_path)
    fake = repo / "fakebin"
    noise = 'echo "Editable installation ... Please be careful with folders"; echo "pip warning" >&2\n'
    # python: noisy for pip, quiet success for `-c "import torch"`, the backend listing for `python -`
    executable(fake / "python", 'if [ "$1" = - ]; then cat >/dev/null; echo "backends usable here: fake"; exit 0; fi\n'
               'if [ "$1" = -c ]; then exit 0; fi\n' + noise)
    executable(fake / "pip", noise)
    executable(fake / "ruff", "exit 0\n")
    executable(fake / "mypy", "exit 0\n")
    executable(repo / ".venv/bin/python", "exit 0\n")
    (repo / ".venv/bin/activate").write_text(f'export PATH="{fake}:$PATH"\n')
    proc, _ = setup(repo)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "set-up: install inputs changed since the last set-up; reinstalling into .venv"
    assert len(lines) == 2 and lines[1].startswith("set-up done in ") and lines[1].endswith(
        " s; backends usable here: fake"), lines
    assert "Please be careful" in (repo / ".venv/setup.log").read_text()  # kept, not shown
    digest = hashlib.sha256(b"".join((repo / rel).read_bytes() for rel in INPUTS)).hexdigest()
    assert (repo / ".venv/.setup-stamp").read_text() == digest + "\n"
    proc, _ = setup(repo)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
