"""The connector's workers against a hostile (or merely misconfigured) peer (issue 29), as an attacker would try
them, at unit level (WorkerSide, its pusher and push planner over the in-process backend; no vLLM server):

* a peer's geometry never raises inside vLLM's model step: a welcome's ``senders`` map that does not split the
  model's KV heads, or a decode geometry that does not, fails that peer's requests through the failure path;
* the work one request costs is bounded: a decode claiming 1,024 ranks of 1-token blocks is refused at once,
  while legitimate unlike geometries still expand into exactly the right unit runs;
* connect threads and sockets are capped per decode engine and in total, however many ranks hellos claim;
* destinations that come before their prefill request (orphans) are bounded in block ids per decode engine and
  shared fairly: flooding engine ids cannot keep a real decode's early destination out.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm import pusher as pusher_mod  # noqa: E402
from kvtransport_vllm import pushplan as plan_mod  # noqa: E402
from kvtransport_vllm.config import resolve_settings  # noqa: E402
from kvtransport_vllm.metadata import Bind, Push, SourceStep, StepPlan  # noqa: E402
from kvtransport_vllm.pushplan import PushPlanner, PutOp  # noqa: E402
from kvtransport_vllm.worker import WorkerSide  # noqa: E402

from kvtransport import wire  # noqa: E402
from kvtransport.coalesce import BlockRun  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]

LAYERS, BLOCKS, KV_HEADS, BS, HEAD = 2, 160, 8, 16, 4
C = 2 * HEAD


def cache(heads: int, bs: int = BS, order: str = "HN") -> dict[str, torch.Tensor]:
    """Per-layer zeroed float32 views [blocks, heads, block_size, 2*head] laid out HND ("HN") or NHD ("NH")."""
    out = {}
    for i in range(LAYERS):
        t = torch.zeros(BLOCKS, heads, bs, C) if order == "HN" else torch.zeros(BLOCKS, bs, heads, C).permute(0, 2, 1, 3)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def worker(tp: int = 1, rank: int = 0, bs: int = BS, order: str = "HN", **extra: Any) -> WorkerSide:
    """A worker of an 8-KV-head model at TP ``tp`` (rank ``rank``) over the in-process backend."""
    w = WorkerSide(settings=resolve_settings({"backend": "inproc", "connect_timeout": 3, **extra}), engine_id="e",
                   tp_rank=rank, tp_size=tp, num_kv_heads=KV_HEADS, block_size=bs)
    w.register_kv_caches(cache(max(1, KV_HEADS // tp), bs, order))
    assert w.shard is not None  # the unit layout: unlike peers are mapped
    return w


@pytest.fixture
def prefill():
    w = worker()
    yield w
    w.shutdown()


@pytest.fixture
def decode():
    w = worker(transfer_timeout=60)
    yield w
    w.shutdown()


def send_failures(w: WorkerSide, want: int, timeout: float) -> list[Any]:
    """The send failures ``w`` reports within ``timeout`` (returns once ``want`` came)."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        w.transfer_results()
        out += w.take_send_failures()
        time.sleep(0.005)
    return out


# ------------------------------------------------------------------ 1. a peer's data never raises in the model step
def test_a_decode_worker_fails_requests_whose_senders_do_not_split_the_model(decode: WorkerSide) -> None:
    """A welcome's ``senders`` map (prefill tp rank -> kvtransport instance) reaches ``bind()`` in vLLM's model
    step: 3 senders for 8 KV heads raised LayoutError there; ranks with a gap bound only some of the heads (the
    request would have been reported landed with half its KV); 4,096 senders claim a TP no prefill runs. Each
    of them now fails that request through the failure path (reported failed once fenced), nothing raises, and
    a well-formed request in the same plan waits for its two parts as before."""
    three = {r: f"inst-{r}" for r in range(3)}
    plan = StepPlan(recv_start={"three": 60, "gap": 60, "many": 60, "ok": 60},
                    recv_from={"three": three, "gap": {0: "inst-0", 5: "inst-5"},
                               "many": {r: f"i{r}" for r in range(4096)}, "ok": {0: "inst-0", 1: "inst-1"}})
    decode.bind(plan)  # raised LayoutError ("8 KV heads cannot be split over tp 3") before
    failed: set[str] = set()
    recving: set[str] = set()
    deadline = time.monotonic() + 5
    while failed != {"three", "gap", "many"} and time.monotonic() < deadline:
        r = decode.transfer_results()
        failed |= r.failed_recving
        recving |= r.finished_recving
        time.sleep(0.01)
    assert failed == {"three", "gap", "many"} and recving == failed
    assert decode.stats_delta()["transfer_failures"] == 3
    assert decode._parts == {"ok": {"ok#kvt-p0": "inst-0", "ok#kvt-p1": "inst-1"}} and "ok" in decode._waiting
    # the same maps in a later step (a request admitted after the welcome): failed again, never raised
    decode.bind(StepPlan(recv_start={"again": 60}, recv_from={"again": three}))
    assert "again" not in decode._waiting


