"""CI type-checks every package: test.sh runs a bare ``mypy``, whose files come from pyproject.toml."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_covers_every_package_strictly():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    packages = {"kvtransport"} | {str(p.parent.relative_to(ROOT)) for pattern in
                                  ("backends/*/kvtransport_*/__init__.py", "integration/*/kvtransport_*/__init__.py")
                                  for p in ROOT.glob(pattern)}
    assert {"backends/ucx/kvtransport_ucx", "integration/vllm/kvtransport_vllm"} <= packages  # the globs found them
    assert packages <= set(config["files"]), packages - set(config["files"])
    assert config["strict"] is True
    assert "mypy\n" in (ROOT / "test.sh").read_text().splitlines(keepends=True)  # CI's ./test.sh runs it bare
