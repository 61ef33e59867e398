"""Make backends/ucx and backends/mscclpp importable when they are not installed."""

from __future__ import annotations

import os
import sys

for _name in ("ucx", "mscclpp"):
    _path = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "backends", _name))
    if os.path.isdir(_path) and _path not in sys.path:
        sys.path.insert(0, _path)