def test_a_prefill_worker_refuses_a_decode_geometry_that_does_not_fit_the_model(prefill: WorkerSide) -> None:
    """A decode's geometry (from its hello, forwarded by the scheduler with the plan) reached ``bind()``, which
    computed the ranks to connect from it: 3 ranks for 8 KV heads, or the block size the scheduler records as -1
    for a malformed one, raised LayoutError in the model step. Now the engine is refused where its geometry
    enters: bind() returns, and a destination of that engine fails with the reason (the scheduler tells the
    decode), once per destination."""
    bad = {"THREE": {"tp_size": 3, "block_size": 16, "kv_order": "HN"},
           "MALFORMED": {"tp_size": 2, "block_size": -1, "kv_order": None},
           "TYPES": {"tp_size": "2", "block_size": 16.5, "kv_order": "HN"}}
    prefill.bind(StepPlan(peers={e: {} for e in bad}, peer_geometry=bad))  # raised LayoutError before
    src = tuple(range(1, 5))
    prefill.bind(StepPlan(sources=[SourceStep("p", "x", 4 * BS, (src,), 0, 4 * BS)],
                          binds=[Bind("x", e, f"d-{e}", tuple(range(10, 14))) for e in bad]))
    for name, t in cache(KV_HEADS).items():
        prefill.save_kv_layer(name, t)
    prefill.wait_for_save()
    fails = send_failures(prefill, 3, 5)
    time.sleep(0.2)
    fails += send_failures(prefill, 1, 0.1)  # nothing more: one failure per destination
    assert sorted((f.seq, f.engine) for f in fails) == [("d-MALFORMED", "MALFORMED"), ("d-THREE", "THREE"),
                                                         ("d-TYPES", "TYPES")]
    why = {f.engine: f.reason for f in fails}
    assert "8 KV heads cannot be split over tp 3" in why["THREE"]
    assert "block_size" in why["MALFORMED"] and "tp_size" in why["TYPES"]


# ------------------------------------------------------------------ 2. work per request bounded
def test_a_decode_claiming_1024_ranks_of_1_token_blocks_is_refused_at_once(prefill: WorkerSide) -> None:
    """tp_size=1024, block_size=1: one push of a 2,048-token prompt expanded into 131,072 unit runs on the pusher
    thread (~10 s of the GIL the forward shares). The claim is refused where it enters (over MAX_PEER_TP): bind()
    takes < 50 ms, the pusher never spends 50 ms mapping it, the destination fails with the reason within 1 s."""
    spent: list[float] = []
    real = prefill.pusher.expand

    def timed(p: Push, geo: dict[str, Any] | None) -> list[Push]:
        t0 = time.perf_counter()
        try:
            return real(p, geo)
        finally:
            spent.append(time.perf_counter() - t0)

    prefill.pusher.expand = timed
    t0 = time.perf_counter()
    prefill.bind(StepPlan(peers={"HUGE": {}}, peer_geometry={"HUGE": {"tp_size": 1024, "block_size": 1,
                                                                       "kv_order": "HN"}}))
    assert time.perf_counter() - t0 < 0.5  # (was ~9.9 s of expansion; the slack is for a loaded CI host)
    src = tuple(range(1, 129))  # 2,048 tokens
    t0 = time.monotonic()
    prefill.bind(StepPlan(sources=[SourceStep("p", "x", 2048, (src,), 0, 2048)],
                          binds=[Bind("x", "HUGE", "d", tuple(range(1, 2049)))]))
    for name, t in cache(KV_HEADS).items():
        prefill.save_kv_layer(name, t)
    prefill.wait_for_save()
    fails = send_failures(prefill, 1, 2.0)
    assert [(f.seq, f.engine) for f in fails] == [("d", "HUGE")], fails
    assert time.monotonic() - t0 < 3.0 and max(spent, default=0.0) < 0.5
    assert "tp_size 1024" in fails[0].reason and "64" in fails[0].reason


