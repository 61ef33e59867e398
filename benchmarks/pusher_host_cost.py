"""The prefill worker's own host cost per layer of a layer-wise push: what the pusher thread spends planning a
computed layer (kvtransport_vllm.pushplan) and mapping its push onto what it puts (unit runs), on the GIL that
the forward pass shares with it (one process per TP rank; the engine's scheduler too at TP 1).

    python benchmarks/pusher_host_cost.py [--requests 30]

A Llama-3.1-8B-shaped worker (32 layers, 8 KV heads of 128, bf16, 16-token blocks, the unit layout vLLM's GPU
caches get) on host memory; one 2,048-token request with random block ids (128 blocks on each side), its
destination bound before the forward; each of the 32 layers planned and expanded as the pusher does, without
the transport's put (the `inproc` backend is opened only for the layout). Reported: median microseconds per
layer, with the expansion done once per step (what the pusher does: every layer of a range shares one push,
and so one runs object, which the CUDA IPC launcher also keys its uploaded device table on) and once per layer
(what it did on 2026-12-03 before that: measured at +2.2 / +5.3 ms of forward time at 2k tokens on one H200).
Needs kvtransport-vllm and torch; no vLLM, no GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

LAYERS, BLOCKS, HEADS, BS, HEAD = 32, 300, 8, 16, 128


def measure(requests: int) -> dict[str, Any]:
    import torch
    from kvtransport_vllm.config import resolve_settings
    from kvtransport_vllm.metadata import Bind, SourceStep
    from kvtransport_vllm.pushplan import PutOp
    from kvtransport_vllm.worker import WorkerSide

    per = BLOCKS * HEADS * BS * 2 * HEAD
    flat = torch.zeros(LAYERS * per, dtype=torch.bfloat16)
    cache = {f"model.layers.{i}.self_attn.attn": flat[i * per:(i + 1) * per].view(BLOCKS, HEADS, BS, 2 * HEAD)
             for i in range(LAYERS)}
    worker = WorkerSide(settings=resolve_settings({"backend": "inproc"}), engine_id="e", block_size=BS)
    worker.register_kv_caches(cache)
    pusher = worker.pusher
    assert pusher is not None
    rng = random.Random(0)

    def one(shared: bool) -> float:
        plan = pusher.planner
        plan.step([SourceStep("r", "x", BS * 128, (tuple(rng.sample(range(1, BLOCKS), 128)),), 0, BS * 128)])
        plan.bind(Bind("x", "D", "s", tuple(rng.sample(range(1, BLOCKS), 128)), 0))
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            for op in plan.layer(layer):
                if isinstance(op, PutOp):
                    if not shared:  # as before: a new push, expanded again, for every layer
                        pusher._expanded.clear()
                        for src in plan.sources.values():
                            for d in src.dsts.values():
                                d.pushes.clear()
                    pusher._expand(op.push)
        took = time.perf_counter() - t0
        plan.step_end()
        plan.forget("r")
        return 1e6 * took / LAYERS

    try:
        out = {}
        for shared in (True, False):
            samples = [one(shared) for _ in range(requests)]
            out["per_step_us" if shared else "per_layer_us"] = round(statistics.median(samples), 1)
    finally:
        worker.shutdown()
    out.update(requests=requests, layers=LAYERS, blocks=128)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    print(json.dumps(measure(ap.parse_args().requests), indent=1))
