"""Data the scheduler side hands to the worker side each step (and back). Plain, picklable dataclasses.

The connector wraps :class:`StepPlan` in vLLM's ``KVConnectorMetadata`` (see ``connector.py``); this module
imports nothing from vLLM so the scheduler logic can be unit-tested on its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvtransport.coalesce import BlockRun

MAX_PARAM_CHARS = 512
"""Longest transfer id, engine id or address taken from a request's ``kv_transfer_params`` (longer: ignored)."""
NULL_BLOCK = 0
"""vLLM's null block: a sliding window's blocks that left the window point at it (never moved)."""


class FailureKind(enum.Enum):
    """Why a decode request's KV will not come (``StepPlan.recv_fail_kind``). The human reason travels with it;
    the kind is what code branches on (the worker counts a lost prefill as a ``prefill_disconnects`` too)."""

    REFUSED = "refused"
    """The prefill side said it cannot serve the request (its ``fail`` message: released, unknown transfer,
    incompatible caches, its push failed...)."""
    PREFILL_LOST = "prefill_lost"
    """The prefill's side channel dropped while the request waited for its KV (or for its admission)."""
    SIDE_CHANNEL_UNUSABLE = "side_channel_unusable"
    """The decode could not reach the prefill's side channel while the request waited for its admission."""
    ADMISSION_TIMEOUT = "admission_timeout"
    """The prefill did not start the transfer within ``transfer_timeout`` (push flow with ``admit_below``)."""


@dataclass(frozen=True)
class Failure:
    """A typed failure: what code branches on (``kind``) and what is logged and reported (``reason``)."""

    kind: FailureKind
    reason: str


@dataclass(frozen=True)
class Push:
    """Copy ``src`` blocks of prefill request ``req_id`` into ``dst`` blocks of decode sequence ``seq``: what the
    worker's :class:`~.pushplan.PushPlanner` makes due, into the layers its op names.

    ``engine`` names the decode engine (its workers' metadata came in ``StepPlan.peers``). ``delay`` (test-only,
    ``debug_push_delay``): seconds the worker holds back the sequence's final signal (it keeps serving other
    requests meanwhile; the prefill request is released after that signal).

    Unlike peers (other TP size, block size or head order: ``StepPlan.peer_geometry``) get a token range instead
    of block pairs: tokens ``[start, stop)``, ``src`` holding the prefill's tokens from ``src_first`` on, ``dst``
    the decode's from ``dst_first`` on. The worker expands such a push into one push per destination rank it
    serves (``rank``, ``runs``: :mod:`kvtransport.reshard` units; ``seq`` then names that rank's part, ``base``
    the decode request).
    """

    req_id: str
    seq: str
    engine: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    delay: float = 0.0
    start: int = -1
    """First token (unlike peers); -1: like-for-like, ``src[i]`` goes to ``dst[i]`` on the same rank."""
    stop: int = 0
    src_first: int = 0
    dst_first: int = 0
    rank: int = -1
    """(worker) destination tp rank; -1: ours."""
    runs: tuple[BlockRun, ...] | None = None
    """(worker) the unit runs to put; None: the block pairs."""
    base: str = ""
    """(worker) the decode request ``seq`` is a part of; empty: ``seq`` itself."""
    group: int = 0
    """The KV cache group whose layers this push fills (hybrid models: e.g. full and sliding-window attention)."""


@dataclass(frozen=True)
class SourceStep:
    """Scheduler -> worker: prefill request ``req_id`` (transfer ``xfer``) computes prompt tokens ``[start, stop)``
    in this step. ``groups``: its blocks so far, per KV cache group. ``layerwise``: puts may go while the forward
    runs (push mode); else only once the prompt is computed. ``delay``: test-only hold of its final signal."""

    req_id: str
    xfer: str
    prompt_len: int
    groups: tuple[tuple[int, ...], ...]
    start: int
    stop: int
    layerwise: bool = True
    delay: float = 0.0


@dataclass(frozen=True)
class Bind:
    """A destination of transfer ``xfer``: decode engine ``engine``'s request ``seq`` holds the prompt's blocks
    from block ``offset`` on in ``blocks`` (its own earlier blocks hold cached KV), and KV cache groups 1.. in
    ``groups``."""

    xfer: str
    engine: str
    seq: str
    blocks: tuple[int, ...]
    offset: int = 0
    groups: tuple[tuple[int, ...], ...] = ()


