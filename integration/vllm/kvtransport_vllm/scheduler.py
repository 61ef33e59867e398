"""Scheduler side of the connector (runs in vLLM's engine-core process, one per engine).

The connector constructs :class:`SchedulerSide` for ``KVConnectorRole.SCHEDULER``. It is the common part of
the two roles an engine may play, and holds what both share: settings, the compatibility fields and hello, the
side channel's inbox, the geometry of peers, stats and gauges, and vLLM's hooks, each of which calls the roles
present (a ``kv_both`` engine has both):

* prefill (``kv_producer``/``kv_both``, :mod:`.producer`): runs the side-channel server, learns destination
  blocks from decode schedulers, and plans per step which blocks the workers put (layer-wise while the prompt is
  computed, or whole right after the forward, :mod:`.pushplan`) and when a finished request's blocks may be
  freed;
* decode (``kv_consumer``/``kv_both``, :mod:`.consumer`): claims prompt tokens for requests carrying
  ``do_remote_prefill``, parks them in WAITING_FOR_REMOTE_KVS, sends their freshly allocated block ids to the
  prefill scheduler, and tells its workers which sequences to wait for (and for how long).

Leases: blocks a prefill holds for a remote decode (a finished request waiting for its destination or for
being pulled) are freed ``lease`` seconds after the last word from that decode. A decode renews the lease of
every transfer it still wants every lease/3 (``renew`` messages); when a decode's side channel drops, the
transfers it held are given up at once. When a prefill's side channel drops, the decode fails the requests
still waiting for its KV (vLLM then fails or recomputes them per ``kv_load_failure_policy``).

Every method is called on the scheduler thread and never blocks on the network: side-channel traffic goes
through :mod:`.sidechannel`'s threads and an inbox drained in :meth:`SchedulerSide.build_plan`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from . import trace
from .bootstrap import BootstrapServer, DPRegistry, dp_query_answer, query_answer
from .config import ConnectorSettings
from .consumer import Consumer, new_blocks
from .metadata import (
    NO_PARAMS,
    FailureKind,
    SendFailure,
    StepPlan,
    TransferParams,
    TransferParamsError,
    parse_transfer_params,
)
from .producer import Producer
from .protocol import PROTOCOL_VERSION, b64, compat_hash
from .roles import RoleContext
from .sidechannel import SideChannelServer

__all__ = ["IDLE_INBOX_WAIT_S", "SchedulerSide"]

log = logging.getLogger("vllm.kvtransport")

IDLE_INBOX_WAIT_S = 0.003
"""In a step that schedules nothing while a request waits for the side channel (a decode for its first token),
the scheduler waits this long for the next side-channel event instead of
returning at once: the reader thread that delivers it then gets the GIL without waiting out the interpreter's
5 ms switch interval, which a busy-looping engine would otherwise impose on every hand-off. With 1 ms, the
destination's hop into an idle prefill took 1.8 ms (p50, H200 serving run of 2026-12-02): the engine spent
about half of each idle step outside the wait. A new request reaching an engine that is idle in such a wait is
scheduled at most this much later."""
_PREFILL_EVENTS = ("msg", "bye")
"""Inbox events of the side-channel server for the prefill role (``hello`` is the common part's); the others
come from the decode role's clients of prefill engines."""
REFUSALS_LOGGED_PER_MINUTE = 20
"""Requests refused for their ``kv_transfer_params`` logged per minute, one line each; beyond that one line a
minute says how many more were refused (any client can send them, as fast as it likes)."""
MAX_PARSED = 1 << 16
"""Checked ``kv_transfer_params`` kept for live requests (dropped at ``request_finished``; a bound in case vLLM
ever finishes a request without telling the connector)."""


class SchedulerSide:
    """See the module docstring. ``prefill`` / ``decode``: the roles this engine plays (None: not that one)."""

    def __init__(self, *, settings: ConnectorSettings, engine_id: str, block_size: int, producer: bool,
                 consumer: bool, compat_info: dict[str, Any], tp_size: int = 1, num_groups: int = 1,
                 dp_route: tuple[int, int] = (0, 1)) -> None:
        """``dp_route``: (index, count) of this data-parallel engine behind its API server
        (``connector.dp_route``), told to a proxy's discovery request."""
        self.settings = settings
        self.dp_index, self.dp_count = dp_route
        self.engine_id = engine_id
        self.block_size = block_size
        self.tp_size = tp_size
        self._base_compat = dict(compat_info)
        self.worker_meta: dict[int, dict[str, Any]] = {}
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.host = settings.address
        self.port = 0
        self.server: SideChannelServer | None = None
        self.bootstrap: BootstrapServer | None = None
        self.dp_registry: DPRegistry | None = None  # DP engines: where they file for the bootstrap endpoint
        trace.set_role("prefill" if producer else "decode")
        # decode engines that said hello (prefill role)
        self.peer_workers: dict[str, dict[int, bytes]] = {}
        self.peer_geometry: dict[str, dict[str, Any]] = {}  # decode engine -> tp_size, block_size, kv_order
        self.unmappable: dict[str, str] = {}  # decode engine -> why its KV cache cannot take ours
        self._new_peers: set[str] = set()
        self.counters: dict[str, int] = {"lease_expirations": 0, "decode_disconnects": 0,
                                         "first_tokens_sent": 0, "first_tokens_received": 0}
        self._gauges_sent: dict[str, int] = {}  # gauge values last reported in stats
        # kv_transfer_params: checked once per request (request id -> (the dict, what it says)); requests whose
        # params were refused (-> why), those of them whose failing "load" was claimed (-> its blocks, until the
        # next plan fails it), and those already failed once (kv_load_failure_policy=recompute: not claimed again)
        self._parsed: dict[str, tuple[object, TransferParams]] = {}
        self.refused: dict[str, str] = {}
        self._refused_claimed: dict[str, list[int]] = {}
        self._refused_failed: set[str] = set()
        self._refusal_log = [0.0, 0, 0]  # start of the minute, lines logged in it, refusals not logged
        ctx = RoleContext(settings=settings, engine_id=engine_id, tp_size=tp_size, num_groups=num_groups,
                          counters=self.counters, params=self.params)
        self.prefill = Producer(ctx, unmappable=self.unmappable, dp_route=dp_route) if producer else None
        self.decode = Consumer(ctx, inbox=self.inbox, hello=self.hello, compat=self.compat,
                               drain_inbox=self._drain_inbox) if consumer else None
        if self.prefill is not None:  # last: its threads call compat, answer_now and _sender_ids at once
            self.server = SideChannelServer(self.host, settings.side_channel_port, engine_id, self.compat,
                                            self.inbox, settings.connect_timeout, lease=settings.lease,
                                            answer_now=self.prefill.answer_now, secret=settings.secret,
                                            senders=self._sender_ids, worker_at=self._worker_at)
            self.prefill.attach(self.server)
            self.port = self.server.port
            log.info("kvtransport connector: side channel of engine %s on %s:%d", engine_id, self.host, self.port)
            if settings.bootstrap_port:  # Mooncake's endpoint, for the routers that speak its shape
                try:
                    self._start_bootstrap(settings.bootstrap_port)
                except BaseException:
                    self.server.close()
                    raise

    def _start_bootstrap(self, port: int) -> None:
        """Mooncake's ``/query`` endpoint (bootstrap.py). Under data parallelism DP engine 0 serves it for every
        engine of the instance and the others file themselves in the instance's DPRegistry. Raises OSError or
        TimeoutError (the port taken, say)."""
        def own() -> dict[str, Any]:
            return query_answer(self.engine_id, self.host, self.port, self.dp_index)

        answer: Callable[[], dict[str, Any]] = own
        if self.dp_count != 1:
            registry = self.dp_registry = DPRegistry(self.engine_id)
            if self.dp_index:
                registry.register(self.dp_index, self.engine_id, self.host, self.port)
                log.info("kvtransport connector: DP engine %d filed for the bootstrap endpoint of DP engine 0 "
                         "(port %d)", self.dp_index, port)
                return

            def every_engine() -> dict[str, Any]:
                return dp_query_answer(own(), registry)

            answer = every_engine

        self.bootstrap = BootstrapServer(self.host, port, answer)
        log.info("kvtransport connector: Mooncake bootstrap endpoint on http://%s:%d/query", self.host,
                 self.bootstrap.port)

    # ------------------------------------------------------------------ compatibility, hello, geometry
    def set_worker_metadata(self, meta: dict[int, dict[str, Any]]) -> None:
        """Workers' handshake data (rank -> dict with ``metadata`` bytes, ``backend``, ``layout_hash`` ...)."""
        self.worker_meta = dict(meta)

    def compat_info(self) -> dict[str, Any]:
        info = dict(self._base_compat)
        w0 = self.worker_meta.get(0)
        # a unit layout maps onto any other TP size, block size and head order; a block layout (no worker
        # metadata yet, or caches not dense per layer) serves like-for-like peers only
        info["kv_cache"] = ("units (TP size, block size and head order are mapped)" if (w0 or {}).get("kv_order")
                            else f"blocks of tp_size {self.tp_size} and block_size {self.block_size} (like-for-like "
                                 "peers only)")
        if w0 is not None:
            info["backend"] = w0.get("backend")
            info["layout_hash"] = w0.get("layout_hash")
            info["layer_names"] = w0.get("layer_names")
        return info

    def _sender_ids(self) -> dict[str, str]:
        """Our workers' kvtransport instance ids by tp rank (told to decodes, which bind requests to them).
        Thread-safe (read-only)."""
        return {str(r): str(m["instance"]) for r, m in self.worker_meta.items() if isinstance(m.get("instance"), str)}

    def _worker_at(self) -> dict[str, list[Any]]:
        """Our workers' destination channels by tp rank (told to decodes, which send their destinations there
        too). Thread-safe (read-only)."""
        out: dict[str, list[Any]] = {}
        for r, m in self.worker_meta.items():
            at = m.get("dst_at")
            if isinstance(at, list | tuple) and len(at) == 2:
                out[str(r)] = [str(at[0]), int(at[1])]
        return out

    def geometry(self) -> dict[str, Any]:
        """What may differ between peers and is mapped (TP size, block size, head order); not hashed."""
        w0 = self.worker_meta.get(0) or {}
        return {"tp_size": self.tp_size, "block_size": self.block_size, "kv_order": w0.get("kv_order")}

    def compat(self) -> tuple[str, dict[str, Any]]:
        """(hash, fields) both sides must agree on. Thread-safe (read-only)."""
        info = self.compat_info()
        return compat_hash(info), info

    def hello(self) -> dict[str, Any]:
        h, info = self.compat()
        return {"type": "hello", "version": PROTOCOL_VERSION, "engine_id": self.engine_id, "compat": h,
                "compat_info": info, "tp_size": self.tp_size, "geometry": self.geometry(),
                "workers": {str(r): b64(m["metadata"]) for r, m in self.worker_meta.items()}}

    def _take_geometry(self, engine: str, hello: dict[str, Any]) -> None:
        """Record decode ``engine``'s geometry from its hello; an unlike one whose KV we cannot map (a cache
        layout that serves like-for-like peers only, on either side) is remembered as unmappable, with why."""
        raw = hello.get("geometry")
        geo: dict[str, Any] = {"tp_size": int(hello.get("tp_size") or 1), "block_size": self.block_size,
                               "kv_order": None}
        if isinstance(raw, dict):
            bs, order = raw.get("block_size"), raw.get("kv_order")
            geo["block_size"] = bs if isinstance(bs, int) and 0 < bs <= 1 << 20 else -1
            geo["kv_order"] = order if order in ("HN", "NH", "CPU") else None
        self.peer_geometry[engine] = geo
        self.unmappable.pop(engine, None)
        mine = self.geometry()
        if geo == mine:
            return
        why = []
        if geo["tp_size"] != mine["tp_size"]:
            why.append(f"tp_size {geo['tp_size']} (ours {mine['tp_size']})")
        if geo["block_size"] != mine["block_size"]:
            why.append(f"block_size {geo['block_size']} (ours {mine['block_size']})")
        if geo["kv_order"] != mine["kv_order"]:
            why.append(f"KV head order {geo['kv_order']} (ours {mine['kv_order']})")
        if mine["kv_order"] is None or geo["kv_order"] is None or geo["block_size"] < 1:
            self.unmappable[engine] = (
                f"decode engine {engine} differs in {', '.join(why)}, and the KV cache layout of "
                f"{'this prefill' if mine['kv_order'] is None else 'that decode'} (not [blocks, heads, block, head] "
                "dense per layer: MLA's latent cache, cross-layer blocks) serves like-for-like peers only: run both at "
                "one TP size and block size")
            log.error("kvtransport: %s", self.unmappable[engine])
        else:
            log.info("kvtransport: decode engine %s differs in %s: its KV is mapped (kvtransport.reshard)", engine,
                     ", ".join(why))

    # ------------------------------------------------------------------ kv_transfer_params
    def params(self, request: Any) -> TransferParams:
        """``request``'s checked ``kv_transfer_params`` (what the roles read; never raises). Refused ones read
        as none: the hooks below send such a request down the failure path before any role sees it."""
        params = self._read(request)
        return NO_PARAMS if params is None else params

    def _read(self, request: Any) -> TransferParams | None:
        """``request``'s checked ``kv_transfer_params``, or None when they are refused (the first time: recorded
        and logged). They come from any API client: nothing in them may raise here, in vLLM's engine core."""
        rid = request.request_id
        if rid in self.refused:
            return None
        raw = request.kv_transfer_params
        if raw is None:
            return NO_PARAMS
        hit = self._parsed.get(rid)
        if hit is not None and hit[0] is raw:
            return hit[1]
        # vLLM's API server hands the params of a request that failed again, in a request aborted at once
        # (abort_immediately), so that the connector frees what it holds for it: its refusal was logged already
        quiet = getattr(request, "abort_immediately", False) is True
        try:
            params = parse_transfer_params(raw)
        except TransferParamsError as exc:
            self._refuse(rid, str(exc), quiet)
            return None
        except Exception as exc:  # a bug of ours; still only this request's problem
            log.exception("kvtransport: reading the kv_transfer_params of request %s failed", rid)
            self._refuse(rid, f"kv_transfer_params refused: unreadable ({type(exc).__name__})", quiet=True)
            return None
        self._parsed[rid] = (raw, params)
        while len(self._parsed) > MAX_PARSED:
            self._parsed.pop(next(iter(self._parsed)))
        return params

    def _refuse(self, rid: str, why: str, quiet: bool) -> None:
        self.refused[rid] = why
        if quiet:
            return
        now = time.monotonic()
        window = self._refusal_log
        if now - window[0] >= 60.0:
            if window[2]:
                log.warning("kvtransport: %d more request(s) refused for their kv_transfer_params in the last "
                            "minute (not logged one by one)", window[2])
            window[:] = [now, 0, 0]
        if window[1] < REFUSALS_LOGGED_PER_MINUTE:
            window[1] += 1
            log.warning("kvtransport: request %s fails: %s", rid, why)
        else:
            window[2] += 1

    def _claim_refused(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A request whose ``kv_transfer_params`` were refused is admitted only to fail: the rest of its prompt is
        claimed as remote KV, and the next plan has its workers report that load failed (vLLM's failure path: the
        request finishes with an error, or with ``kv_load_failure_policy=recompute`` is computed here as if it
        had no params). Claimed once; when nothing is left to claim (the whole prompt found in the local cache),
        it is computed as if it had no params."""
        count = request.num_prompt_tokens - num_computed_tokens
        if request.request_id in self._refused_failed or count <= 0:
            return 0, False
        return count, True

    def _forget(self, rid: str) -> None:
        self._parsed.pop(rid, None)
        self.refused.pop(rid, None)
        self._refused_claimed.pop(rid, None)
        self._refused_failed.discard(rid)

    # ------------------------------------------------------------------ vLLM hooks (both roles)
    def on_new_request(self, request: Any) -> None:
        """Register prefill requests early, so destinations that arrive before they are scheduled attach (one
        whose transfer id another live request holds is refused: :meth:`.Producer.transfer_taken`). Decode: take a
        lease on the transfer at once (the prefill then knows who holds it). First reads (and checks) the
        request's ``kv_transfer_params``."""
        params = self._read(request)
        if params is None:
            return
        if self.prefill is not None and params.role == "prefill":
            why = self.prefill.transfer_taken(request)
            if why is not None:  # failed, not registered: the live request keeps its transfer
                self._refuse(request.request_id, why, quiet=False)
                return
            self.prefill.register_source(request)
        elif self.decode is not None and params.role == "decode":
            self.decode.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: claim the rest of the prompt for remote KV ``(n, True)`` once admitted (``Consumer._admit_now``),
        ``(None, False)`` until then. Prefill: ``(0, False)``, always at once: a prefill request never waits for
        its destination (its workers bind it whenever it comes, :mod:`.pushplan`). Refused params: see
        :meth:`_claim_refused`. Never changes a request; may read the side channel's inbox (idempotent)."""
        params = self._read(request)
        if params is None:
            return self._claim_refused(request, num_computed_tokens)
        if params.role == "decode" and self.decode is not None:
            return self.decode.get_num_new_matched_tokens(request, num_computed_tokens)
        return 0, False

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        """vLLM's block pool: its usage decides whether a decode admits push-flow requests at once."""
        if self.decode is not None:
            self.decode.block_pool = block_pool

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: record the allocated destination blocks and queue them for the prefill side. Refused params:
        the blocks of the load that the next plan fails."""
        params = self._read(request)
        if params is None:
            rid = request.request_id
            if num_external_tokens > 0 and rid not in self._refused_failed:
                self._refused_failed.add(rid)
                self._refused_claimed[rid] = new_blocks(blocks)[1]
        elif params.role == "prefill" and self.prefill is not None:
            self.prefill.register_source(request)
        elif params.role == "decode" and self.decode is not None:
            self.decode.update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: Any, block_ids: list[int] | tuple[list[int], ...],
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: keep the blocks (True) until the workers pushed them; returns NIXL-compatible
        ``kv_transfer_params`` for the decode side. Decode: cancel an outstanding transfer. Refused params:
        nothing to do but forget them."""
        params = self._read(request)
        try:
            if params is None:
                return False, None
            if params.role == "decode":
                if self.decode is not None:
                    self.decode.request_finished(request)
                return False, None
            if params.role != "prefill" or self.prefill is None:
                return False, None
            return self.prefill.request_finished(request, block_ids)
        finally:
            self._forget(request.request_id)

    def update_connector_output(self, failures: list[SendFailure], finished_recving: set[str] | None) -> None:
        """Workers' report of the last step: send failures go to their decode engine; landed receives end.
        (Only a prefill's workers push: a decode's report no send failures.)"""
        if self.prefill is not None:
            for f in failures:
                self.prefill.send_fail(f.engine, [f.seq], f.reason)
        if self.decode is not None:
            self.decode.landed(finished_recving or set())

    def has_pending_push_work(self) -> bool:
        """True while destinations wait for their prefill request, or releases/cancels are queued."""
        return (self.prefill is not None and self.prefill.has_pending_work()) or not self.inbox.empty()

    # ------------------------------------------------------------------ per step
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """Send the destinations this step allocated, drain the side channel, plan this step's sources, binds,
        releases and receives, send queued messages. In a step that schedules nothing while a request waits for
        the side channel, wait up to IDLE_INBOX_WAIT_S for it (after the destinations went out: a decode waiting
        for one request's first token must not hold back another's blocks; on one H200 that wait put 3.3 ms
        between a decode's allocation and the prefill worker's binding, 2026-12-03)."""
        now = time.monotonic()
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        self._drain_inbox(now)
        if self.decode is not None:  # this step's allocations go out before any idle wait below
            self.decode.flush()
        if idle and self._awaits_side_channel():
            self._drain_inbox(now, wait=IDLE_INBOX_WAIT_S)
        plan = StepPlan()
        if self.prefill is not None:
            self.prefill.plan_step(scheduler_output, plan, now)
            for eng in self._new_peers:
                plan.peers[eng] = self.peer_workers[eng]
                if eng in self.peer_geometry:
                    plan.peer_geometry[eng] = dict(self.peer_geometry[eng])
            self._new_peers.clear()
        if self.decode is not None:
            self.decode.plan_step(plan, now)
            if trace.enabled():
                self.decode.trace_scheduled(scheduler_output)
        for rid, blocks in self._refused_claimed.items():  # their workers report the load failed at once
            plan.recv_start[rid] = self.settings.transfer_timeout
            plan.recv_blocks[rid] = blocks
            plan.recv_fail[rid] = self.refused.get(rid, "kv_transfer_params refused")
            plan.recv_fail_kind[rid] = FailureKind.INVALID_PARAMS
        self._refused_claimed.clear()
        return plan

    def _awaits_side_channel(self) -> bool:
        """Whether a request waits for a side-channel event: a decode request for its first token (a prefill
        request never waits)."""
        return self.decode is not None and self.decode.awaits_first_token()

    def _drain_inbox(self, now: float, wait: float = 0.0) -> None:
        """Handle every queued side-channel event; with ``wait`` > 0, first wait that long for one (releasing
        the GIL to the threads that deliver them)."""
        while True:
            try:
                ev = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            if ev[0] == "hello":
                _, engine, hello = ev
                workers = hello["workers"]  # rank -> metadata bytes, validated by the side channel (check_hello)
                self._take_geometry(engine, hello)
                self.peer_workers[engine] = workers
                self._new_peers.add(engine)
            elif ev[0] in _PREFILL_EVENTS:
                if self.prefill is not None:
                    self.prefill.on_event(ev, now)
            elif self.decode is not None:
                self.decode.on_event(ev, now)
        if self.prefill is not None:
            self.prefill.expire(now)

    def stats_delta(self) -> dict[str, Any]:
        """Scheduler-side counters since the last call (lease expirations, decodes lost with held blocks, first
        tokens) and the decode's gauges (requests waiting for admission / for their KV) when they changed."""
        out: dict[str, Any] = {k: v for k, v in self.counters.items() if v}
        for k in self.counters:  # in place: the roles hold this dict
            self.counters[k] = 0
        if self.decode is not None:
            changed = {k: v for k, v in self.decode.gauges().items() if self._gauges_sent.get(k) != v}
            out.update(changed)
            self._gauges_sent.update(changed)
        return out

    def shutdown(self) -> None:
        if self.dp_registry is not None:
            self.dp_registry.remove()
        if self.bootstrap is not None:
            self.bootstrap.close()
        if self.server is not None:
            self.server.close()
        if self.decode is not None:
            self.decode.close()
