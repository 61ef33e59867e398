"""Unlike prefill and decode workers (TP sizes, block sizes, HND/NHD orders) over the real nccl backend (gloo on
host memory): every prefill rank's WorkerSide pushes the heads each decode rank owns, each decode rank reports
the request once every part landed, and the decode caches then hold exactly the prompt's KV (the model's heads
placed as vLLM places them), every other byte untouched."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm.config import resolve_settings  # noqa: E402
from kvtransport_vllm.geometry import Geometry, describe, part_seq  # noqa: E402
from kvtransport_vllm.metadata import Bind, SourceStep, StepPlan  # noqa: E402
from kvtransport_vllm.worker import TransferResults, WorkerSide  # noqa: E402

from kvtransport.reshard import kv_heads_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

LAYERS, BLOCKS, KV_HEADS, HEAD = 2, 24, 2, 4
C = 2 * HEAD


def cache(heads: int, bs: int, order: str) -> dict[str, torch.Tensor]:
    """Per-layer zeroed views [blocks, heads, block_size, 2*head] laid out HND ("HN") or NHD ("NH")."""
    out = {}
    for i in range(LAYERS):
        if order == "HN":
            t = torch.zeros(BLOCKS, heads, bs, C)
        else:
            t = torch.zeros(BLOCKS, bs, heads, C).permute(0, 2, 1, 3)
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


def truth(tokens: int) -> torch.Tensor:
    """[layers, tokens, kv heads, 2*head]: the prompt's KV, never 0."""
    g = torch.Generator().manual_seed(7)
    return torch.rand(LAYERS, tokens, KV_HEADS, C, generator=g) + 1.0


def place(kv: dict[str, torch.Tensor], tp: int, rank: int, bs: int, blocks: list[int], first: int, t0: int,
          t1: int, values: torch.Tensor, cpu: bool = False) -> None:
    """Write tokens [t0, t1) of rank ``rank``'s heads into ``blocks`` (blocks[i] holds tokens first + i*bs on).
    ``cpu``: as vLLM's CPU attention stores them (per block and head, K transposed [head][slot], then V)."""
    heads = kv_heads_of(KV_HEADS, tp, rank)
    for li, t in enumerate(kv.values()):
        for tok in range(t0, t1):
            b, slot = divmod(tok - first, bs)
            for j, h in enumerate(heads):
                if cpu:
                    region = t[blocks[b], j].reshape(-1)  # HND: one (block, head) is contiguous
                    for e in range(HEAD):
                        region[e * bs + slot] = values[li, tok, h, e]
                        region[bs * HEAD + slot * HEAD + e] = values[li, tok, h, HEAD + e]
                else:
                    t[blocks[b], j, slot] = values[li, tok, h]


def workers(tp: int, bs: int, order: str, **extra) -> tuple[list[WorkerSide], list[dict[str, torch.Tensor]]]:
    ws, caches = [], []
    for r in range(tp):
        kv = cache(len(kv_heads_of(KV_HEADS, tp, r)), bs, "HN" if order == "CPU" else order)
        w = WorkerSide(settings=resolve_settings({"backend": "nccl", "connect_timeout": 20, **extra}),
                       engine_id="e", tp_rank=r, tp_size=tp, num_kv_heads=KV_HEADS, cpu_attn=order == "CPU",
                       block_size=bs)
        w.register_kv_caches(kv)
        ws.append(w)
        caches.append(kv)
    return ws, caches


def poll_all(ws: list[WorkerSide], what: str, rid: str, timeout: float = 30,
             senders: Sequence[WorkerSide] = ()) -> None:
    """Until every worker of ``ws`` reports ``rid`` in ``what``; fails at once on a failed receive, or on a push
    failure ``senders`` report (the scheduler would tell the decode, which this harness has not)."""
    deadline = time.monotonic() + timeout
    pending = set(range(len(ws)))
    failed: set[str] = set()
    while pending and time.monotonic() < deadline and not failed:
        for i in list(pending):
            r: TransferResults = ws[i].transfer_results()
            failed |= r.failed_recving
            if rid in getattr(r, what):
                pending.discard(i)
        for sender in senders:  # a peek: what the senders report stays for their own polls
            if sender.pusher is not None:
                with sender.pusher.lock:
                    failed |= {f"{f.seq}: {f.reason}" for f in (*sender._pending_send_failures, *sender.pusher.failures)}
        time.sleep(0.01)
    assert not failed, failed
    assert not pending, f"{rid} not in {what} of ranks {sorted(pending)}"