@dataclass
class StepPlan:
    """Everything the worker side needs for one engine step."""

    peers: dict[str, dict[int, bytes]] = field(default_factory=dict)
    """decode engine id -> tp rank -> kvtransport metadata (only engines the workers have not seen yet)."""
    peer_geometry: dict[str, dict[str, Any]] = field(default_factory=dict)
    """decode engine id -> its ``tp_size``, ``block_size``, ``kv_order`` (sent with ``peers``)."""
    sources: list[SourceStep] = field(default_factory=list)
    """Prefill requests this step computes (the workers track what is computed, :mod:`.pushplan`)."""
    binds: list[Bind] = field(default_factory=list)
    """Destinations the scheduler learnt since the last plan (a decode also sends them to the workers directly;
    the worker binds each once, whichever way comes first)."""
    cancels: list[tuple[str, str]] = field(default_factory=list)
    """(transfer, decode request): no more puts to that destination."""
    dropped: list[str] = field(default_factory=list)
    """Prefill requests given up (their decode went away, they failed): no more puts from them."""
    send_release: list[str] = field(default_factory=list)
    """Prefill requests that get no further pushes: report them finished_sending once flushed."""
    recv_start: dict[str, float] = field(default_factory=dict)
    """Decode requests now waiting for KV -> seconds they may wait."""
    recv_blocks: dict[str, list[int]] = field(default_factory=dict)
    """Decode requests now waiting for KV -> the blocks their KV lands in (reported if the receive fails)."""
    recv_abort: list[str] = field(default_factory=list)
    """Decode requests aborted while waiting: stop accepting their data, report finished_recving."""
    recv_fail: dict[str, str] = field(default_factory=dict)
    """Decode requests the prefill side cannot serve -> reason (reported as failed receives)."""
    recv_fail_kind: dict[str, FailureKind] = field(default_factory=dict)
    """The kind of each ``recv_fail`` entry (absent: ``FailureKind.REFUSED``)."""
    recv_from: dict[str, dict[int, str]] = field(default_factory=dict)
    """Decode requests -> tp rank -> the kvtransport instance id of the prefill worker that pushes to that
    rank (workers ``expect`` it: no other peer may write, signal or cancel the request)."""
    recv_hold: set[str] = field(default_factory=set)
    """Decode requests of the first-token flow now waiting for KV: report their KV landed only once
    ``recv_release`` names them (their first token is then part of their prompt)."""
    recv_release: set[str] = field(default_factory=set)
    """Decode requests whose first token was appended: no longer held (see ``recv_hold``)."""

    def is_empty(self) -> bool:
        return not (self.peers or self.sources or self.binds or self.cancels or self.dropped or self.send_release
                    or self.recv_start or self.recv_abort or self.recv_fail or self.recv_from or self.recv_hold
                    or self.recv_release)


@dataclass
class SendFailure:
    """A push the prefill worker could not complete; the scheduler tells the decode engine."""

    seq: str
    engine: str
    reason: str


def _short(value: Any) -> str | None:
    """``value`` as a non-empty id of at most MAX_PARAM_CHARS characters (a str or an int), else None."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    text = str(value)
    return text if 0 < len(text) <= MAX_PARAM_CHARS else None


def push_transfer_id(params: dict[str, Any] | None) -> str | None:
    """The push flow's transfer id of a request's ``kv_transfer_params``: ours (``kvt_xfer``, from
    ``kvtransport-proxy``) or Mooncake's (``transfer_id``, as vllm-router and llm-d's sidecar send it); None for
    the pull flow (NixlConnector's keys) or a malformed id."""
    if not params:
        return None
    return _short(params.get("kvt_xfer")) or _short(params.get("transfer_id"))


def side_channel_of(params: dict[str, Any]) -> tuple[str, int] | None:
    """The prefill side channel a decode request's ``kv_transfer_params`` name: ``remote_host`` /
    ``remote_port`` (ours and NixlConnector's keys), or the Mooncake shape's ``remote_engine_id`` as our bootstrap
    endpoint publishes it (``<engine id>@<host>:<port>``). None when absent or malformed (a port outside
    1..65535, a host of more than 253 characters)."""
    host, port = params.get("remote_host"), params.get("remote_port")
    if host is None and port is None:
        engine = _short(params.get("remote_engine_id"))
        if engine is None or "@" not in engine:
            return None
        host, _, port = engine.rpartition("@")[2].rpartition(":")
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        return None
    if isinstance(port, bool) or not isinstance(port, int | str):
        return None
    try:
        number = int(port)
    except ValueError:
        return None
    return (host, number) if 0 < number < 65536 else None