def test_expansion_cost_is_bounded_per_token() -> None:
    """Within MAX_PEER_TP the geometry still bounds the work: pieces per prompt token (a head over a stretch between
    two block boundaries, over every rank this worker sends to) at most MAX_PIECES_PER_TOKEN. 64 ranks of 1-token
    blocks cost 64 x (1/16 + 1) = 68 per token, 64 of 8-token blocks 12, 8 of 1-token blocks 8.5 (refused); 64
    ranks of 16-token blocks (8), 8 of 2-token blocks (4.5) or an NHD decode of 64 ranks (8) are served."""
    from kvtransport_vllm.geometry import MAX_PEER_TP, MAX_PIECES_PER_TOKEN, check_peer_geometry, served_ranks

    from kvtransport import LayoutError
    from kvtransport.reshard import Shard

    assert (MAX_PEER_TP, MAX_PIECES_PER_TOKEN) == (64, 8)
    hn = Shard(1, 0, KV_HEADS, BS, "HN")
    nh = Shard(1, 0, KV_HEADS, BS, "NH")
    assert served_ranks(hn, check_peer_geometry({"tp_size": 64, "block_size": 16, "kv_order": "HN"})) == list(range(64))
    assert served_ranks(hn, check_peer_geometry({"tp_size": 8, "block_size": 2, "kv_order": "HN"})) == list(range(8))
    assert served_ranks(nh, check_peer_geometry({"tp_size": 64, "block_size": 16, "kv_order": "NH"})) == list(range(64))
    for tp, bs, cost in ((64, 1, "68"), (64, 8, "12"), (8, 1, "8.5")):
        with pytest.raises(LayoutError, match=f"costs {cost} pieces per prompt token"):
            served_ranks(hn, check_peer_geometry({"tp_size": tp, "block_size": bs, "kv_order": "HN"}))
    # a rank holding 64 heads in 16-token blocks may face 8-token blocks: 64 x (1/16 + 1/8) = 12 <= 4 x 64 / 16
    assert served_ranks(Shard(1, 0, 64, BS, "HN"), {"tp_size": 2, "block_size": 8, "kv_order": "HN"}) == [0, 1]
    # a prefill rank of TP2 sends a TP4 decode's ranks 0 and 1 (its heads 0-3) only
    assert served_ranks(Shard(2, 0, KV_HEADS, BS, "HN"), {"tp_size": 4, "block_size": 32, "kv_order": "HN"}) == [0, 1]
    for raw in ({"tp_size": 65, "block_size": 16, "kv_order": "HN"}, {"tp_size": 0, "block_size": 16},
                {"tp_size": 10**5000, "block_size": 16}, {"tp_size": True, "block_size": 16},
                {"tp_size": 2, "block_size": 0}, {"tp_size": 2, "block_size": 16, "kv_order": "XY"}, [2, 16], None):
        with pytest.raises(LayoutError):
            check_peer_geometry(raw)


