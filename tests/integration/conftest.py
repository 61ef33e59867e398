"""Fixtures of the vLLM integration tests. Every test here is marked ``vllm`` and skips when vLLM (or the
connector distribution) is not importable; see integration/vllm/ci_setup.sh for the environment."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _missing() -> str | None:
    for mod, hint in (("vllm", "vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)"),
                      ("kvtransport_vllm", "kvtransport-vllm is not installed (pip install -e integration/vllm)")):
        if importlib.util.find_spec(mod) is None:
            return hint
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM (CPU build is enough); slow end-to-end runs included")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _missing()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama made on the spot (or KVT_TINY_MODEL if set)."""
    if os.environ.get("KVT_TINY_MODEL"):
        path = Path(os.environ["KVT_TINY_MODEL"])
    else:
        path = tmp_path_factory.mktemp("tiny-llama")
    from .tiny_model import make_tiny_llama

    return str(make_tiny_llama(path))
