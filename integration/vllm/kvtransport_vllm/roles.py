"""What the scheduler side (:mod:`.scheduler`) hands each role it plays when it makes it: the prefill
(:mod:`.producer`) and the decode (:mod:`.consumer`) never see the scheduler side itself, only this and the
few channels their constructors name. Everything here is used on the scheduler thread, like the roles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .config import ConnectorSettings
from .metadata import TransferParams


@dataclass(frozen=True)
class RoleContext:
    """The common part both roles read."""

    settings: ConnectorSettings
    engine_id: str
    tp_size: int
    num_groups: int
    """KV cache groups (hybrid models: full and sliding-window attention)."""
    counters: dict[str, int]
    """Scheduler-side counters (lease expirations, decodes lost, first tokens): the roles count into it, the
    scheduler side reports and zeroes it in place (``stats_delta``)."""
    params: Callable[[Any], TransferParams]
    """A request's checked ``kv_transfer_params`` (never raises; refused ones read as none: the scheduler side
    sends such a request down the failure path before a role sees it)."""


__all__ = ["RoleContext"]