def brute_runs(src_tp: int, src_rank: int, src_bs: int, dst_tp: int, dst_rank: int, dst_bs: int, dst_order: str,
               src_blocks: tuple[int, ...], dst_blocks: tuple[int, ...], start: int, stop: int,
               dst_first: int) -> list[BlockRun]:
    """The unit runs from first principles: every (token, head) both ranks hold, source HND units, destination
    HND or NHD units, coalesced where both sides are contiguous (the source rank that owns a head sends it; a
    decode rank's head comes from the only source rank that holds it: no replication on the source here)."""
    src_per, dst_heads = KV_HEADS // src_tp, max(1, KV_HEADS // dst_tp)
    mine = range(src_rank * src_per, (src_rank + 1) * src_per)
    theirs = [dst_rank // (dst_tp // KV_HEADS)] if dst_tp > KV_HEADS else \
        list(range(dst_rank * dst_heads, (dst_rank + 1) * dst_heads))
    pairs = []
    for tok in range(start, stop):
        sb, so = divmod(tok, src_bs)
        db, do = divmod(tok - dst_first, dst_bs)
        for j, h in enumerate(theirs):
            if h not in mine:
                continue
            s = src_blocks[sb] * src_per * src_bs + (h - mine.start) * src_bs + so
            if dst_order == "HN":
                d = dst_blocks[db] * dst_heads * dst_bs + j * dst_bs + do
            else:
                d = dst_blocks[db] * dst_heads * dst_bs + do * dst_heads + j
            pairs.append((s, d))
    pairs.sort()
    runs: list[BlockRun] = []
    for s, d in pairs:
        if runs and runs[-1].src + runs[-1].count == s and runs[-1].dst + runs[-1].count == d:
            runs[-1] = BlockRun(runs[-1].src, runs[-1].dst, runs[-1].count + 1)
        else:
            runs.append(BlockRun(s, d, 1))
    return runs


@pytest.mark.parametrize(("dst_tp", "dst_bs", "dst_order", "runs_per_rank"), [
    # TP2 -> TP1: rank 0's 4 heads are contiguous on both sides: one run per whole block (9), one per head in
    # the partial first block (4)
    (1, 16, "HN", {0: 9 + 4}),
    (1, 32, "HN", {0: 10 * 4}),  # block size 32: each of the 10 source blocks, per head, half a decode block
    (4, 16, "HN", {0: 9 + 2, 1: 9 + 2}),  # TP2 -> TP4: rank 0 sends decode ranks 0 and 1 their 2 heads each
    (4, 32, "NH", {0: 150 * 2, 1: 150 * 2}),  # NHD decode blocks: one run per token and head
])
def test_legitimate_unlike_geometries_expand_into_exact_runs(dst_tp: int, dst_bs: int, dst_order: str,
                                                              runs_per_rank: dict[int, int]) -> None:
    """Prefill TP2 (HND, 16-token blocks) towards decodes of TP1 or TP4, block sizes 16/32, HND or NHD: what the
    pusher puts for a 150-token range (from token 10, source block ids scrambled) is exactly the runs computed
    from first principles, one push per decode rank that holds some of this rank's heads."""
    geo = {"tp_size": dst_tp, "block_size": dst_bs, "kv_order": dst_order}
    p0 = worker(tp=2, rank=0)
    try:
        p0.bind(StepPlan(peers={"D": {}}, peer_geometry={"D": geo}))
        start, stop, dst_first = 10, 160, 0
        src_blocks = (7, 3, 11, 2, 9, 5, 13, 1, 15, 4)
        dst_blocks = tuple(range(40, 40 + -(-stop // dst_bs)))
        push = Push("p", "d", "D", src_blocks, dst_blocks, start=start, stop=stop, dst_first=dst_first)
        out = p0._expand_one(push, geo)
        assert {q.rank: len(q.runs) for q in out} == runs_per_rank
        for q in out:
            assert list(q.runs) == brute_runs(2, 0, BS, dst_tp, q.rank, dst_bs, dst_order, src_blocks, dst_blocks,
                                              start, stop, dst_first), q.rank
    finally:
        p0.shutdown()


# ------------------------------------------------------------------ 3. connections and threads capped
def connect_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("kvt-connect-"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settle(timeout: float = 10.0) -> None:
    """Wait until no connect thread of an earlier test (each ends within its connect_timeout) is left."""
    deadline = time.monotonic() + timeout
    while connect_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connect_threads() == 0


def watch(seconds: float, until: Any = None, longest: float = 10.0) -> tuple[int, int]:
    """Peak connect threads and open fds over ``seconds`` (and on until ``until()`` holds, ``longest`` at most)."""
    threads = fds = 0
    t0 = time.monotonic()
    while time.monotonic() < t0 + seconds or (until is not None and not until() and time.monotonic() < t0 + longest):
        threads, fds = max(threads, connect_threads()), max(fds, open_fds())
        time.sleep(0.01)
    return threads, fds


def fake_workers(live: bytes, port: int, engine: str, ranks: int) -> dict[int, bytes]:
    """A hello's ``workers``: ``ranks`` made-up decode workers whose side channel is ``port`` (a blackhole)."""
    base = wire.decode_metadata(live)
    return {r: wire.encode_metadata({**base, "instance": f"{engine}-{r}", "port": port}) for r in range(ranks)}


MAX_CONNECTS = getattr(pusher_mod, "MAX_CONNECTS", 32)
MAX_LINKS = getattr(pusher_mod, "MAX_LINKS", 256)
MAX_LINKS_PER_PEER = getattr(pusher_mod, "MAX_LINKS_PER_PEER", 64)


def test_hellos_claiming_1024_ranks_cost_bounded_threads_and_sockets(prefill: WorkerSide,
                                                                     decode: WorkerSide) -> None:
    """Two made-up decode engines whose hellos list 1,024 workers each (and a geometry of 1,024 ranks), and eight
    more that claim a valid TP of 64 (512 links, over MAX_LINKS), all towards a TCP blackhole: one thread and one
    socket per rank was 2,048 of each within a second, again every round. Now connect threads stay within
    MAX_CONNECTS and sockets with them, links within MAX_LINKS in total and MAX_LINKS_PER_PEER per engine, round
    after round."""
    settle()
    live = decode.handshake()["metadata"]
    pusher = prefill.pusher
    assert pusher is not None
    with socket.create_server(("127.0.0.1", 0), backlog=4096) as hole:  # the kernel completes TCP; no answer
        port = hole.getsockname()[1]
        fds0 = open_fds()
        peaks = []
        for rnd in range(3):
            huge = {f"HUGE{rnd}-{i}": fake_workers(live, port, f"HUGE{rnd}-{i}", 1024) for i in range(2)}
            many = {f"TP64-{rnd}-{i}": fake_workers(live, port, f"TP64-{rnd}-{i}", 64) for i in range(8)}
            geo = {**{e: {"tp_size": 1024, "block_size": 16, "kv_order": "HN"} for e in huge},
                   **{e: {"tp_size": 64, "block_size": 16, "kv_order": "HN"} for e in many}}
            prefill.bind(StepPlan(peers={**huge, **many}, peer_geometry=geo))
            threads, fds = watch(1.0)
            links = [*pusher.peers, *pusher.connecting]
            per_engine: dict[str, int] = {}
            for engine, _ in links:
                per_engine[engine] = per_engine.get(engine, 0) + 1
            peaks.append({"threads": threads, "fds": fds - fds0, "links": len(links),
                          "per_engine": max(per_engine.values()),
                          "huge": sum(n for e, n in per_engine.items() if e.startswith("HUGE"))})
        assert all(pk["threads"] <= MAX_CONNECTS and pk["fds"] <= MAX_CONNECTS + 8 and pk["links"] <= MAX_LINKS
                   and pk["per_engine"] <= MAX_LINKS_PER_PEER and pk["huge"] == 0 for pk in peaks), peaks
    assert (pusher_mod.MAX_CONNECTS, pusher_mod.MAX_LINKS, pusher_mod.MAX_LINKS_PER_PEER) == (32, 256, 64)


def test_the_pusher_caps_links_per_decode_engine(prefill: WorkerSide, decode: WorkerSide) -> None:
    """At the pusher itself (whatever its caller): an engine introduced with 1,024 destination ranks to connect
    gets MAX_LINKS_PER_PEER links, the rest refused (one rate-limited log line); introducing it again adds none."""
    settle()
    live = decode.handshake()["metadata"]
    pusher = prefill.pusher
    assert pusher is not None
    with socket.create_server(("127.0.0.1", 0), backlog=4096) as hole:
        metas = fake_workers(live, hole.getsockname()[1], "WIDE", 1024)
        def wide() -> int:
            return sum(1 for e, _ in [*pusher.peers, *pusher.connecting] if e == "WIDE")

        for _ in range(2):
            pusher.submit("peers", {"WIDE": metas}, {"WIDE": list(range(1024))}, {})
            threads, _ = watch(0.5, until=lambda: wide() >= MAX_LINKS_PER_PEER)
            assert threads <= min(MAX_CONNECTS, MAX_LINKS_PER_PEER), threads
            assert wide() == MAX_LINKS_PER_PEER


# ------------------------------------------------------------------ 4. orphans bounded per engine, shared fairly
def orphan_cost(b: Bind) -> int:
    return plan_mod.ORPHAN_ENTRY_COST + len(b.blocks) + sum(len(g) for g in b.groups)


def test_one_engines_early_destinations_are_capped_in_block_ids() -> None:
    """Destinations that come before their prefill request wait in the planner: one engine could park 4,096
    transfers x 64 destinations of up to a million block ids each. Now an engine holds at most
    MAX_ORPHAN_BLOCKS_PER_ENGINE block ids (its entries counted too): 7 destinations of 65,536 blocks, the 8th
    refused, and its small ones still fit until the budget is spent."""
    p = PushPlanner([0], BS, lambda e: None)
    big = tuple(range(1, 65537))
    got = [p.bind(Bind(f"f{i}", "FLOOD", "s", big), now=1.0)[1] for i in range(10)]
    assert got == ["pending"] * 7 + ["refused: decode engine FLOOD holds too many block ids in destinations whose "
                                     "prefill request has not arrived (MAX_ORPHAN_BLOCKS_PER_ENGINE)"] * 3
    assert plan_mod.MAX_ORPHAN_BLOCKS_PER_ENGINE == 1 << 19 and plan_mod.ORPHAN_ENTRY_COST == 16
    held = sum(orphan_cost(b) for by_seq in p.pending.values() for _, b in by_seq.values())
    assert held == 7 * (16 + 65536) == p.orphan_usage("FLOOD")
    # what is left (524,288 - 458,864 = 65,424) takes small destinations: 3,848 of 1 block (17 each)
    small = [p.bind(Bind(f"g{i}", "FLOOD", "s", (1,)), now=1.0)[1] for i in range(3849)]
    assert small.count("pending") == 3848 and small[-1].startswith("refused")
    # expiring and forgetting give the budget back
    p.expire(before=2.0)
    assert p.orphan_usage("FLOOD") == 0 and not p.pending


def test_flooding_engine_ids_cannot_keep_a_real_decodes_early_destination_out() -> None:
    """Four made-up engine ids filled MAX_PENDING (4,096 transfers) and the real decode's early destination was
    refused; eight that fill their block budget fill the total (MAX_ORPHAN_BLOCKS, 4 engines' worth). A real
    decode's early destination is still accepted (the engine holding the most gives up its oldest) and binds when
    its prefill request arrives; flooders that parked destinations on the real transfer's id do not crowd it out
    either."""
    p = PushPlanner([0, 0], BS, lambda e: None)
    for i in range(4):  # the attack: 4 engines x 1,024 small orphans
        assert {p.bind(Bind(f"a{i}-{j}", f"FAKE{i}", "s", (1,)), now=1.0)[1] for j in range(1024)} == {"pending"}
    # flooders park 64 destinations each on the real transfer's id (MAX_PENDING_PER_XFER was per transfer)
    for i in range(4):
        assert {p.bind(Bind("real-x", f"FAKE{i}", f"s{j}", (1,)), now=1.0)[1] for j in range(64)} == {"pending"}
    big = tuple(range(1, 65537))
    for i in range(8):  # 8 engines x 7 x 65,552 > the total: the flooders balance among themselves
        for j in range(8):
            p.bind(Bind(f"b{i}-{j}", f"BIG{i}", "s", big), now=1.0)
    usage = {e: p.orphan_usage(e) for e in [f"FAKE{i}" for i in range(4)] + [f"BIG{i}" for i in range(8)]}
    assert sum(usage.values()) <= plan_mod.MAX_ORPHAN_BLOCKS == 4 * plan_mod.MAX_ORPHAN_BLOCKS_PER_ENGINE
    assert max(usage.values()) <= plan_mod.MAX_ORPHAN_BLOCKS_PER_ENGINE
    real = Bind("real-x", "REAL", "d", (20, 21))
    assert p.bind(real, now=1.0)[1] == "pending"
    assert p.orphan_usage("REAL") == 16 + 2
    ops = p.step([SourceStep("r", "real-x", 2 * BS, ((5, 6),), 0, 2 * BS)], now=1.5)
    assert p.counts["before"] >= 1 and "d" in p.sources["real-x"].dsts
    ops += p.layer(0) + p.layer(1) + p.step_end()
    mine = [op for op in ops if isinstance(op, PutOp) and op.push.seq == "d"]
    assert [(op.push.src, op.push.dst, op.layers) for op in mine] == [((5, 6), (20, 21), (0,)), ((5, 6), (20, 21), (1,))]
    assert p.orphan_usage("REAL") == 0
