"""Small helpers to drive vLLM's real Scheduler with fake runner outputs (vLLM's own test helpers are not in
the wheel). Imported only when vLLM is importable."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

EOS = 2
COMPAT_INFO = {"model": "tiny-orphan-model", "block_size": 16}
"""What the prefill scheduler sides of the producer tests say about their model (compatibility checks)."""
_ids = itertools.count(1)
_hash_ready = False


def make_config(model: str, *, role: str, extra: dict[str, Any] | None = None, block_size: int = 16,
                max_num_batched_tokens: int = 256, policy: str = "fail") -> VllmConfig:
    """A VllmConfig using KVTransportConnector (by module path) on the CPU."""
    mc = ModelConfig(model=model, dtype="float32", seed=0, max_model_len=2048)
    sc = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    cc = CacheConfig(block_size=block_size, gpu_memory_utilization=0.1, cache_dtype="auto",
                     enable_prefix_caching=True)
    ktc = KVTransferConfig(kv_connector="KVTransportConnector", kv_connector_module_path="kvtransport_vllm.connector",
                           kv_role=role, kv_connector_extra_config=dict(extra or {}),
                           kv_load_failure_policy=policy)
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=ktc,
                      device_config=DeviceConfig("cpu"))


def make_scheduler(cfg: VllmConfig, num_blocks: int = 1000) -> Scheduler:
    bs = cfg.cache_config.block_size
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    cfg.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=kcc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=bs)


def make_request(tokens: list[int], *, params: dict[str, Any] | None = None, max_tokens: int = 4,
                 block_size: int = 16, rid: str | None = None) -> Request:
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    sp.update_from_generation_config({}, EOS)
    req = Request(request_id=rid or f"req-{next(_ids)}", prompt_token_ids=list(tokens), sampling_params=sp,
                  pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = params
    return req


def runner_output(reqs: list[Request], *, token: int | None = 7, sending: set[str] | None = None,
                  recving: set[str] | None = None, failed: set[str] | None = None,
                  failed_blocks: set[int] | None = None, worker_meta: Any = None) -> ModelRunnerOutput:
    """One sampled token for each of ``reqs`` (none when ``token`` is None: a partial prefill) plus the
    connector's report. ``failed``: receives that failed, reported the way the installed vLLM takes them
    (0.32+: ``failed_recving``; before: finished, with their blocks, ``failed_blocks``, as load errors)."""
    kvo = None
    if sending or recving or failed or worker_meta is not None:
        extra: dict[str, Any] = {}
        if failed:  # vLLM < 0.32 learns of failed receives from block ids only (the connector reports them)
            if "failed_recving" in KVConnectorOutput.__dataclass_fields__:
                extra["failed_recving"] = set(failed)
            else:
                assert failed_blocks, "vLLM < 0.32 learns of a failed receive from its blocks: pass failed_blocks"
                extra["invalid_block_ids"] = set(failed_blocks)
        kvo = KVConnectorOutput(finished_sending=set(sending or ()), finished_recving=set(recving or ()) | set(failed or ()),
                                kv_connector_worker_meta=worker_meta, **extra)
    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[token] if token is not None else [] for _ in ids], logprobs=None, prompt_logprobs_dict={},
                             pooler_output=None, kv_connector_output=kvo)


def empty_output(**kw: Any) -> ModelRunnerOutput:
    return runner_output([], **kw)


def plan_of(so: Any) -> Any:
    return so.kv_connector_metadata.plan


def scheduled_reqs(sched: Scheduler, so: Any) -> list[Request]:
    ids = list(so.num_scheduled_tokens)
    return [sched.requests[i] for i in ids]


def wait_until(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


def assert_no_leaks(sched: Scheduler) -> None:
    """Nothing left in the scheduler and every block back in the pool."""
    assert not sched.requests, list(sched.requests)
    assert len(sched.waiting) == 0 and len(sched.running) == 0
    pool = sched.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    for b in pool.blocks:
        assert b.ref_cnt == 0


class PrefillWorkers:
    """What a prefill's workers put, from its scheduler's plans: the workers' real PushPlanner, fed as their pusher
    feeds it (the plan's sources and destinations, each layer of the step's forward, the step's end; releases and
    given-up requests are forgotten). ``puts[seq]``: the (source, destination) block pairs of layer 0 in order (like-for-like destinations);
    ``signals[seq]``: how that destination was finished ("layerwise" / "whole"); ``ops``: everything."""

    def __init__(self, layers: int = 2, block_size: int = 16, unlike: dict[str, dict[str, Any]] | None = None) -> None:
        from kvtransport_vllm.pushplan import PushPlanner

        self.layers = layers
        self.planner = PushPlanner([0] * layers, block_size, lambda e: (unlike or {}).get(e))
        self.puts: dict[str, list[tuple[int, int]]] = {}
        self.signals: dict[str, str] = {}
        self.ops: list[Any] = []

    def run(self, plan: Any) -> list[Any]:
        from kvtransport_vllm.pushplan import PutOp

        ops = self.planner.step(plan.sources) if plan.sources else []
        for b in plan.binds:
            ops += self.planner.bind(b)[0]
        for xfer, seq in plan.cancels:
            self.planner.cancel(xfer, seq)
        for rid in plan.dropped:
            self.planner.forget(rid)
        if plan.sources:
            for layer in range(self.layers):
                ops += self.planner.layer(layer)
            ops += self.planner.step_end()
        for rid in plan.send_release:
            self.planner.forget(rid)
        for op in ops:
            if isinstance(op, PutOp):
                if 0 in op.layers and op.push.start < 0:  # like-for-like block pairs (unlike: token ranges)
                    self.puts.setdefault(op.push.seq, []).extend(zip(op.push.src, op.push.dst, strict=True))
            else:
                assert op.push.seq not in self.signals, f"{op.push.seq} signalled twice"
                self.signals[op.push.seq] = op.kind
        self.ops += ops
        return ops


def recorded_prefill_side(extra: dict[str, Any] | None = None, **kw: Any) -> Any:
    """A prefill's scheduler side (engine "P", 16-token blocks, settings from ``kv_connector_extra_config``
    ``extra`` alone: no environment) whose side channel sends nothing: each message to a decode is recorded in
    ``side.sent`` as ``(engine, msg)``, and a send to an engine in ``side.down`` fails (not connected). ``kw`` goes
    to ``SchedulerSide`` (e.g. ``num_groups``). The caller shuts it down."""
    from kvtransport_vllm.config import resolve_settings
    from kvtransport_vllm.scheduler import SchedulerSide

    s = SchedulerSide(settings=resolve_settings(extra or {}, env={}), engine_id="P", block_size=16, producer=True,
                      consumer=False, compat_info=COMPAT_INFO, **kw)
    s.sent = []  # type: ignore[attr-defined]
    s.down = set()  # type: ignore[attr-defined]

    def send(engine: str, msg: dict[str, Any]) -> bool:
        s.sent.append((engine, msg))  # type: ignore[attr-defined]
        return engine not in s.down  # type: ignore[attr-defined]

    s.server.send = send  # type: ignore[union-attr,method-assign]
    return s