def test_geometry_of_vllm_views() -> None:
    assert describe(cache(2, 16, "HN"), 0) == Geometry("HN", 2, 16, C * 4, BLOCKS)
    assert describe(cache(2, 16, "NH"), 0) == Geometry("NH", 2, 16, C * 4, BLOCKS)
    # one head: both orders are the same bytes, called HND
    assert describe(cache(1, 16, "NH"), 0) == Geometry("HN", 1, 16, C * 4, BLOCKS)
    # cross-layer blocks (block outermost over the layers) are not dense per layer: the block layout
    buf = torch.zeros(BLOCKS, LAYERS, 2, 16, C)
    assert describe({f"l{i}": buf[:, i] for i in range(LAYERS)}, 0) is None
    assert part_seq("r", 1, 1) == "r" and part_seq("r", 1, 2) == "r#kvt-p1"
    # vLLM's CPU attention: element units, K and V told apart
    assert describe(cache(2, 16, "HN"), 0, cpu_attn=True) == Geometry("CPU", 2, 16, 4, BLOCKS, HEAD)
    assert describe(cache(2, 16, "NH"), 0, cpu_attn=True) is None


@pytest.mark.parametrize(("ptp", "dtp", "pbs", "dbs", "dorder", "pstart"), [
    (2, 1, 16, 16, "HN", 0),  # TP2 -> TP1: the decode rank hears from both prefill ranks (two parts)
    (1, 2, 16, 16, "HN", 0),  # TP1 -> TP2: the prefill rank sends each decode rank its head
    (2, 2, 16, 32, "HN", 0),  # like TP, block size ratio 2
    (1, 2, 32, 16, "NH", 0),  # TP split, block size ratio 1/2, HND -> NHD (one run per token)
    (1, 4, 16, 16, "HN", 0),  # decode TP above the KV head count: each head replicated on two ranks
    (4, 1, 16, 16, "HN", 0),  # prefill replicates: each head taken from one replica
    (2, 1, 16, 32, "CPU", 0),  # vLLM's CPU attention layout on both sides (K transposed per block)
    (1, 2, 32, 16, "CPU", 0),
    # the prefill's first step starts past token 0 (its prefix cache held the first block): the prefix it did
    # not compute here still goes, from its cached blocks (issue 32)
    (1, 2, 32, 16, "NH", 32),
    (2, 1, 16, 32, "CPU", 16),
])
def test_unlike_workers_move_exactly_the_prompt(ptp: int, dtp: int, pbs: int, dbs: int, dorder: str,
                                                pstart: int) -> None:
    prompt = 45  # several blocks on both sides, the last one partial
    values = truth(prompt)
    cpu = dorder == "CPU"
    ps, pcaches = workers(ptp, pbs, "CPU" if cpu else "HN")
    ds, dcaches = workers(dtp, dbs, dorder, transfer_timeout=60)
    try:
        src_blocks = [5, 2, 9, 11, 3, 7][: -(-prompt // pbs)]
        dst_offset = 1  # the decode had the first block (a prefix hit): only the rest moves
        dst_first = dst_offset * dbs
        dst_blocks = [20, 4, 13, 1, 17, 8][: -(-(prompt - dst_first) // dbs)]
        for r in range(ptp):
            place(pcaches[r], ptp, r, pbs, src_blocks, 0, 0, prompt, values, cpu)
        senders = {r: p.cm.instance for r, p in enumerate(ps)}
        for d in ds:
            d.bind(StepPlan(recv_start={"dreq": 60}, recv_from={"dreq": senders}))
        metas = {r: d.handshake()["metadata"] for r, d in enumerate(ds)}
        geo = {"tp_size": dtp, "block_size": dbs, "kv_order": ds[0].geometry.order}
        # two chunks (the first ends inside a block); the destination comes with the second: what the first
        # computed goes at once, the rest layer by layer
        cut = 20
        for r, p in enumerate(ps):
            for lo, hi, binds in ((pstart, cut, []),
                                  (cut, prompt, [Bind("preq", "D", "dreq", tuple(dst_blocks), dst_offset)])):
                p.bind(StepPlan(peers={"D": metas} if lo == pstart else {},
                                peer_geometry={"D": geo} if lo == pstart else {},
                                sources=[SourceStep("preq", "preq", prompt, (tuple(src_blocks),), lo, hi)],
                                binds=binds))
                for name, t in pcaches[r].items():
                    p.save_kv_layer(name, t)
                p.wait_for_save()
        poll_all(ds, "finished_recving", "dreq", senders=ps)
        for p in ps:
            p.bind(StepPlan(send_release=["preq"]))
        poll_all(ps, "finished_sending", "preq")
        for r in range(dtp):
            want = cache(len(kv_heads_of(KV_HEADS, dtp, r)), dbs, "HN" if cpu else dorder)
            place(want, dtp, r, dbs, dst_blocks, dst_first, dst_first, prompt, values, cpu)
            for name in want:
                assert torch.equal(dcaches[r][name], want[name]), f"decode rank {r} {name}"
        stats = [d.stats_delta() for d in ds]
        assert [s["transfers_received"] for s in stats] == [1] * dtp and all(s["transfer_failures"] == 0
                                                                           for s in stats)
        sent = sum(p.stats_delta()["bytes_sent"] for p in ps)
        # every destination head byte exactly once: tokens x heads of each decode rank x layers
        heads_total = sum(len(kv_heads_of(KV_HEADS, dtp, r)) for r in range(dtp))
        assert sent == (prompt - dst_first) * heads_total * C * 4 * LAYERS
    finally:
        for w in ps + ds:
            w.shutdown()
