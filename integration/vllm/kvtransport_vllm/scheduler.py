"""Scheduler side of the connector (runs in vLLM's engine-core process, one per engine).

Prefill role (``kv_producer``/``kv_both``): runs the side-channel server, learns destination blocks from decode
schedulers, and plans per step which blocks the workers put (layer-wise while the prompt is computed, or
whole right after the forward) and when a finished request's blocks may be freed.

Decode role (``kv_consumer``/``kv_both``): claims prompt tokens for requests carrying ``do_remote_prefill``,
parks them in WAITING_FOR_REMOTE_KVS, sends their freshly allocated block ids to the prefill scheduler, and
tells its workers which sequences to wait for (and for how long).

Leases: blocks a prefill holds for a remote decode (a finished request waiting for its destination or for
being pulled) are freed ``lease`` seconds after the last word from that decode. A decode renews the lease of
every transfer it still wants every lease/3 (``renew`` messages); when a decode's side channel drops, the
transfers it held are given up at once. When a prefill's side channel drops, the decode fails the requests
still waiting for its KV (vLLM then fails or recomputes them per ``kv_load_failure_policy``).

Every method is called on the scheduler thread and never blocks on the network: side-channel traffic goes
through :mod:`.sidechannel`'s threads and an inbox drained in :meth:`build_plan`.
"""

from __future__ import annotations

import logging
import queue
import re
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

from . import trace
from .config import ConnectorSettings
from .metadata import Push, SendFailure, StepPlan
from .protocol import PROTOCOL_VERSION, b64, compat_hash
from .sidechannel import PeerClient, SideChannelServer

log = logging.getLogger("vllm.kvtransport")

FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")
IDLE_INBOX_WAIT_S = 0.003
"""In a step that schedules nothing while a request waits for the side channel (a prefill for its destination,
a decode for its first token), the scheduler waits this long for the next side-channel event instead of
returning at once: the reader thread that delivers it then gets the GIL without waiting out the interpreter's
5 ms switch interval, which a busy-looping engine would otherwise impose on every hand-off. With 1 ms, the
destination's hop into an idle prefill took 1.8 ms (p50, H200 serving run of 2026-12-02): the engine spent
about half of each idle step outside the wait. A new request reaching an engine that is idle in such a wait is
scheduled at most this much later."""
MAX_ORPHANS = 4096
"""Destinations held for prefill requests that have not arrived yet (all decode engines together)."""
MAX_ORPHANS_PER_ENGINE = 1024
"""Of those, what one decode engine may hold (one engine cannot take every place)."""
PREFILL_LOST = "prefill lost: "  # prefix of recv_fail reasons caused by a lost prefill (the worker counts them)
NULL_BLOCK = 0
"""vLLM's null block: a sliding window's blocks that left the window point at it (never moved)."""
_CHILD = re.compile(r"^\d+_")


def sampling_family(req_id: str) -> str | None:
    """The parent id of a parallel-sampling child (vLLM names children ``"{index}_{parent}"``), else None."""
    return _CHILD.sub("", req_id, count=1) if _CHILD.match(req_id) else None


@dataclass
class _Dst:
    engine: str
    seq: str
    blocks: list[int]
    offset: int
    pushed_upto: int = 0  # absolute prompt-block index below which layer-wise pushes are issued (full blocks)
    pushed_tok: int = 0  # unlike peers: prompt tokens below this were pushed
    extra: list[list[int]] = field(default_factory=list)  # KV cache groups 1.. : their blocks, aligned with blocks
    final_sent: bool = False
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.pushed_upto = self.offset


@dataclass
class _Source:
    """A prefill request whose KV goes to one or more decode requests."""

    req_id: str
    xfer: str
    mode: str  # "push" (our proxy, decode allocates first) or "pull" (NIXL-style params, decode asks after)
    fanout: int  # destinations expected (n of the decode request; pull mode: 1 unless the proxy said)
    prompt_len: int
    blocks: list[int] = field(default_factory=list)
    extra: list[list[int]] = field(default_factory=list)  # KV cache groups 1.. (hybrid models), aligned with blocks
    computed: int = 0
    dsts: list[_Dst] = field(default_factory=list)
    msgs: int = 0
    cancels: int = 0
    complete: bool = False
    failed: str | None = None
    finished: bool = False  # request_finished was called
    delay_freed: bool = False  # we told vLLM to keep the blocks: a release must follow
    puts_issued: bool = False
    lease_until: float = 0.0  # a finished source not served by then is freed (renewals push it back)
    registered: float = field(default_factory=time.monotonic)
    holders: set[str] = field(default_factory=set)  # decode engines that asked for (renewed) this transfer
    debug_delay: bool = False
    first_token: bool = False  # Splitwise order: the decode continues from the token this request samples
    first: int | None = None  # that token, once sampled
    first_told: set[str] = field(default_factory=set)  # decode engines it was sent to
    considered: float | None = None  # when the prefill scheduler first wanted to run it (admission wait start)
    ready_sent: set[str] = field(default_factory=set)  # decode engines told "ready" for this transfer
    wait_done: bool = False  # its admission wait was recorded (it ran)

    def destinations_known(self) -> bool:
        """Every expected destination arrived (or was cancelled): layer-wise push can start."""
        return len(self.dsts) + self.cancels >= self.fanout

    def served(self) -> bool:
        """No further destinations are expected."""
        if self.mode == "pull":  # every decode child asks (children allocated in one step share a message)
            asked = len(self.dsts) if self.fanout > 1 else self.msgs
            return asked + self.cancels >= self.fanout and all(d.final_sent or d.cancelled for d in self.dsts)
        done = sum(1 for d in self.dsts if d.final_sent or d.cancelled) + self.cancels
        return done >= self.fanout and all(d.final_sent or d.cancelled for d in self.dsts)


@dataclass
class _Recv:
    req_id: str
    xfer: str
    addr: tuple[str, int]
    started: float


@dataclass
class _FirstWait:
    """A decode request of the first-token flow: it continues from the token its prefill samples, which comes
    over the side channel (``first``) and is appended to its prompt before it is scheduled."""

    request: Any  # vLLM's Request
    xfer: str
    addr: tuple[str, int]
    prompt_len: int  # the prompt as the client sent it (the remote KV covers it)
    applied: bool = False


def transfer_params_kind(params: dict[str, Any] | None) -> str | None:
    """``"prefill"`` for a request whose KV goes to a remote decode, ``"decode"`` for one whose KV comes from a
    remote prefill, else None."""
    if not params:
        return None
    if params.get("do_remote_decode"):
        return "prefill"
    if params.get("do_remote_prefill"):
        return "decode"
    return None


