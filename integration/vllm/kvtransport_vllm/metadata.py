"""Data the scheduler side hands to the worker side each step (and back). Plain, picklable dataclasses.

The connector wraps :class:`StepPlan` in vLLM's ``KVConnectorMetadata`` (see ``connector.py``); this module
imports nothing from vLLM so the scheduler logic can be unit-tested on its own.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtransport.coalesce import BlockRun

MAX_PARAM_CHARS = 512
"""Longest transfer id, request id or engine id in a request's ``kv_transfer_params`` (longer: the request is
refused). The side channel carries ids of up to ``protocol.MAX_ID_CHARS`` (512) characters; ours are 32 hex
digits, vLLM's request ids and engine ids (NixlConnector's keys) well under 100."""
MAX_HOST_CHARS = 253
"""Longest ``remote_host`` (a DNS name has at most 253 characters; an IPv6 literal with a zone id fewer)."""
MAX_FANOUT = 256
"""Most decode requests one prefill request may serve (``kvt_fanout``, the client's ``n``; more: refused). One
transfer then holds that many destinations, each with its blocks, on the prefill."""
MAX_PARAM_KEYS = 64
"""Most keys in a request's ``kv_transfer_params``: NixlConnector's shape has 10, Mooncake's 5, ours 14 at most."""
MAX_PARAM_KEY_CHARS = 128
"""Longest key (every key anyone uses is under 40 characters)."""
MAX_PARAM_VALUES = 1 << 18
"""Most values in a request's ``kv_transfer_params``, counted through every list and object, keys we do not
read included. The largest legitimate one is NixlConnector's ``remote_block_ids`` as a prefill answers it, one
id per block: 65,536 for a 1M-token prompt in 16-token blocks; four times that. Bounds the check's own work
(one pass, stopped at the bound)."""
MAX_PARAM_TEXT = 1 << 20
"""Most characters of text (keys and strings, every level) in a request's ``kv_transfer_params``: the ids we read
are bounded by MAX_PARAM_CHARS; 1 MiB leaves room for whatever a router adds."""
MAX_PARAM_DEPTH = 32
"""Deepest nesting of lists and objects (no known key nests more than 2 levels; ``str()`` of a value nested
thousands deep raises RecursionError)."""
_HOST_CHARS = re.compile(r"[A-Za-z0-9._:%\[\]-]+")
"""What a host name, an IPv4 address or a bracketed/zoned IPv6 literal is made of."""
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
    INVALID_PARAMS = "invalid_params"
    """The request's ``kv_transfer_params`` were refused (:func:`parse_transfer_params`): it is admitted only to
    take vLLM's failure path, no KV comes."""


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
    blocks: Sequence[int]  # a tuple, or an array('I') as it came off a packed frame (protocol.PACKED)
    offset: int = 0
    groups: tuple[Sequence[int], ...] = ()


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


class TransferParamsError(ValueError):
    """A request's ``kv_transfer_params`` refused; the message names the field and why, never its value."""

    def __init__(self, why: str) -> None:
        super().__init__(f"kv_transfer_params refused: {why}")


@dataclass(frozen=True)
class TransferParams:
    """A request's ``kv_transfer_params`` as the connector reads them, checked (:func:`parse_transfer_params`)."""

    role: Literal["prefill", "decode"] | None = None
    """``"prefill"`` (``do_remote_decode``: its KV goes to a remote decode), ``"decode"`` (``do_remote_prefill``:
    its KV comes from a remote prefill), or None (not a P/D request: the connector leaves it alone)."""
    xfer: str | None = None
    """The push flow's transfer id: ``kvt_xfer`` (``kvtransport-proxy``) or Mooncake's ``transfer_id``; None:
    the pull flow (NixlConnector's keys)."""
    remote_request_id: str | None = None
    """The pull flow's transfer: the prefill request it pulls (NixlConnector's ``remote_request_id``)."""
    side_channel: tuple[str, int] | None = None
    """(decode) The prefill's side channel: ``remote_host``/``remote_port``, or Mooncake's ``remote_engine_id``
    as our bootstrap endpoint publishes it (``<engine id>@<host>:<port>``). None: no remote prefill to ask."""
    fanout: int = 1
    """(prefill) Decode requests the transfer serves (``kvt_fanout``), 1..MAX_FANOUT."""
    first_token: bool = False
    """``kvt_first_token``: the first-token flow (push only)."""
    discover: bool = False
    """``kvt_discover``: a proxy's discovery request (prefill; no KV moves)."""
    debug_delay: bool = False
    """``kvt_debug_delay`` (test-only, with the ``debug_push_delay`` setting)."""
    debug_late: bool = False
    """``kvt_debug_late`` (test-only, with ``debug_dst_delay``)."""
    debug_hold: bool = False
    """``kvt_debug_hold`` (test-only, with ``debug_hold``)."""

    @property
    def transfer(self) -> str | None:
        """The transfer a decode request's KV comes with: the push flow's id, or the pulled prefill request."""
        return self.xfer or self.remote_request_id


NO_PARAMS = TransferParams()
"""What a request without ``kv_transfer_params`` (or with none the connector reads) is."""


def parse_transfer_params(params: object) -> TransferParams:
    """The one place a request's ``kv_transfer_params`` (any API client sets them) are read: the checked,
    typed fields the connector uses, or TransferParamsError naming the first bad field. Never raises anything
    else, whatever ``params`` holds; its work is bounded (MAX_PARAM_VALUES).

    Rules: the whole is a JSON object within MAX_PARAM_KEYS keys, MAX_PARAM_VALUES values, MAX_PARAM_TEXT
    characters and MAX_PARAM_DEPTH levels; keys the connector does not read are otherwise ignored. A key set to
    null is absent (the toy proxy sends NixlConnector's keys as nulls), so is an empty id or host. Flags
    (``do_remote_decode``, ``do_remote_prefill``, ``kvt_first_token``, ``kvt_discover``, ``kvt_debug_*``)
    are booleans, not numbers; not both roles. Ids (``kvt_xfer``, ``transfer_id``, ``remote_request_id``,
    ``remote_engine_id``): printable strings of at most MAX_PARAM_CHARS characters, or integers in
    0..2**63-1 (Mooncake's ``transfer_id``). ``remote_host``: a host name or address (MAX_HOST_CHARS);
    ``remote_port``: an integer (or a string of digits) in 1..65535; on a decode request they come together,
    or else a ``remote_engine_id`` with an ``@`` names them (``<engine id>@<host>:<port>``). ``kvt_fanout``:
    an integer in 1..MAX_FANOUT."""
    if params is None:
        return NO_PARAMS
    if not isinstance(params, dict):
        raise TransferParamsError(f"kv_transfer_params must be a JSON object, got {_kind(params)}")
    if not params:
        return NO_PARAMS
    _check_size(params)
    to_decode, to_prefill = _flag(params, "do_remote_decode"), _flag(params, "do_remote_prefill")
    if to_decode and to_prefill:
        raise TransferParamsError("do_remote_decode and do_remote_prefill are both true (one request plays one role)")
    role: Literal["prefill", "decode"] | None = "prefill" if to_decode else "decode" if to_prefill else None
    flags = {name: _flag(params, f"kvt_{name}")
             for name in ("first_token", "discover", "debug_delay", "debug_late", "debug_hold")}
    ours, mooncakes = _ident(params, "kvt_xfer"), _ident(params, "transfer_id")
    remote_request_id = _ident(params, "remote_request_id")
    engine = _ident(params, "remote_engine_id")
    side = _side_channel(params, engine)  # checked on every request; a decode's only is used
    if role != "decode":
        side = None
    elif side is not None and not (ours or mooncakes or remote_request_id):
        raise TransferParamsError("a decode request that names a prefill needs the transfer it takes part in "
                                  "(kvt_xfer, transfer_id or remote_request_id)")
    fanout = params.get("kvt_fanout")
    if fanout is None:
        fanout = 1
    elif isinstance(fanout, bool) or not isinstance(fanout, int) or not 1 <= fanout <= MAX_FANOUT:
        raise TransferParamsError(f"kvt_fanout must be an integer in 1..{MAX_FANOUT}, got {_kind(fanout)}")
    return TransferParams(role=role, xfer=ours or mooncakes, remote_request_id=remote_request_id, side_channel=side,
                          fanout=fanout, **flags)


def _kind(value: object) -> str:
    """What ``value`` is, in a few words, never its contents (bounded, and safe for any value: ``str()`` of a
    huge integer or of a deeply nested list raises)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return f"the integer {value}" if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, float):
        return f"the number {value!r}" if math.isfinite(value) else f"the number {value!r} (not finite)"
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)} items"
    if isinstance(value, dict):
        return f"an object of {len(value)} keys"
    return f"a {type(value).__name__[:40]}"


def _check_size(params: dict[Any, Any]) -> None:
    """Bound the whole of ``params`` (see MAX_PARAM_KEYS and the limits after it), in one pass that stops at
    the first bound exceeded (a cycle, possible only from Python callers, ends at MAX_PARAM_VALUES)."""
    if len(params) > MAX_PARAM_KEYS:
        raise TransferParamsError(f"{len(params)} keys, at most {MAX_PARAM_KEYS}")
    values, text = 0, 0
    stack: list[tuple[Any, int]] = [(params, 0)]
    while stack:
        value, depth = stack.pop()
        if depth >= MAX_PARAM_DEPTH:
            raise TransferParamsError(f"kv_transfer_params nested deeper than {MAX_PARAM_DEPTH} levels")
        items: Any
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, str):
                    raise TransferParamsError(f"keys must be strings, got {_kind(key)}")
                if len(key) > MAX_PARAM_KEY_CHARS:
                    raise TransferParamsError(f"a key of {len(key)} characters, at most {MAX_PARAM_KEY_CHARS}")
                text += len(key)
            items = value.values()
        else:
            items = value
        values += len(value)
        if values > MAX_PARAM_VALUES:
            raise TransferParamsError(f"kv_transfer_params hold more than {MAX_PARAM_VALUES} values")
        for item in items:
            if isinstance(item, str):
                text += len(item)
            elif isinstance(item, list | tuple | dict):
                stack.append((item, depth + 1))
        if text > MAX_PARAM_TEXT:
            raise TransferParamsError(f"kv_transfer_params hold more than {MAX_PARAM_TEXT} characters of text")


def _given(value: object) -> bool:
    """Whether a key is set: null and an empty string mean absent."""
    return value is not None and not (isinstance(value, str) and not value)


def _flag(params: dict[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TransferParamsError(f"{key} must be true or false, got {_kind(value)}")
    return value


def _ident(params: dict[str, Any], key: str) -> str | None:
    value = params.get(key)
    if not _given(value):
        return None
    if isinstance(value, str) and len(value) <= MAX_PARAM_CHARS and value.isprintable():
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63:
        return str(value)
    raise TransferParamsError(f"{key} must be a printable string of at most {MAX_PARAM_CHARS} characters or an "
                              f"integer in 0..2**63-1, got {_kind(value)}")


def _host(value: object, what: str) -> str:
    if isinstance(value, str) and 0 < len(value) <= MAX_HOST_CHARS and _HOST_CHARS.fullmatch(value):
        return value
    raise TransferParamsError(f"{what} must be a host name or address of 1..{MAX_HOST_CHARS} characters "
                              f"(letters, digits, '.-_:%[]'), got {_kind(value)}")


def _port(value: object, what: str) -> int:
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and 0 < len(value) <= 5 and value.isascii() and value.isdigit():
        number = int(value)
    if number is None or not 0 < number < 65536:
        raise TransferParamsError(f"{what} must be a port number in 1..65535, got {_kind(value)}")
    return number


def _side_channel(params: dict[str, Any], engine: str | None) -> tuple[str, int] | None:
    """The prefill side channel ``params`` name: ``remote_host`` and ``remote_port`` together, or else an engine
    id as our bootstrap endpoint publishes it (``<engine id>@<host>:<port>``); None when they name none."""
    host, port = params.get("remote_host"), params.get("remote_port")
    host = _host(host, "remote_host") if _given(host) else None
    port = _port(port, "remote_port") if _given(port) else None
    if host is not None and port is not None:
        return host, port
    if host is not None:
        raise TransferParamsError("remote_host without remote_port (they name the prefill's side channel together)")
    if port is not None:
        raise TransferParamsError("remote_port without remote_host (they name the prefill's side channel together)")
    if engine is None or "@" not in engine:
        return None
    host, sep, port = engine.rpartition("@")[2].rpartition(":")
    if not sep:
        raise TransferParamsError("remote_engine_id names a side channel without a port (<engine id>@<host>:<port>)")
    return _host(host, "remote_engine_id's host"), _port(port, "remote_engine_id's port")


def push_transfer_id(params: dict[str, Any] | None) -> str | None:
    """The push flow's transfer id of a request's ``kv_transfer_params`` (:attr:`TransferParams.xfer`); None
    for the pull flow or malformed params."""
    try:
        return parse_transfer_params(params).xfer
    except TransferParamsError:
        return None


def side_channel_of(params: dict[str, Any]) -> tuple[str, int] | None:
    """The prefill side channel a decode request's ``kv_transfer_params`` name
    (:attr:`TransferParams.side_channel`, read as for a decode request); None when absent or malformed."""
    if not isinstance(params, dict):
        return None
    try:
        return _side_channel(params, _ident(params, "remote_engine_id"))
    except TransferParamsError:
        return None
