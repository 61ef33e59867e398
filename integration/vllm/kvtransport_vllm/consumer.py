"""Decode role of the scheduler side (``kv_consumer``/``kv_both``): the transfers this engine receives.

It claims prompt tokens for requests carrying ``do_remote_prefill`` (push flow: once admitted, see
:meth:`Consumer._admit_now`), parks them in WAITING_FOR_REMOTE_KVS, sends their freshly allocated block ids to
the prefill scheduler and, straight, to each of its workers (their destination channels, named in the prefill's
welcome: the blocks reach the workers without the prefill's engine loop), renews the leases of the transfers it still wants, applies the prefill's first token
(first-token flow) and tells its workers which sequences to wait for (and for how long). When a prefill's side
channel drops, the requests still waiting for its KV fail (vLLM then fails or recomputes them per
``kv_load_failure_policy``). The common part (:mod:`.scheduler`) calls in here from vLLM's hooks, on the
scheduler thread.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import trace
from .compat import first_token_emitter
from .metadata import Failure, FailureKind, StepPlan, TransferParams
from .roles import RoleContext
from .sidechannel import PeerClient

log = logging.getLogger("vllm.kvtransport")

WORKER_LINK_RETRY_S = 5.0
"""A prefill worker's destination channel that failed is not reopened sooner (its destinations still reach the
worker through the prefill's scheduler)."""
TRACED_REPORTED = 4096
"""Tracing on: landed requests remembered until their first schedule (``d.scheduled``); the oldest go first."""
PREFILL_LOST = "prefill lost: "
"""How the reason of a :attr:`FailureKind.PREFILL_LOST` failure begins (as logged)."""


@dataclass
class Receive:
    req_id: str
    xfer: str
    addr: tuple[str, int]
    started: float


@dataclass
class FirstWait:
    """A decode request of the first-token flow: it continues from the token its prefill samples, which comes
    over the side channel (``first``) and is appended to its prompt before it is scheduled."""

    request: Any  # vLLM's Request
    xfer: str
    addr: tuple[str, int]
    prompt_len: int  # the prompt as the client sent it (the remote KV covers it)
    applied: bool = False


