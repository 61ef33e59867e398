"""The proxy's Prometheus metrics: per-request timing, outcome counters, histograms, the ``/metrics`` text.

:class:`RequestTimer` is one API request's transfer id (which keys its :mod:`.trace` milestones) and the proxy's
own time on it; :class:`ProxyMetrics` holds the counters and histograms, counts each request's outcome
(:meth:`ProxyMetrics.account`) and renders them with the instances' state (:meth:`ProxyMetrics.render`,
Prometheus text format 0.0.4).

Contract: used by :class:`.proxy.Proxy` on its event loop only (no locks): a RequestTimer and ``in_flight`` per
API request, :meth:`ProxyMetrics.account` once when its handler ends, :meth:`ProxyMetrics.render` per GET
/metrics. Synchronous and non-blocking: counting is a few attribute updates and a bisect (the request's fast
path); rendering is linear in the instances. Raises nothing. Imports nothing of the proxy: instances are read
through :class:`InstanceState`.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import time
from collections.abc import Iterable
from typing import Protocol

from . import http11, trace

__all__ = ["OUTCOMES", "Histogram", "InstanceState", "ProxyMetrics", "RequestTimer"]


class Histogram:
    """A Prometheus histogram."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.total, self.count = bounds, [0] * (len(bounds) + 1), 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, what: str) -> list[str]:
        sums = itertools.accumulate(self.counts)
        return [f"# HELP {name} {what}", f"# TYPE {name} histogram",
                *(f'{name}_bucket{{le="{le}"}} {n}' for le, n in zip((*map("{:g}".format, self.bounds), "+Inf"), sums,
                                                                      strict=True)),
                f"{name}_sum {self.total:.9g}", f"{name}_count {self.count}"]


OUTCOMES = ("ok", "client_error", "upstream_error", "timeout", "unavailable", "disconnected", "internal_error")
"""``kvtransport_proxy_requests_total``'s outcomes: 2xx/3xx; 4xx (the proxy's or an instance's); another 5xx, or
an answer cut short or ending with an error event; 504; 503 (no instance in rotation); the client left before
its answer ended; the proxy failed (a bug: 500)."""
_FAILED = {504: "timeout", 503: "unavailable"}


class RequestTimer:
    """One API request: its transfer id and the proxy's own time on it. The proxy's time runs from the request's
    arrival until it waits for an instance (:meth:`wait`), again from an instance's answer (:meth:`resume`), and
    stops at the first bytes to the client (:meth:`out`); milestones are traced (:mod:`.trace`)."""

    __slots__ = ("failed", "first_out", "own", "since", "t0", "xfer")

    def __init__(self) -> None:
        self.xfer, self.t0 = os.urandom(16).hex(), time.perf_counter()
        self.since: float | None = self.t0
        self.own = self.first_out = 0.0
        self.failed = False  # an error event inside a streamed 200 (or the handler raised)

    def wait(self, ev: str | None = None) -> None:
        if self.since is not None:
            self.own += time.perf_counter() - self.since
            self.since = None
        if ev:
            trace.event(ev, self.xfer)

    def resume(self, ev: str | None = None) -> None:
        if not self.first_out:
            self.since = time.perf_counter()
        if ev:
            trace.event(ev, self.xfer)

    def out(self) -> None:
        if not self.first_out:
            self.wait("proxy.first_out")
            self.first_out = time.perf_counter()


class InstanceState(Protocol):
    """What ``/metrics`` reads of an instance (:class:`.proxy.Instance`)."""

    @property
    def url(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def taken_out(self) -> int: ...  # times marked down

    @property
    def dp_rank(self) -> int | None: ...  # the data-parallel engine behind ``url`` (None: not pinned to one)

    def up(self, now: float) -> bool: ...  # in rotation at ``now`` (monotonic)


def _family(name: str, kind: str, what: str, rows: list[tuple[str, float]]) -> list[str]:
    return [f"# HELP {name} {what}", f"# TYPE {name} {kind}",
            *(f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in rows)]


class ProxyMetrics:
    """The proxy's counters and histograms (one per :class:`.proxy.Proxy`): requests by outcome, requests in
    flight (the proxy counts them), the proxy's own time and the time to first bytes of answered requests."""

    __slots__ = ("first_byte", "in_flight", "outcomes", "overhead")

    def __init__(self) -> None:
        self.outcomes, self.in_flight = dict.fromkeys(OUTCOMES, 0), 0
        self.overhead = Histogram((0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))
        self.first_byte = Histogram((0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))

    def account(self, reply: http11.Reply, rq: RequestTimer) -> None:
        """Count the request's outcome; its timings when it was answered (2xx)."""
        if not reply.finished:  # the client left or the proxy stops (cancelled), or the handler raised
            outcome = "internal_error" if rq.failed else "disconnected"
        elif reply.aborted:  # cut short: by the client, or after an instance failed mid-answer
            outcome = "disconnected" if reply.disconnected else "upstream_error"
        elif reply.status < 400:
            outcome = "upstream_error" if rq.failed else "ok"
        else:
            outcome = "client_error" if reply.status < 500 else _FAILED.get(reply.status, "upstream_error")
        self.outcomes[outcome] += 1
        if outcome == "ok" and rq.first_out:
            self.overhead.observe(rq.own)
            self.first_byte.observe(rq.first_out - rq.t0)

    def render(self, instances: Iterable[InstanceState], refused: dict[int, int]) -> str:
        """``/metrics``: Prometheus text format (version 0.0.4). ``refused``: the requests the HTTP layer refused
        as they arrived, by status (:attr:`.http11.Server.refused`)."""
        now = time.monotonic()
        insts = [(i, f'role="{i.role}",url={json.dumps(i.url)}' + ("" if i.dp_rank is None else f',dp_rank="{i.dp_rank}"'))
                 for i in instances]
        out = [*_family("kvtransport_proxy_requests_total", "counter", "API requests answered, by outcome (see "
                        "proxy.OUTCOMES).", [(f'outcome="{k}"', v) for k, v in self.outcomes.items()]),
               *_family("kvtransport_proxy_refused_total", "counter", "Requests refused as they arrived (413: body "
                        "too large, 431: head too large, 400: malformed HTTP), by status.",
                        [(f'code="{k}"', refused.get(k, 0)) for k in sorted({400, 413, 431, *refused})]),
               *_family("kvtransport_proxy_in_flight", "gauge", "API requests being answered.",
                        [("", self.in_flight)]),
               *self.overhead.render("kvtransport_proxy_overhead_seconds", "The proxy's own time on an answered "
                                     "(2xx) request's first bytes: arrival to its legs written, plus each answer's "
                                     "arrival to the proxy's next send (upstream waits excluded)."),
               *self.first_byte.render("kvtransport_proxy_first_byte_seconds", "Arrival of an answered (2xx) "
                                       "request to the first bytes of its answer (upstream waits included)."),
               *_family("kvtransport_proxy_instance_up", "gauge", "Whether the instance is in rotation.",
                        [(labels, int(i.up(now))) for i, labels in insts]),
               *_family("kvtransport_proxy_instance_failures_total", "counter", "Times the instance was taken out "
                        "of rotation.", [(labels, i.taken_out) for i, labels in insts])]
        return "\n".join(out) + "\n"