class SchedulerSide:
    """See the module docstring. Constructed by the connector for ``KVConnectorRole.SCHEDULER``."""

    def __init__(self, *, settings: ConnectorSettings, engine_id: str, block_size: int, producer: bool,
                 consumer: bool, compat_info: dict[str, Any], tp_size: int = 1, num_groups: int = 1) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.block_size = block_size
        self.producer = producer
        self.consumer = consumer
        self.tp_size = tp_size
        self.num_groups = num_groups  # KV cache groups (hybrid models: full and sliding-window attention)
        self._base_compat = dict(compat_info)
        self.worker_meta: dict[int, dict[str, Any]] = {}
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.host = settings.address
        trace.set_role("prefill" if producer else "decode")
        self.server: SideChannelServer | None = None
        if producer:
            self.server = SideChannelServer(self.host, settings.side_channel_port, engine_id, self.compat,
                                            self.inbox, settings.connect_timeout, lease=settings.lease,
                                            answer_now=self._answer_now, secret=settings.secret,
                                            senders=self._sender_ids)
            self.port = self.server.port
            log.info("kvtransport connector: side channel of engine %s on %s:%d", engine_id, self.host, self.port)
        else:
            self.port = 0
        # producer state
        self.sources: dict[str, _Source] = {}
        self.src_by_req: dict[str, _Source] = {}
        self.orphans: dict[str, tuple[float, list[_Dst], int]] = {}  # xfer -> (lease end, dsts, cancels)
        self.gone: dict[str, str] = {}  # xfer -> why it can no longer be served (bounded)
        # pull flow with n>1 (vLLM's toy proxy forwards the same n to both sides): the prefill computes n
        # children, only one child's params reach the decode, and each of the decode's n children pulls that
        # one. Per family: live sources, and how many pulls (or cancels) arrived. The family is served once
        # as many arrived as it has children; then every sibling goes (see _family_served).
        self.family_size: dict[str, int] = {}
        self.family_asked: dict[str, int] = {}
        self.peer_workers: dict[str, dict[int, bytes]] = {}
        self.peer_geometry: dict[str, dict[str, Any]] = {}  # decode engine -> tp_size, block_size, kv_order
        self.unmappable: dict[str, str] = {}  # decode engine -> why its KV cache cannot take ours
        self.holds: dict[str, tuple[float, set[str]]] = {}  # xfer -> (expiry, engines): renewed before registered
        self.counters: dict[str, int] = {"lease_expirations": 0, "decode_disconnects": 0, "dst_wait_timeouts": 0,
                                         "first_tokens_sent": 0, "first_tokens_received": 0}
        self.foreign_refused = 0  # dst / cancel naming another decode engine's request (log and tests)
        self.dst_waits: list[float] = []  # seconds prefill requests waited for their destinations (stats)
        self._new_peers: set[str] = set()
        self._releases: list[str] = []
        self._whole: list[Push] = []
        # consumer state
        self.clients: dict[tuple[str, int], PeerClient] = {}
        self.recvs: dict[str, _Recv] = {}
        self.consumed: set[str] = set()
        self._outgoing: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        self._recv_start: dict[str, float] = {}
        self._recv_blocks: dict[str, list[int]] = {}
        self._recv_abort: list[str] = []
        self._recv_fail: dict[str, str] = {}
        self._recv_from: dict[str, dict[int, str]] = {}
        self._recv_hold: set[str] = set()
        self.prefill_senders: dict[tuple[str, int], dict[int, str]] = {}  # prefill addr -> rank -> instance id
        self.wanted: dict[str, tuple[str, tuple[str, int]]] = {}  # decode req -> (xfer, prefill addr) not landed
        self._last_renew = 0.0
        self.arrived: dict[str, float] = {}  # decode push-flow req -> when it arrived (admission bound)
        self.ready_xfers: OrderedDict[str, float] = OrderedDict()  # transfers a prefill said it is about to run
        self.doomed: dict[str, str] = {}  # decode req -> why its KV cannot come (admitted only to fail)
        self.first_waits: dict[str, _FirstWait] = {}  # decode req -> its first-token wait (until it is scheduled)
        self._first_ready: set[str] = set()  # decode reqs whose first token was appended (workers may report them)
        self.block_pool: Any = None  # vLLM's block pool (bind_gpu_block_pool): usage decides eager admission
        self._gauges_sent: dict[str, int] = {}  # gauge values last reported in stats

    # ------------------------------------------------------------------ compatibility
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

    def geometry(self) -> dict[str, Any]:
        """What may differ between peers and is mapped (TP size, block size, head order); not hashed."""
        w0 = self.worker_meta.get(0) or {}
        return {"tp_size": self.tp_size, "block_size": self.block_size, "kv_order": w0.get("kv_order")}

    def _unlike(self, engine: str) -> dict[str, Any] | None:
        """Decode ``engine``'s geometry when it differs from ours (its KV is then mapped by token ranges)."""
        geo = self.peer_geometry.get(engine)
        if geo is None or geo == self.geometry():
            return None
        return geo

    def compat(self) -> tuple[str, dict[str, Any]]:
        """(hash, fields) both sides must agree on. Thread-safe (read-only)."""
        info = self.compat_info()
        return compat_hash(info), info

    def hello(self) -> dict[str, Any]:
        h, info = self.compat()
        return {"type": "hello", "version": PROTOCOL_VERSION, "engine_id": self.engine_id, "compat": h,
                "compat_info": info, "tp_size": self.tp_size, "geometry": self.geometry(),
                "workers": {str(r): b64(m["metadata"]) for r, m in self.worker_meta.items()}}

    def discovery_params(self) -> dict[str, Any]:
        """What a proxy needs to address this prefill engine's side channel."""
        return {"kvt_host": self.host, "kvt_port": self.port, "kvt_engine_id": self.engine_id,
                "kvt_mode": self.settings.mode}

    # ------------------------------------------------------------------ vLLM hooks (both roles)
    def on_new_request(self, request: Any) -> None:
        """Register prefill requests early, so destinations that arrive before they are scheduled attach.
        Decode: take a lease on the transfer at once (the prefill then knows who holds it)."""
        kind = transfer_params_kind(request.kv_transfer_params)
        if self.producer and kind == "prefill":
            self._register_source(request)
        elif self.consumer and kind == "decode":
            params = request.kv_transfer_params
            addr = self._peer_addr(params)
            xfer = params.get("kvt_xfer") or params.get("remote_request_id")
            if addr is not None and xfer:
                self.wanted[request.request_id] = (str(xfer), addr)
                self.arrived[request.request_id] = time.monotonic()
                self._outgoing[addr].append({"type": "renew", "xfers": [str(xfer)]})
                trace.event("d.new", str(xfer), seq=request.request_id)
                if params.get("kvt_first_token") is True and params.get("kvt_xfer"):
                    self.first_waits[request.request_id] = _FirstWait(request, str(xfer), addr,
                                                                     int(request.num_prompt_tokens))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode: claim the rest of the prompt for remote KV ``(n, True)`` once admitted (:meth:`_admit_now`),
        ``(None, False)`` until then. Prefill: ``(None, False)`` while waiting up to ``dst_wait`` for the
        destinations of a push-flow request (layer-wise push needs them before the first layer), else
        ``(0, False)``. Never changes a request; may read the side channel's inbox (idempotent)."""
        params = request.kv_transfer_params
        kind = transfer_params_kind(params)
        if kind == "decode" and self.consumer:
            if request.request_id in self.consumed or not self._peer_addr(params):
                return 0, False
            if self.settings.debug_hold and params.get("kvt_debug_hold") is True:
                return None, False  # test-only (debug_hold): never admitted; the lease is still renewed
            first = self.first_waits.get(request.request_id)
            count = (first.prompt_len if first is not None else request.num_prompt_tokens) - num_computed_tokens
            if count <= 0:
                if first is not None and not first.applied and request.request_id not in self.doomed:
                    return None, False  # found locally, but it continues from the prefill's first token: wait
                return 0, False
            return (count, True) if self._admit_now(request.request_id, params) else (None, False)
        if kind == "prefill" and self.producer and self._waits_for_destinations(request.request_id):
            return None, False
        return 0, False

    def bind_gpu_block_pool(self, block_pool: Any) -> None:
        """vLLM's block pool: its usage decides whether a decode admits push-flow requests at once."""
        self.block_pool = block_pool

    def _kv_usage(self) -> float:
        try:
            return float(self.block_pool.get_usage()) if self.block_pool is not None else 0.0
        except Exception:  # a pool without get_usage: treat as empty
            return 0.0

    def _admit_now(self, rid: str, params: dict[str, Any]) -> bool:
        """Decode: whether to allocate ``rid``'s blocks now. Pull-flow KV exists already: yes. Push flow: yes
        while the cache is below ``admit_below`` used, or once the prefill said it is about to compute the
        request (``ready``); also when the KV cannot come any more (the request is then admitted only to take
        vLLM's failure path: an unallocated request cannot fail otherwise)."""
        xfer = params.get("kvt_xfer")
        if not xfer:
            return True
        xfer = str(xfer)
        if rid in self.doomed or xfer in self.ready_xfers or self._kv_usage() < self.settings.admit_below:
            return True
        now = time.monotonic()
        self._drain_inbox(now)
        if rid in self.doomed or xfer in self.ready_xfers:
            return True
        addr = self._peer_addr(params)
        client = self.clients.get(addr) if addr is not None else None
        if client is not None and client.dead:
            self.doomed[rid] = f"prefill side channel unusable: {client.error}"
        elif now - self.arrived.get(rid, now) > self.settings.transfer_timeout:
            self.doomed[rid] = (f"the prefill did not start transfer {xfer} within {self.settings.transfer_timeout:g}s "
                                "(admit_below: this decode waited for its go-ahead)")
        return rid in self.doomed

    def _waits_for_destinations(self, rid: str) -> bool:
        """Prefill: whether push-flow request ``rid`` should wait (bounded by ``dst_wait``) for its decode's
        destination blocks before it runs. Tells the decodes that hold the transfer to allocate now."""
        src = self.src_by_req.get(rid)
        if (src is None or src.mode != "push" or self.settings.mode != "push" or src.failed is not None
                or src.complete or src.wait_done):
            return False
        now = time.monotonic()
        if src.considered is None:
            src.considered = now
        if not src.destinations_known():
            self._drain_inbox(now)
        if not src.destinations_known() and self.settings.dst_wait > 0:
            self._send_ready(src)
            if now - src.considered < self.settings.dst_wait:
                return True
            self.counters["dst_wait_timeouts"] += 1
            log.warning("kvtransport: prefill request %s (transfer %s) runs without its destination after "
                        "waiting %gs (dst_wait); its KV goes after the forward", rid, src.xfer, self.settings.dst_wait)
        src.wait_done = True
        self.dst_waits.append(now - src.considered)
        return False

    def _send_ready(self, src: _Source) -> None:
        """Tell each decode engine holding ``src``'s transfer (and not told yet) that it may allocate now."""
        if self.server is None:
            return
        for engine in src.holders - src.ready_sent:
            if self.server.send(engine, {"type": "ready", "xfers": [src.xfer]}):
                src.ready_sent.add(engine)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: record the allocated destination blocks and queue them for the prefill side."""
        params = request.kv_transfer_params
        kind = transfer_params_kind(params)
        if kind == "prefill" and self.producer:
            self._register_source(request)
            return
        if kind != "decode" or not self.consumer or request.request_id in self.consumed:
            return
        addr = self._peer_addr(params)
        if addr is None:
            return
        rid = request.request_id
        self.consumed.add(rid)
        self.arrived.pop(rid, None)
        xfer = str(params.get("kvt_xfer") or params.get("remote_request_id"))
        mode = "push" if params.get("kvt_xfer") else "pull"
        doomed = self.doomed.pop(rid, None)
        if num_external_tokens <= 0 or doomed is not None:
            # everything was found locally (or the KV cannot come): tell the prefill side not to wait for us
            self._outgoing[addr].append({"type": "cancel", "xfer": xfer, "seqs": [], "count": 1, "mode": mode})
            if num_external_tokens <= 0:
                return
        ids = blocks.get_block_ids()
        all_ids = list(ids[0])
        if len(ids) > 1:
            # hybrid: every group's list covers the same token blocks (a sliding window's skipped ones are the null
            # block, left out of the unhashed lists); the new blocks are the trailing ones of a full-attention
            # group, the most of any group
            new = max(len(g) for g in blocks.get_unhashed_block_ids_all_groups())
            offset = len(all_ids) - new
            unhashed = all_ids[offset:]
        else:
            unhashed = list(blocks.get_unhashed_block_ids())
            offset = len(all_ids) - len(unhashed)
        extra = [list(g[offset:offset + len(unhashed)]) for g in ids[1:]]
        self.recvs[rid] = _Recv(rid, xfer, addr, time.monotonic())
        self._recv_start[rid] = self.settings.transfer_timeout
        first = self.first_waits.get(rid)
        if first is not None and not first.applied:
            self._recv_hold.add(rid)  # its workers report the KV landed only once the first token is appended
        trace.event("d.alloc", xfer, seq=rid)
        self._recv_blocks[rid] = unhashed
        if addr in self.prefill_senders:
            self._recv_from[rid] = self.prefill_senders[addr]
        if doomed is not None:
            log.warning("kvtransport: KV for %s will not come: %s", rid, doomed)
            self._recv_fail[rid] = doomed
            self.wanted.pop(rid, None)
            return
        dst: dict[str, Any] = {"seq": rid, "blocks": unhashed, "offset": offset}
        if extra:
            dst["groups"] = extra
        self._outgoing[addr].append({"type": "dst", "xfer": xfer, "mode": mode, "dsts": [dst]})

    def request_finished(self, request: Any, block_ids: list[int] | tuple[list[int], ...],
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Prefill: keep the blocks (True) until the workers pushed them; returns NIXL-compatible
        ``kv_transfer_params`` for the decode side. Decode: cancel an outstanding transfer."""
        rid = request.request_id
        params = request.kv_transfer_params
        kind = transfer_params_kind(params)
        if kind == "decode":
            self._decode_finished(request)
            return False, None
        if kind != "prefill" or not self.producer:
            return False, None
        if params.get("kvt_discover"):
            self._drop_source(rid)
            return False, self.discovery_params()
        src = self.src_by_req.get(rid)
        if src is None:
            src = self._register_source(request)
        src.finished = True
        if src.failed is not None:  # given up while computed (its decode went away)
            if src.puts_issued:
                src.delay_freed = True  # released once the puts already issued are flushed
                return True, None
            self._drop_source(rid)
            return False, None
        if not src.dsts and self._family_served(src):
            self._drop_source(rid)  # its siblings took every pull: nobody will ask for this one
            return False, None
        status = getattr(request.status, "name", str(request.status))
        trace.event("p.finished", src.xfer, req=rid)
        groups = _groups(block_ids)
        block_ids = groups[0]
        if status in FINISHED_OK and block_ids:
            if src.first_token and src.first is None and request.num_output_tokens > 0:
                src.first = int(request.output_token_ids[0])
                self._tell_first(src)
            src.complete = True
            src.blocks = list(block_ids)
            src.extra = groups[1:]
            src.computed = max(src.computed, min(request.num_computed_tokens, src.prompt_len))
            src.lease_until = max(src.lease_until, time.monotonic() + self.settings.lease)
            src.delay_freed = True
            out = {
                "do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(block_ids), "remote_engine_id": self.engine_id,
                "remote_request_id": src.xfer, "remote_host": self.host, "remote_port": self.port,
                "tp_size": self.tp_size, "remote_num_tokens": src.prompt_len,
                "kvt_connector": "kvtransport",
            }
            if src.mode == "push":
                out["kvt_xfer"] = src.xfer
            return True, out
        src.failed = f"prefill request {rid} ended with {status}"
        self._fail_dsts(src, src.failed)
        if src.puts_issued:
            src.delay_freed = True
            return True, None
        self._drop_source(rid)
        return False, None

    def update_connector_output(self, failures: list[SendFailure], finished_recving: set[str] | None) -> None:
        """Workers' report of the last step: send failures go to their decode engine; landed receives end."""
        for f in failures:
            self._send_fail(f.engine, [f.seq], f.reason)
        for rid in finished_recving or ():
            self.recvs.pop(rid, None)
            self.wanted.pop(rid, None)
            self.first_waits.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """True while destinations wait for their prefill request, or pushes/releases are queued."""
        return bool(self.orphans or self._whole or self._releases or not self.inbox.empty())

    # ------------------------------------------------------------------ per step
    def build_plan(self, scheduler_output: Any) -> StepPlan:
        """Drain the side channel, plan this step's pushes/releases/receives, send queued messages. In a step
        that schedules nothing while a request waits for the side channel, wait up to IDLE_INBOX_WAIT_S for it."""
        now = time.monotonic()
        idle = not getattr(scheduler_output, "total_num_scheduled_tokens", 1)
        self._drain_inbox(now, wait=IDLE_INBOX_WAIT_S if idle and self._awaits_side_channel() else 0.0)
        plan = StepPlan()
        if self.producer:
            self._plan_scheduled(scheduler_output, plan)
            self._plan_completed(now)
            plan.whole_pushes, self._whole = self._whole, []
            plan.send_release, self._releases = self._releases, []
            for eng in self._new_peers:
                plan.peers[eng] = self.peer_workers[eng]
                if eng in self.peer_geometry:
                    plan.peer_geometry[eng] = dict(self.peer_geometry[eng])
            self._new_peers.clear()
        if self.consumer:
            self._renew(now)
            plan.recv_start, self._recv_start = self._recv_start, {}
            plan.recv_blocks, self._recv_blocks = self._recv_blocks, {}
            plan.recv_abort, self._recv_abort = self._recv_abort, []
            plan.recv_fail, self._recv_fail = self._recv_fail, {}
            plan.recv_from, self._recv_from = self._recv_from, {}
            plan.recv_hold, self._recv_hold = self._recv_hold, set()
            plan.recv_release, self._first_ready = self._first_ready, set()
            self._flush_outgoing()
        return plan

    # ------------------------------------------------------------------ producer internals
    def _register_source(self, request: Any) -> _Source:
        rid = request.request_id
        src = self.src_by_req.get(rid)
        if src is not None:
            return src
        params = request.kv_transfer_params or {}
        push = bool(params.get("kvt_xfer"))
        xfer = str(params["kvt_xfer"]) if push else rid
        fanout = int(params.get("kvt_fanout", 1) or 1)
        src = _Source(rid, xfer, "push" if push else "pull", max(1, fanout), int(request.num_prompt_tokens),
                      debug_delay=bool(params.get("kvt_debug_delay")) and self.settings.debug_push_delay > 0,
                      first_token=push and params.get("kvt_first_token") is True)
        trace.event("p.new", xfer, req=rid)
        self.src_by_req[rid] = src
        fam = self._family(src)
        if fam is not None:
            self.family_size[fam] = self.family_size.get(fam, 0) + 1
        if not params.get("kvt_discover"):
            self.sources[xfer] = src
            hold = self.holds.pop(xfer, None)
            if hold is not None:
                src.holders |= hold[1]
            orphan = self.orphans.pop(xfer, None)
            if orphan is not None:
                _, dsts, cancels = orphan
                src.dsts.extend(dsts)
                src.msgs += 1 if dsts else 0
                src.cancels += cancels
                if dsts:
                    trace.event("p.dst", xfer, req=rid, wait=0.0)
        return src

    @staticmethod
    def _family(src: _Source) -> str | None:
        """The sampling family whose pulls ``src`` shares (pull mode, n unknown: see family_size)."""
        return sampling_family(src.req_id) if src.mode == "pull" and src.fanout == 1 else None

    def _family_served(self, src: _Source) -> bool:
        """Every child of ``src``'s family has asked (or cancelled): no further pull will come."""
        fam = self._family(src)
        return fam is not None and self.family_asked.get(fam, 0) >= self.family_size.get(fam, 1)

    def _family_asks(self, src: _Source, count: int) -> None:
        fam = self._family(src)
        if fam is not None and count:
            self.family_asked[fam] = self.family_asked.get(fam, 0) + count

    def _drop_source(self, rid: str) -> None:
        src = self.src_by_req.pop(rid, None)
        fam = self._family(src) if src is not None else None
        if fam is not None:
            left = self.family_size.get(fam, 1) - 1
            if left > 0:
                self.family_size[fam] = left
            else:  # the family's last source: forget it
                self.family_size.pop(fam, None)
                self.family_asked.pop(fam, None)
        if src is not None and self.sources.get(src.xfer) is src:
            del self.sources[src.xfer]
            self.gone[src.xfer] = src.failed or "source released"
            while len(self.gone) > 4096:
                self.gone.pop(next(iter(self.gone)))

    def _awaits_side_channel(self) -> bool:
        """Whether a request waits for a side-channel event: a prefill request for its destination, a decode
        request for its first token."""
        if any(f.request.request_id in self.recvs and not f.applied for f in self.first_waits.values()):
            return True
        return any(s.considered is not None and not s.wait_done for s in self.src_by_req.values())

    def _drain_inbox(self, now: float, wait: float = 0.0) -> None:
        """Handle every queued side-channel event; with ``wait`` > 0, first wait that long for one (releasing
        the GIL to the threads that deliver them)."""
        while True:
            try:
                ev = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            kind = ev[0]
            if kind == "hello":
                _, engine, hello = ev
                workers = hello["workers"]  # rank -> metadata bytes, validated by the side channel (check_hello)
                self._take_geometry(engine, hello)
                self.peer_workers[engine] = workers
                self._new_peers.add(engine)
            elif kind == "msg":
                self._on_message(ev[1], ev[2], now)
            elif kind == "bye":
                self._engine_gone(str(ev[1]), str(ev[2]))
            elif kind == "fail":
                _, seq, reason = ev
                if seq in self.recvs:
                    self._recv_fail[seq] = str(reason)
                    self.wanted.pop(seq, None)
            elif kind == "lost":
                _, addr, reason = ev
                self.prefill_senders.pop(tuple(addr), None)  # a restarted prefill tells its new workers
                for rid, rec in self.recvs.items():
                    if rec.addr == tuple(addr) and rid not in self._recv_fail:
                        log.warning("kvtransport: %s loses its prefill: %s", rid, reason)
                        self._recv_fail[rid] = PREFILL_LOST + str(reason)
                        self.wanted.pop(rid, None)
                for rid, (_, waddr) in self.wanted.items():  # not allocated yet: admitted only to fail
                    if waddr == tuple(addr) and rid not in self.recvs and rid not in self.consumed:
                        self.doomed[rid] = PREFILL_LOST + str(reason)
            elif kind == "senders":  # that prefill's workers: bind the requests already waiting on it
                _, addr, senders = ev
                self.prefill_senders[tuple(addr)] = senders
                for rid, rec in self.recvs.items():
                    if rec.addr == tuple(addr):
                        self._recv_from[rid] = senders
            elif kind == "first":
                _, addr, xfer, token = ev
                self._first_token_arrived(tuple(addr), str(xfer), int(token))
            elif kind == "ready":
                for xfer in ev[2]:
                    self.ready_xfers[str(xfer)] = now
                while len(self.ready_xfers) > 4096:
                    self.ready_xfers.popitem(last=False)
        # destinations waiting for a prefill request that never came
        for xfer in [x for x, (dl, _, _) in self.orphans.items() if dl <= now]:
            _, dsts, _ = self.orphans.pop(xfer)
            for d in dsts:
                self._send_fail(d.engine, [d.seq], f"no prefill request for transfer {xfer} arrived within "
                                                   f"{self.settings.lease:g}s")
        for xfer in [x for x, (dl, _) in self.holds.items() if dl <= now]:
            del self.holds[xfer]

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
                f"{'this prefill' if mine['kv_order'] is None else 'that decode'} (not dense per layer, e.g. "
                "cross-layer blocks) serves like-for-like peers only")
            log.error("kvtransport: %s", self.unmappable[engine])
        else:
            log.info("kvtransport: decode engine %s differs in %s: its KV is mapped (kvtransport.reshard)", engine,
                     ", ".join(why))

    def _answer_now(self, engine: str, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Side-channel reader thread: a destination for a transfer this prefill already freed is refused at
        once — an idle engine would only see it at its next step (minutes, or the decode's timeout). Reads
        ``gone``/``sources`` only (a freed transfer never comes back); everything else goes to the inbox."""
        if msg.get("type") != "dst":
            return None
        xfer = str(msg.get("xfer"))
        gone, sources = getattr(self, "gone", None), getattr(self, "sources", None)  # None while starting
        why = gone.get(xfer) if gone is not None else None
        if why is None or sources is None or xfer in sources:
            return None
        seqs = [str(d.get("seq")) for d in msg.get("dsts", []) if isinstance(d, dict)]
        if not seqs:
            return None
        log.warning("kvtransport: transfer %s to %s failed: prefill cannot serve transfer %s: %s", seqs,
                    engine, xfer, why)
        return {"type": "fail", "seqs": seqs, "reason": f"prefill cannot serve transfer {xfer}: {why}"}

    def _foreign(self, engine: str, xfer: str, seqs: list[str]) -> set[str]:
        """Of ``seqs``, those another decode engine registered for ``xfer``: ``engine`` may not act on them."""
        src = self.sources.get(xfer)
        known = (src.dsts if src is not None else []) + (self.orphans[xfer][1] if xfer in self.orphans else [])
        theirs = {d.seq for d in known if d.engine != engine} & set(seqs)
        if theirs:
            self.foreign_refused += len(theirs)
            log.warning("kvtransport: decode engine %s named requests %s of transfer %s that another engine "
                        "owns; refused", engine, sorted(theirs)[:8], xfer)
        return theirs

    def _on_message(self, engine: str, msg: dict[str, Any], now: float) -> None:
        """A checked (``protocol.check_message``) message from decode ``engine``. Ownership: a decode request
        (``seq``) belongs to the engine that first sent its destination; another engine's dst or cancel naming
        it is refused, and a count-cancel needs the sender to hold the transfer (when anyone holds it)."""
        mtype = msg.get("type")
        xfer = str(msg.get("xfer"))
        src = self.sources.get(xfer)
        if mtype == "renew":
            self._renewed(engine, [str(x) for x in msg.get("xfers", [])], now)
            return
        if mtype == "dst":
            dsts = [_Dst(engine, d["seq"], d["blocks"], d["offset"], extra=list(d.get("groups", [])))
                    for d in msg.get("dsts", [])]
            if engine in self.unmappable:
                for d in dsts:
                    self._send_fail(engine, [d.seq], self.unmappable[engine])
                return
            for d in [d for d in dsts if len(d.extra) != self.num_groups - 1]:
                self._send_fail(engine, [d.seq], f"KV cache groups differ: decode {len(d.extra) + 1}, prefill "
                                                 f"{self.num_groups} (run both with the same model and HMA setting)")
            dsts = [d for d in dsts if len(d.extra) == self.num_groups - 1]
            if not dsts:
                return
            foreign = self._foreign(engine, xfer, [d.seq for d in dsts])
            for seq in sorted(foreign):
                self._send_fail(engine, [seq], f"request {seq} of transfer {xfer} belongs to another decode engine")
            dsts = [d for d in dsts if d.seq not in foreign]
            if not dsts and foreign:
                return
            self._renewed(engine, [xfer], now)
            if src is None:
                if msg.get("mode") == "push" and xfer not in self.gone and (
                        xfer in self.orphans or (len(self.orphans) < MAX_ORPHANS
                                                 and self._orphans_of(engine) < MAX_ORPHANS_PER_ENGINE)):
                    dl, old, cancels = self.orphans.get(xfer, (now + self.settings.lease, [], 0))
                    self.orphans[xfer] = (dl, old + dsts, cancels)
                elif msg.get("mode") == "push" and xfer not in self.gone:
                    for d in dsts:
                        self._send_fail(engine, [d.seq], "prefill holds too many destinations whose prefill request "
                                                         "has not arrived: refused")
                else:
                    why = self.gone.get(xfer, "unknown transfer (expired, or sent to the wrong prefill instance)")
                    for d in dsts:
                        self._send_fail(engine, [d.seq], f"prefill cannot serve transfer {xfer}: {why}")
                return
            if src.failed is not None:
                for d in dsts:
                    self._send_fail(engine, [d.seq], src.failed)
                return
            known = src.destinations_known()
            src.dsts.extend(dsts)
            src.msgs += 1
            self._family_asks(src, len(dsts))
            if not known and src.destinations_known():
                trace.event("p.dst", src.xfer, req=src.req_id,
                            wait=round(now - src.considered, 6) if src.considered is not None else None)
            if src.first is not None:
                self._tell_first(src)
        elif mtype == "cancel":
            seqs = {str(s) for s in msg.get("seqs", [])}
            seqs -= self._foreign(engine, xfer, sorted(seqs))
            count = int(msg.get("count", 0))
            holders = src.holders if src is not None else self.holds.get(xfer, (0.0, set()))[1]
            if count and holders and engine not in holders:
                self.foreign_refused += 1
                log.warning("kvtransport: decode engine %s cancelled transfer %s that only %s hold; refused",
                            engine, xfer, sorted(holders)[:4])
                count = 0
            if src is None:
                if xfer in self.orphans:
                    dl, old, cancels = self.orphans[xfer]
                    self.orphans[xfer] = (dl, [d for d in old if d.seq not in seqs], cancels + count)
                elif msg.get("mode") == "push" and count and xfer not in self.gone:
                    self.orphans[xfer] = (now + self.settings.lease, [], count)
                return
            for d in src.dsts:
                if d.seq in seqs:
                    d.cancelled = True
            src.cancels += count
            self._family_asks(src, count)
        else:
            log.warning("kvtransport side channel: ignoring message type %r from %s", mtype, engine)

    def _orphans_of(self, engine: str) -> int:
        """Transfers waiting for their prefill request that hold a destination of decode ``engine``."""
        return sum(1 for _, dsts, _ in self.orphans.values() if any(d.engine == engine for d in dsts))

    def _tell_first(self, src: _Source) -> None:
        """Send ``src``'s first token to every decode engine that holds or receives its transfer (not told yet)."""
        if self.server is None or src.first is None:
            return
        for engine in (src.holders | {d.engine for d in src.dsts if not d.cancelled}) - src.first_told:
            if self.server.send(engine, {"type": "first", "xfer": src.xfer, "token": src.first}):
                src.first_told.add(engine)
                self.counters["first_tokens_sent"] += 1
                trace.event("p.first_sent", src.xfer, engine=engine)

    def _first_token_arrived(self, addr: tuple[str, int], xfer: str, token: int) -> None:
        """Decode: the prefill at ``addr`` sampled ``token`` as the first token of ``xfer``: append it to the
        prompt of each request of ours that continues from it (still waiting: not scheduled yet), so the decode
        computes that token's KV and samples the second token. Its workers may then report the KV landed."""
        for rid, first in list(self.first_waits.items()):
            if first.xfer != xfer or first.addr != addr or first.applied:
                continue
            req = first.request
            status = getattr(req.status, "name", str(req.status))
            if status not in ("WAITING", "WAITING_FOR_REMOTE_KVS") or req.num_output_tokens or \
                    req.num_prompt_tokens != first.prompt_len or req.prompt_token_ids is None:
                log.warning("kvtransport: first token of %s came when it was %s; not applied", rid, status)
                continue
            append_prompt_token(req, token)
            first.applied = True
            self.counters["first_tokens_received"] += 1
            self._first_ready.add(rid)
            trace.event("d.first", xfer, seq=rid)

    def _plan_scheduled(self, so: Any, plan: StepPlan) -> None:
        layerwise = self.settings.mode == "push"
        for nd in so.scheduled_new_reqs:
            src = self.src_by_req.get(nd.req_id)
            if src is not None:
                src.blocks = list(nd.block_ids[0]) if nd.block_ids else []
                src.extra = [list(g) for g in nd.block_ids[1:]] if nd.block_ids else []
                self._advance(src, nd.num_computed_tokens, so.num_scheduled_tokens.get(nd.req_id, 0), layerwise, plan)
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, rid in enumerate(cached.req_ids):
            src = self.src_by_req.get(rid)
            if src is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                src.blocks = list(new_ids[0]) if new_ids else []
                src.extra = [list(g) for g in new_ids[1:]] if new_ids else []
                for d in src.dsts:  # preempted: recomputed from scratch, so re-push everything
                    if not d.final_sent:
                        d.pushed_upto = d.offset
            elif new_ids:
                src.blocks.extend(new_ids[0])
                for g, more in enumerate(new_ids[1:]):
                    while len(src.extra) <= g:
                        src.extra.append([])
                    src.extra[g].extend(more)
            self._advance(src, cached.num_computed_tokens[i], so.num_scheduled_tokens.get(rid, 0), layerwise, plan)

    def _advance(self, src: _Source, before: int, scheduled: int, layerwise: bool, plan: StepPlan) -> None:
        if before >= src.prompt_len or scheduled <= 0 or src.failed is not None:
            return
        after = min(before + scheduled, src.prompt_len)
        src.computed = after
        if after >= src.prompt_len:
            trace.event("p.scheduled", src.xfer, req=src.req_id)
        if not (layerwise and src.mode == "push"):
            return
        bs = self.block_size
        final = after >= src.prompt_len
        upto = -(-after // bs)  # blocks holding computed tokens (last one maybe partial)
        for d in src.dsts:
            if d.final_sent or d.cancelled:
                continue
            geo = self._unlike(d.engine)
            if geo is not None:
                self._push_tokens(src, d, geo, d.pushed_tok, after, final, plan.layer_pushes)
                continue
            end = min(upto, d.offset + len(d.blocks), len(src.blocks))
            lo = d.pushed_upto
            if end > lo:
                self._group_pushes(src, d, lo, end, final, plan.layer_pushes)
                s_ids, d_ids = self._pairs(src.blocks[lo:end], d.blocks[lo - d.offset:end - d.offset])
                plan.layer_pushes.append(Push(src.req_id, d.seq, d.engine, s_ids, d_ids, final,
                                              self._delay(src) if final else 0.0))
                src.puts_issued = True
            elif final:  # nothing left to put, still signal
                plan.layer_pushes.append(Push(src.req_id, d.seq, d.engine, (), (), True, self._delay(src)))
                src.puts_issued = True
            d.pushed_upto = max(d.pushed_upto, after // bs)
            d.final_sent = final

    def _plan_completed(self, now: float) -> None:
        for src in list(self.src_by_req.values()):
            if src.complete and src.failed is None:
                n_src = -(-src.prompt_len // self.block_size)
                for d in src.dsts:
                    if d.final_sent or d.cancelled:
                        continue
                    geo = self._unlike(d.engine)
                    if geo is not None:
                        self._push_tokens(src, d, geo, 0, src.prompt_len, True, self._whole)
                        src.puts_issued = True
                        continue
                    n = max(0, min(len(d.blocks), n_src - d.offset, len(src.blocks) - d.offset))
                    self._group_pushes(src, d, d.offset, d.offset + n, True, self._whole)
                    s_ids, d_ids = self._pairs(src.blocks[d.offset:d.offset + n], d.blocks[:n])
                    self._whole.append(Push(src.req_id, d.seq, d.engine, s_ids, d_ids, True, self._delay(src)))
                    d.final_sent = True
                    src.puts_issued = True
            if not src.finished:
                continue
            if self._family(src) is not None:  # a family's pulls may go to any one of its sources
                done = src.failed is not None or (
                    self._family_served(src) and all(d.final_sent or d.cancelled for d in src.dsts))
            else:
                done = src.failed is not None or src.served()
            if not done and now >= src.lease_until:
                log.warning("kvtransport: prefill request %s (transfer %s): lease expired (%d destination(s) still "
                            "missing, no word from a decode for %gs); freeing its blocks", src.req_id, src.xfer,
                            max(0, src.fanout - len(src.dsts) - src.cancels), self.settings.lease)
                self.counters["lease_expirations"] += 1
                done = True
            if done:
                if src.delay_freed:
                    self._releases.append(src.req_id)
                self._drop_source(src.req_id)

    def _push_tokens(self, src: _Source, d: _Dst, geo: dict[str, Any], lo: int, hi: int, final: bool,
                     out: list[Push]) -> None:
        """Queue prompt tokens ``[lo, hi)`` of ``src`` for a destination ``d`` of an unlike decode (``geo``): a
        token range with the blocks that hold it on both sides (the workers map heads and blocks). Tokens the
        decode had already (its first ``d.offset`` blocks) and tokens beyond its blocks are left out."""
        bs, dbs = self.block_size, int(geo["block_size"])
        first = d.offset * dbs
        lo = max(lo, first)
        hi = min(hi, src.prompt_len, first + len(d.blocks) * dbs, len(src.blocks) * bs)
        delay = self._delay(src) if final else 0.0
        if hi > lo:
            s_lo, s_hi = lo // bs, -(-hi // bs)
            d_lo, d_hi = (lo - first) // dbs, -(-(hi - first) // dbs)
            for g, (sg, dg) in enumerate(zip(src.extra, d.extra, strict=False), start=1):
                out.append(Push(src.req_id, d.seq, d.engine, tuple(sg[s_lo:s_hi]), tuple(dg[d_lo:d_hi]), final,
                                start=lo, stop=hi, src_first=s_lo * bs, dst_first=first + d_lo * dbs, group=g))
            out.append(Push(src.req_id, d.seq, d.engine, tuple(src.blocks[s_lo:s_hi]), tuple(d.blocks[d_lo:d_hi]),
                            final, delay, start=lo, stop=hi, src_first=s_lo * bs, dst_first=first + d_lo * dbs))
            src.puts_issued = True
        elif final:  # nothing left to put, still signal
            out.append(Push(src.req_id, d.seq, d.engine, (), (), True, delay, start=lo, stop=lo))
            src.puts_issued = True
        d.pushed_tok = max(d.pushed_tok, hi)
        d.final_sent = final

    def _pairs(self, src: list[int], dst: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Group 0's block pairs; with several groups (group 0 may be a sliding window's) null blocks are left out."""
        if self.num_groups == 1:
            return tuple(src), tuple(dst)
        pairs = [(a, b) for a, b in zip(src, dst, strict=False) if a != NULL_BLOCK and b != NULL_BLOCK]
        return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)

    @staticmethod
    def _group_pushes(src: _Source, d: _Dst, lo: int, end: int, final: bool, out: list[Push]) -> None:
        """Like-for-like pushes of prompt blocks ``[lo, end)`` for KV cache groups 1.. (before group 0's, which
        signals): block pairs where neither side holds vLLM's null block (a sliding window's skipped blocks)."""
        for g, (sg, dg) in enumerate(zip(src.extra, d.extra, strict=False), start=1):
            pairs = [(a, b) for a, b in zip(sg[lo:end], dg[lo - d.offset:end - d.offset], strict=False)
                     if a != NULL_BLOCK and b != NULL_BLOCK]
            if pairs:
                out.append(Push(src.req_id, d.seq, d.engine, tuple(a for a, _ in pairs), tuple(b for _, b in pairs),
                                final, group=g))

    def _delay(self, src: _Source) -> float:
        """Test-only pause before ``src``'s final signal (``debug_push_delay`` and ``kvt_debug_delay``)."""
        return self.settings.debug_push_delay if src.debug_delay else 0.0

    def _renewed(self, engine: str, xfers: list[str], now: float) -> None:
        """``engine`` still wants these transfers: extend their leases and remember it as their holder."""
        until = now + self.settings.lease
        for xfer in xfers:
            src = self.sources.get(xfer)
            if src is not None:
                src.holders.add(engine)
                src.lease_until = max(src.lease_until, until)
                if src.considered is not None or src.complete:  # it runs (or ran): this decode may allocate
                    self._send_ready(src)
                if src.first is not None:
                    self._tell_first(src)
            elif xfer not in self.gone:
                _, engines = self.holds.get(xfer, (until, set()))
                self.holds[xfer] = (until, engines | {engine})
        while len(self.holds) > 4096:
            self.holds.pop(next(iter(self.holds)))

    def _engine_gone(self, engine: str, reason: str) -> None:
        """A decode engine's side channel ended: give up what only it was waiting for (no lease wait)."""
        for xfer, (dl, dsts, cancels) in list(self.orphans.items()):
            keep = [d for d in dsts if d.engine != engine]
            self.orphans[xfer] = (dl, keep, cancels + len(dsts) - len(keep))
        for xfer, (_, engines) in list(self.holds.items()):
            engines.discard(engine)
            if not engines:
                del self.holds[xfer]
        for src in list(self.src_by_req.values()):
            mine = [d for d in src.dsts if d.engine == engine]
            if engine not in src.holders and not mine:
                continue
            src.holders.discard(engine)
            for d in mine:
                d.cancelled = True
            if src.failed is None and not src.holders and not any(not d.cancelled for d in src.dsts):
                src.failed = f"decode engine {engine} disconnected ({reason})"
                self.counters["decode_disconnects"] += 1
                log.warning("kvtransport: prefill request %s (transfer %s): %s; freeing its blocks",
                            src.req_id, src.xfer, src.failed)

    def stats_delta(self) -> dict[str, Any]:
        """Scheduler-side counters since the last call (lease expirations, decodes lost with held blocks,
        admission waits that ran out), the admission waits of prefill requests (seconds), and the decode's
        gauges (requests waiting for admission / for their KV) when they changed."""
        out: dict[str, Any] = {k: v for k, v in self.counters.items() if v}
        self.counters = dict.fromkeys(self.counters, 0)
        if self.consumer:
            gauges = {"recv_unallocated": len(self.arrived), "recv_in_progress": len(self.recvs)}
            changed = {k: v for k, v in gauges.items() if self._gauges_sent.get(k) != v}
            out.update(changed)
            self._gauges_sent.update(changed)
        if self.dst_waits:
            out["dst_waits"], self.dst_waits = [round(t, 6) for t in self.dst_waits], []
        return out

    def _fail_dsts(self, src: _Source, reason: str) -> None:
        for d in src.dsts:
            if not d.final_sent and not d.cancelled:
                self._send_fail(d.engine, [d.seq], reason)
                d.cancelled = True

    def _send_fail(self, engine: str, seqs: list[str], reason: str) -> None:
        log.warning("kvtransport: transfer to %s %s failed: %s", engine, seqs, reason)
        if self.server is None or not self.server.send(engine, {"type": "fail", "seqs": seqs, "reason": reason}):
            log.warning("kvtransport: cannot tell decode engine %s (not connected)", engine)

    # ------------------------------------------------------------------ consumer internals
    @staticmethod
    def _peer_addr(params: dict[str, Any]) -> tuple[str, int] | None:
        host, port = params.get("remote_host"), params.get("remote_port")
        if not host or not port:
            return None
        return str(host), int(port)

    def _decode_finished(self, request: Any) -> None:
        rid = request.request_id
        self.first_waits.pop(rid, None)
        self.wanted.pop(rid, None)
        self.arrived.pop(rid, None)
        self.doomed.pop(rid, None)
        rec = self.recvs.pop(rid, None)
        if rec is not None:  # aborted while waiting for its KV
            self._recv_abort.append(rid)
            self._recv_start.pop(rid, None)
            self._outgoing[rec.addr].append({"type": "cancel", "xfer": rec.xfer, "seqs": [rid], "count": 0})
        elif rid not in self.consumed and self.consumer:
            params = request.kv_transfer_params or {}
            addr = self._peer_addr(params)
            xfer = params.get("kvt_xfer") or params.get("remote_request_id")
            if addr is not None and xfer:  # never allocated: the prefill should not wait (push) or hold (pull)
                self._outgoing[addr].append({"type": "cancel", "xfer": str(xfer), "seqs": [], "count": 1,
                                             "mode": "push" if params.get("kvt_xfer") else "pull"})
        self.consumed.discard(rid)

    def _renew(self, now: float) -> None:
        """Every lease/3 (the prefill's lease, from its welcome), renew the transfers still wanted."""
        by_addr: dict[tuple[str, int], set[str]] = defaultdict(set)
        for xfer, addr in self.wanted.values():
            by_addr[addr].add(xfer)
        if not by_addr:
            return
        lease = min([self.settings.lease] + [c.peer_lease for a in by_addr if (c := self.clients.get(a)) is not None
                                             and c.peer_lease])
        if now - self._last_renew < lease / 3:
            return
        self._last_renew = now
        for addr, xfers in by_addr.items():
            self._outgoing[addr].append({"type": "renew", "xfers": sorted(xfers)})

    def _client(self, addr: tuple[str, int]) -> PeerClient:
        c = self.clients.get(addr)
        if c is None or c.dead:
            c = PeerClient(addr[0], addr[1], self.hello, self.compat, self.inbox, self.settings.connect_timeout,
                           secret=self.settings.secret)
            self.clients[addr] = c
        return c

    def _flush_outgoing(self) -> None:
        for addr, msgs in self._outgoing.items():
            client = self._client(addr)
            merged: dict[str, dict[str, Any]] = {}
            for m in msgs:  # one dst message per transfer per step (n>1 children arrive together)
                if m["type"] == "dst" and m["xfer"] in merged:
                    merged[m["xfer"]]["dsts"].extend(m["dsts"])
                elif m["type"] == "dst":
                    merged[m["xfer"]] = m
                else:
                    client.send(m)
            for m in merged.values():
                client.send(m)
        self._outgoing.clear()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.close()
        for c in self.clients.values():
            c.close()


def _groups(block_ids: Any) -> list[list[int]]:
    """A finished request's blocks per KV cache group: vLLM hands one list (one group) or, to an HMA
    connector, one list per group."""
    if block_ids and isinstance(block_ids[0], list | tuple):
        return [list(g) for g in block_ids]
    return [list(block_ids or [])]


def append_prompt_token(request: Any, token: int) -> None:
    """Make ``token`` the last prompt token of vLLM ``request`` (not scheduled yet: no output, no computed KV
    beyond the prompt). The engine then computes its KV and samples the next token; the client's API server
    never sees it as an output (the proxy answered it from the prefill). Reads and writes only what
    ``vllm.v1.request.Request`` has in every supported vLLM: ``prompt_token_ids``, ``_all_token_ids``,
    ``num_prompt_tokens`` and the block hashes."""
    request.prompt_token_ids = [*request.prompt_token_ids, int(token)]
    if getattr(request, "prompt_is_token_ids", None) is not None:  # vLLM 0.32+: mixed token/embedding prompts
        request.prompt_is_token_ids = [*request.prompt_is_token_ids, True]
    request._all_token_ids.append(int(token))
    request.num_prompt_tokens += 1
    request.update_block_hashes()