class Consumer:
    """The decode's transfers (see the module docstring). Made by the scheduler side with what it shares
    (``ctx``) and the channel this role talks through: the side channel's ``inbox`` (where the clients of prefill
    engines deliver), ``hello`` and ``compat`` (what a client says and checks on connect), and ``drain_inbox``
    (handle what is queued there now, given the time; the scheduler side routes each event to its role).
    ``block_pool``: vLLM's, once bound (its usage decides eager admission)."""

    def __init__(self, ctx: RoleContext, *, inbox: queue.Queue[tuple[Any, ...]],
                 hello: Callable[[], dict[str, Any]], compat: Callable[[], tuple[str, dict[str, Any]]],
                 drain_inbox: Callable[[float], None]) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.counters = ctx.counters  # shared with the common part (it reports and resets them)
        self.inbox = inbox
        self.hello = hello
        self.compat = compat
        self.drain_inbox = drain_inbox
        self.block_pool: Any = None
        self.clients: dict[tuple[str, int], PeerClient] = {}
        self.recvs: dict[str, Receive] = {}
        self.consumed: set[str] = set()
        self._outgoing: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        self._recv_start: dict[str, float] = {}
        self._recv_blocks: dict[str, list[int]] = {}
        self._recv_abort: list[str] = []
        self._recv_fail: dict[str, Failure] = {}
        self._recv_from: dict[str, dict[int, str]] = {}
        self._recv_hold: set[str] = set()
        self.prefill_senders: dict[tuple[str, int], dict[int, str]] = {}  # prefill addr -> rank -> instance id
        self.wanted: dict[str, tuple[str, tuple[str, int]]] = {}  # decode req -> (xfer, prefill addr) not landed
        self._last_renew = 0.0
        self.arrived: dict[str, float] = {}  # decode push-flow req -> when it arrived (admission bound)
        self.ready_xfers: OrderedDict[str, float] = OrderedDict()  # transfers a prefill said it is about to run
        self.doomed: dict[str, Failure] = {}  # decode req -> why its KV cannot come (admitted only to fail)
        self.first_waits: dict[str, FirstWait] = {}  # decode req -> its first-token wait (until it is scheduled)
        self._first_ready: set[str] = set()  # decode reqs whose first token was appended (workers may report them)
        self.worker_at: dict[tuple[str, int], dict[int, tuple[str, int]]] = {}  # prefill -> its workers' channels
        self.worker_links: dict[tuple[str, int, int], PeerClient] = {}  # (prefill host, port, rank) -> link
        self._link_retry: dict[tuple[str, int, int], float] = {}  # a dead link is not reopened before this time
        self._late: list[tuple[float, tuple[str, int], dict[str, Any]]] = []  # test-only (debug_dst_delay)
        self._reported: OrderedDict[str, None] = OrderedDict()  # traced: landed, not scheduled yet (d.scheduled)

    # ------------------------------------------------------------------ vLLM hooks (decode requests)
    def on_new_request(self, request: Any) -> None:
        """Take a lease on the transfer at once (the prefill then knows who holds it)."""
        params = self.ctx.params(request)  # checked (the scheduler side refused a request with bad ones)
        addr, xfer = params.side_channel, params.transfer
        if addr is not None and xfer:
            self.wanted[request.request_id] = (xfer, addr)
            self.arrived[request.request_id] = time.monotonic()
            self._outgoing[addr].append({"type": "renew", "xfers": [xfer]})
            trace.event("d.new", xfer, seq=request.request_id)
            if params.first_token and params.xfer:
                self.first_waits[request.request_id] = FirstWait(request, xfer, addr, int(request.num_prompt_tokens))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Claim the rest of the prompt for remote KV ``(n, True)`` once admitted (:meth:`_admit_now`),
        ``(None, False)`` until then."""
        params = self.ctx.params(request)
        if request.request_id in self.consumed or not params.side_channel:
            return 0, False
        if self.settings.debug_hold and params.debug_hold:
            return None, False  # test-only (debug_hold): never admitted; the lease is still renewed
        first = self.first_waits.get(request.request_id)
        count = (first.prompt_len if first is not None else request.num_prompt_tokens) - num_computed_tokens
        if count <= 0:
            if first is not None and not first.applied and request.request_id not in self.doomed:
                return None, False  # found locally, but it continues from the prefill's first token: wait
            return 0, False
        return (count, True) if self._admit_now(request.request_id, params) else (None, False)

    def _kv_usage(self) -> float:
        try:
            pool = self.block_pool
            return float(pool.get_usage()) if pool is not None else 0.0
        except Exception:  # a pool without get_usage: treat as empty
            return 0.0

    def _admit_now(self, rid: str, params: TransferParams) -> bool:
        """Whether to allocate ``rid``'s blocks now. Pull-flow KV exists already: yes. Push flow: yes
        while the cache is below ``admit_below`` used, or once the prefill said it is about to compute the
        request (``ready``); also when the KV cannot come any more (the request is then admitted only to take
        vLLM's failure path: an unallocated request cannot fail otherwise)."""
        xfer = params.xfer
        if not xfer:
            return True
        if rid in self.doomed or xfer in self.ready_xfers or self._kv_usage() < self.settings.admit_below:
            return True
        now = time.monotonic()
        self.drain_inbox(now)
        if rid in self.doomed or xfer in self.ready_xfers:
            return True
        addr = params.side_channel
        client = self.clients.get(addr) if addr is not None else None
        if client is not None and client.dead:
            self.doomed[rid] = Failure(FailureKind.SIDE_CHANNEL_UNUSABLE,
                                       f"prefill side channel unusable: {client.error}")
        elif now - self.arrived.get(rid, now) > self.settings.transfer_timeout:
            self.doomed[rid] = Failure(FailureKind.ADMISSION_TIMEOUT,
                                       f"the prefill did not start transfer {xfer} within "
                                       f"{self.settings.transfer_timeout:g}s (admit_below: this decode waited for "
                                       "its go-ahead)")
        return rid in self.doomed

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record the allocated destination blocks and queue them for the prefill side."""
        params = self.ctx.params(request)
        if request.request_id in self.consumed:
            return
        addr = params.side_channel
        if addr is None:
            return
        rid = request.request_id
        self.consumed.add(rid)
        self.arrived.pop(rid, None)
        xfer = str(params.transfer)  # the parser refuses a decode request with a side channel and no transfer
        mode = "push" if params.xfer else "pull"
        doomed = self.doomed.pop(rid, None)
        if num_external_tokens <= 0 or doomed is not None:
            # everything was found locally (or the KV cannot come): tell the prefill side not to wait for us
            self._outgoing[addr].append({"type": "cancel", "xfer": xfer, "seqs": [], "count": 1, "mode": mode})
            if num_external_tokens <= 0:
                return
        offset, unhashed, extra = new_blocks(blocks)
        self.recvs[rid] = Receive(rid, xfer, addr, time.monotonic())
        self._recv_start[rid] = self.settings.transfer_timeout
        first = self.first_waits.get(rid)
        if first is not None and not first.applied:
            self._recv_hold.add(rid)  # its workers report the KV landed only once the first token is appended
        trace.event("d.alloc", xfer, seq=rid)
        self._recv_blocks[rid] = unhashed
        if addr in self.prefill_senders:
            self._recv_from[rid] = self.prefill_senders[addr]
        if doomed is not None:
            log.warning("kvtransport: KV for %s will not come: %s", rid, doomed.reason)
            self._recv_fail[rid] = doomed
            self.wanted.pop(rid, None)
            return
        dst: dict[str, Any] = {"seq": rid, "blocks": unhashed, "offset": offset}
        if extra:
            dst["groups"] = extra
        msg = {"type": "dst", "xfer": xfer, "mode": mode, "dsts": [dst]}
        if self.settings.debug_dst_delay > 0 and params.debug_late:  # test only: a late decode
            self._late.append((time.monotonic() + self.settings.debug_dst_delay, addr, msg))
            return
        self._outgoing[addr].append(msg)

    def request_finished(self, request: Any) -> None:
        """Cancel an outstanding transfer (the request was aborted, or never allocated)."""
        rid = request.request_id
        self.first_waits.pop(rid, None)
        first_token_emitter.discard(rid)
        self._late = [x for x in self._late if all(d.get("seq") != rid for d in x[2]["dsts"])]
        self.wanted.pop(rid, None)
        self.arrived.pop(rid, None)
        self.doomed.pop(rid, None)
        rec = self.recvs.pop(rid, None)
        if rec is not None:  # aborted while waiting for its KV
            self._recv_abort.append(rid)
            self._recv_start.pop(rid, None)
            self._outgoing[rec.addr].append({"type": "cancel", "xfer": rec.xfer, "seqs": [rid], "count": 0})
        elif rid not in self.consumed:
            params = self.ctx.params(request)
            addr, xfer = params.side_channel, params.transfer
            if addr is not None and xfer:  # never allocated: the prefill should not wait (push) or hold (pull)
                self._outgoing[addr].append({"type": "cancel", "xfer": xfer, "seqs": [], "count": 1,
                                             "mode": "push" if params.xfer else "pull"})
        self.consumed.discard(rid)

    def landed(self, finished_recving: set[str]) -> None:
        """Workers' report of the last step: these receives ended."""
        for rid in finished_recving:
            self.recvs.pop(rid, None)
            self.wanted.pop(rid, None)
            self.first_waits.pop(rid, None)
            if trace.enabled():
                self._reported[rid] = None
                while len(self._reported) > TRACED_REPORTED:
                    self._reported.popitem(last=False)

    def trace_scheduled(self, scheduler_output: Any) -> None:
        """Tracing on: record ``d.scheduled`` for the requests whose receive ended and that this step schedules
        for the first time (the decode's first forward of them)."""
        for nd in getattr(scheduler_output, "scheduled_new_reqs", ()):
            if nd.req_id in self._reported:
                del self._reported[nd.req_id]
                trace.event("d.scheduled", nd.req_id)

    def awaits_first_token(self) -> bool:
        """Whether an allocated request waits for its first token (side channel)."""
        return any(f.request.request_id in self.recvs and not f.applied for f in self.first_waits.values())

    # ------------------------------------------------------------------ per step
    def plan_step(self, plan: StepPlan, now: float) -> None:
        """Renew leases; this step's receives (started, aborted, failed, bound, held, released); send queued
        messages."""
        self._renew(now)
        if self._late:
            due = [(addr, m) for t, addr, m in self._late if t <= now]
            self._late = [x for x in self._late if x[0] > now]
            for addr, m in due:
                self._outgoing[addr].append(m)
        plan.recv_start, self._recv_start = self._recv_start, {}
        plan.recv_blocks, self._recv_blocks = self._recv_blocks, {}
        plan.recv_abort, self._recv_abort = self._recv_abort, []
        plan.recv_fail = {rid: f.reason for rid, f in self._recv_fail.items()}
        plan.recv_fail_kind, self._recv_fail = {rid: f.kind for rid, f in self._recv_fail.items()}, {}
        plan.recv_from, self._recv_from = self._recv_from, {}
        plan.recv_hold, self._recv_hold = self._recv_hold, set()
        plan.recv_release, self._first_ready = self._first_ready, set()
        self._flush_outgoing()

    def on_event(self, ev: tuple[Any, ...], now: float) -> None:
        """A side-channel event of a prefill: a transfer refused (``fail``), its channel lost (``lost``), its
        workers (``senders``), a first token (``first``), a go-ahead to allocate (``ready``)."""
        kind = ev[0]
        if kind == "fail":
            _, seq, reason = ev
            if seq in self.recvs:
                self._recv_fail[seq] = Failure(FailureKind.REFUSED, str(reason))
                self.wanted.pop(seq, None)
        elif kind == "lost":
            _, addr, reason = ev
            self.prefill_senders.pop(tuple(addr), None)  # a restarted prefill tells its new workers
            self._drop_worker_links(tuple(addr))
            for rid, rec in self.recvs.items():
                if rec.addr == tuple(addr) and rid not in self._recv_fail:
                    log.warning("kvtransport: %s loses its prefill: %s", rid, reason)
                    self._recv_fail[rid] = Failure(FailureKind.PREFILL_LOST, PREFILL_LOST + str(reason))
                    self.wanted.pop(rid, None)
            for rid, (_, waddr) in self.wanted.items():  # not allocated yet: admitted only to fail
                if waddr == tuple(addr) and rid not in self.recvs and rid not in self.consumed:
                    self.doomed[rid] = Failure(FailureKind.PREFILL_LOST, PREFILL_LOST + str(reason))
        elif kind == "senders":  # that prefill's workers: bind the requests already waiting on it
            _, addr, senders = ev
            self.prefill_senders[tuple(addr)] = senders
            for rid, rec in self.recvs.items():
                if rec.addr == tuple(addr):
                    self._recv_from[rid] = senders
        elif kind == "workers":  # that prefill's workers' destination channels (its welcome)
            _, addr, worker_at = ev
            self._drop_worker_links(tuple(addr))
            self.worker_at[tuple(addr)] = dict(worker_at)
        elif kind == "first":
            _, addr, xfer, token = ev
            self._first_token_arrived(tuple(addr), str(xfer), int(token))
        elif kind == "ready":
            for xfer in ev[2]:
                self.ready_xfers[str(xfer)] = now
            while len(self.ready_xfers) > 4096:
                self.ready_xfers.popitem(last=False)

    def gauges(self) -> dict[str, int]:
        """Requests waiting for admission / for their KV."""
        return {"recv_unallocated": len(self.arrived), "recv_in_progress": len(self.recvs)}

    # ------------------------------------------------------------------ internals
    def _first_token_arrived(self, addr: tuple[str, int], xfer: str, token: int) -> None:
        """The prefill at ``addr`` sampled ``token`` as the first token of ``xfer``: append it to the
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
            if getattr(getattr(req, "sampling_params", None), "logprobs", None) is None:
                first_token_emitter.add(rid, token)  # the API server gets #1 with #2 (no logprobs row for it)
            first.applied = True
            self.counters["first_tokens_received"] += 1
            self._first_ready.add(rid)
            trace.event("d.first", xfer, seq=rid)

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
            c = PeerClient(addr[0], addr[1], self.hello, self.compat, self.inbox,
                           self.settings.connect_timeout, secret=self.settings.secret)
            self.clients[addr] = c
        return c

    def flush(self) -> None:
        """Send what is queued now (scheduler thread; non-blocking)."""
        if self._outgoing:
            self._flush_outgoing()

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
            links = self._worker_links(addr) if merged else []
            for m in merged.values():
                for link in links:  # straight to the workers first: they start putting at once
                    link.send(m)
                client.send(m)
        self._outgoing.clear()

    def _worker_links(self, addr: tuple[str, int]) -> list[PeerClient]:
        """Links to the destination channels of prefill ``addr``'s workers (known from its welcome), opened on
        first use; a dead one is reopened at most every WORKER_LINK_RETRY_S (its messages meanwhile reach the
        workers through their scheduler)."""
        now = time.monotonic()
        out = []
        for rank, (host, port) in self.worker_at.get(addr, {}).items():
            key = (addr[0], addr[1], rank)
            link = self.worker_links.get(key)
            if link is None or link.dead:
                if now < self._link_retry.get(key, 0.0):
                    continue
                self._link_retry[key] = now + WORKER_LINK_RETRY_S
                link = PeerClient(host, port, self.hello, self.compat, self.inbox,
                                  self.settings.connect_timeout, secret=self.settings.secret, worker=True)
                self.worker_links[key] = link
            out.append(link)
        return out

    def _drop_worker_links(self, addr: tuple[str, int]) -> None:
        self.worker_at.pop(addr, None)
        for key in [k for k in self.worker_links if (k[0], k[1]) == addr]:
            self.worker_links.pop(key).close()
            self._link_retry.pop(key, None)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for link in self.worker_links.values():
            link.close()


def new_blocks(blocks: Any) -> tuple[int, list[int], list[list[int]]]:
    """The blocks vLLM just allocated for a request (``KVCacheBlocks``) that its remote KV lands in: (the index
    of the first in the request's blocks, their ids in KV cache group 0, those of groups 1..)."""
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
    return offset, unhashed, [list(g[offset:offset + len(unhashed)]) for g in ids[1:]]


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
