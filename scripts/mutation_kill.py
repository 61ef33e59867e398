"""Check new tests against the survivors of a mutation run without running mutmut again.

A new mutmut run forgets every verdict as soon as a test file changed (docs/notes.md), so the tests written for a
run's survivors are checked here instead: each mutant named in NAMES_FILE (one full mutmut name a line) is switched
on through mutmut's own trampoline (``MUTANT_UNDER_TEST``) in the stage's mutated tree, and TEST_FILEs run against
it in a child forked from a process that imported the heavy modules once (as mutmut does): "killed NAME" when they
fail, "SURVIVED NAME" when they pass. With no mutant switched on they must pass first.

    python scripts/mutation_kill.py NAMES_FILE TEST_FILE...        (run by the venv that has mutmut: .vllm-venv)
    MUTATION_TREE=build/mutation-vllm/mutants (default; the core's is ./mutants)

The test files are copied (paths relative to this checkout) into a scratch copy of the tree. A kill here is a kill
by those files alone (a subset of the stage's selection). Each child is bounded (``--timeout`` per test, 300 s in
all); a mutant that hangs counts as killed, as in mutmut.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHILD_LIMIT = 300.0
# pytest's exit codes that say nothing about the mutant: 4 usage error (a test file missing), 5 no tests
# collected (1: a test failed, 2: collection failed, e.g. the mutant broke an import: both kills)
NOT_A_VERDICT = (4, 5)


def run_child(name: str, tests: list[str]) -> int:
    """Fork; the child runs ``tests`` with mutant ``name`` on and exits with pytest's code. Returns that code
    (-1: killed for running past CHILD_LIMIT)."""
    pid = os.fork()
    if pid == 0:  # child
        os.environ["MUTANT_UNDER_TEST"] = name
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        signal.alarm(int(CHILD_LIMIT))
        import pytest

        code = pytest.main(["-q", "-p", "no:cacheprovider", "-x", "--timeout=30", *tests])
        os._exit(int(code))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else -1


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    names = [n.strip() for n in Path(argv[0]).read_text().splitlines() if n.strip()]
    tests = argv[1:]
    tree = Path(os.environ.get("MUTATION_TREE", ROOT / "build" / "mutation-vllm" / "mutants"))
    if not tree.is_dir():
        print(f"no mutated tree at {tree}: run scripts/mutation.sh first", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="mutation-kill-"))
    try:
        shutil.copytree(tree, scratch, dirs_exist_ok=True)
        for t in tests:
            (scratch / t).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / t, scratch / t)
        os.chdir(scratch)
        sys.path.insert(0, str(scratch))
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch's pool does not survive a fork
        os.environ["MUTANT_UNDER_TEST"] = ""
        import pytest  # noqa: F401  (imported once here, inherited by every child)

        # what the test files import, loaded once (the mutated modules read MUTANT_UNDER_TEST on every call)
        for heavy in ("torch", "vllm", "hypothesis", "pytest_timeout", "kvtransport", "kvtransport_vllm.scheduler",
                      "kvtransport_vllm.worker", "kvtransport_vllm.connector"):
            try:
                __import__(heavy)
            except ImportError:
                pass
        if run_child("", tests) != 0:
            print("the tests fail with no mutant switched on: fix them first", file=sys.stderr)
            return 1
        for name in names:
            code = run_child(name, tests)
            missing = [t for t in tests if not (scratch / t).is_file()]
            if code in NOT_A_VERDICT or missing:  # the tests did not run (e.g. the scratch copy went away)
                print(f"ERROR {name}: pytest exit code {code}, test files missing: {missing}: stopped", flush=True)
                return 1
            print(f"{'SURVIVED' if code == 0 else 'killed'} {name}" + (f" (exit {code})" if code not in (0, 1) else ""),
                  flush=True)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
