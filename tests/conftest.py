import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, Phase, settings

settings.register_profile("ci", derandomize=True, max_examples=200, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Mutation runs (scripts/mutation.sh, docs/mutation.md) cap every property test's examples, including those
# with their own @settings(max_examples=...): a surviving mutant costs the full run of every test that covers
# it, and the structured fuzz tests ask for up to 2,500 examples each. Deterministic (the ci profile). They also
# skip shrinking: a killed mutant needs one failing example, not the smallest, and shrinking one through the
# push planner's harness ran past mutmut's CPU limit (each such mutant cost a minute as a timeout, 2026-12-04).
_MAX_EXAMPLES = int(os.environ.get("KVT_HYPOTHESIS_MAX_EXAMPLES", "0"))
_NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
# left whole: test_the_layout_fuzzing_reached_accepted_layouts counts how many layouts this one saw accepted
_UNCAPPED = {"test_layouts_from_the_wire_have_blocks_layers_and_non_negative_planes"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if _MAX_EXAMPLES <= 0:
        return
    for item in items:
        test = getattr(item, "obj", None)
        if getattr(test, "__name__", "") in _UNCAPPED:
            continue
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None:
            test._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
                own, max_examples=min(own.max_examples, _MAX_EXAMPLES), phases=_NO_SHRINK)


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], ModuleType]:
    """``load_script("benchmarks/serving.py")``: a fresh module of one of the repository's scripts (benchmarks/,
    scripts/), which are not packages; registered in ``sys.modules`` under its file name while it executes
    (dataclasses look their module up there) and left there."""

    def load(relpath: str) -> ModuleType:
        path = REPO / relpath
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None, path
        mod = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
