"""Make backends/ucx importable when kvtransport_ucx is not installed."""

from __future__ import annotations

import os
import sys

_UCX_BACKEND = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "backends", "ucx"))
if os.path.isdir(_UCX_BACKEND) and _UCX_BACKEND not in sys.path:
    sys.path.insert(0, _UCX_BACKEND)
