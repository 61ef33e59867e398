"""``KVTransportConnector``: vLLM's KVConnectorBase_V1 over kvtransport. Dispatches to one role object.

Select it with ``--kv-transfer-config '{"kv_connector":"KVTransportConnector","kv_role":"kv_producer"}'``
(registered by the ``vllm.general_plugins`` entry point) or, without the plugin, add
``"kv_connector_module_path":"kvtransport_vllm.connector"``. Prefill instances are ``kv_producer``, decode
instances ``kv_consumer``. Backend from ``KV_TRANSPORT``, interface from ``NET_IFNAME``, both overridable in
``kv_connector_extra_config`` (see :mod:`kvtransport_vllm.config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger

from . import __version__
from .compat import (
    P2P_CACHE_HIT_SOURCE,
    REPORTS_FAILED_RECVING,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    role_of_extra_config,
)
from .config import ConnectorSettings, requires_layerwise, resolve_settings
from .metadata import SendFailure, StepPlan
from .scheduler import SchedulerSide
from .stats import KVTransportPromMetrics, KVTransportStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KVTransportMetadata(KVConnectorMetadata):
    """Scheduler -> worker data of one step (wraps :class:`StepPlan`)."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


@dataclass
class KVTransportHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler data after KV cache registration: kvtransport metadata and compatibility fields."""

    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class KVTransportWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler data of one step: pushes that failed (the decode side must hear of them)."""

    failures: list[SendFailure] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVTransportWorkerMeta):
            self.failures.extend(other.failures)
        return self


def _cpu_attention() -> bool:
    """Whether this worker's attention is vLLM's CPU backend (it lays out block interiors its own way)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:
        return False


PP_UNSUPPORTED = ("KVTransportConnector does not support pipeline parallelism (pipeline_parallel_size={pp}): "
                  "run the prefill and decode instances with pipeline_parallel_size=1 (their tensor_parallel_size "
                  "may differ)")


CP_UNSUPPORTED = ("KVTransportConnector does not support context parallelism ({name}={size}): each worker's KV "
                  "cache would hold only part of every sequence; run the prefill and decode instances with "
                  "{name}=1 (their tensor_parallel_size may differ)")


DP_BOOTSTRAP_UNSUPPORTED = (
    "KVTransportConnector's bootstrap endpoint (bootstrap_port={port}) maps DP ranks to engines for a router that "
    "pins its prefill legs with X-data-parallel-rank through vLLM's internal load balancer; this instance balances "
    "with --data-parallel-hybrid-lb or --data-parallel-external-lb, where a dense model's engine cannot tell its "
    "index: run the prefill with the internal balancer (the default) behind such a router, or leave bootstrap_port "
    "unset (kvtransport-proxy or the NIXL shape)")


def dp_position(vllm_config: VllmConfig, engine_id: str = "") -> tuple[int, int]:
    """(index, size) of this data-parallel engine: its DP rank, and how many engines there are; size 1: no data
    parallelism; size 0: one of several, how many unknown. vLLM runs a dense model's DP engines as independent
    DP=1 engines (``data_parallel_size`` reset to 1, ``data_parallel_rank`` to 0) and keeps the rank only in
    ``data_parallel_index``; it also appends ``_dp<rank>`` to each DP engine's KV engine id, which tells rank 0
    of several from no data parallelism. A MoE model's engines keep both. Never raises."""
    pc = vllm_config.parallel_config
    try:
        size = int(getattr(pc, "data_parallel_size", 1) or 1)
        rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
        index = getattr(pc, "data_parallel_index", None)
        index = rank if index is None else int(index)
    except (TypeError, ValueError):
        return 0, 1
    if size > 1:
        return index, size
    if index > 0 or engine_id.endswith(f"_dp{index}"):
        return index, 0
    return 0, 1


def per_dp_engine(settings: ConnectorSettings, vllm_config: VllmConfig, engine_id: str = "") -> ConnectorSettings:
    """``settings`` for this data-parallel engine: a fixed side-channel port is the base, each DP engine listens
    on base + its DP rank (two engines of one instance on one host would collide on the base). Raises
    ValueError for a bootstrap endpoint under a DP balancer it cannot serve (see DP_BOOTSTRAP_UNSUPPORTED)."""
    import dataclasses

    index, size = dp_position(vllm_config, engine_id)
    if size != 1 and settings.bootstrap_port and dp_route(vllm_config, engine_id)[1] == 1:
        raise ValueError(DP_BOOTSTRAP_UNSUPPORTED.format(port=settings.bootstrap_port))
    if not settings.side_channel_port or not index:
        return settings
    port = settings.side_channel_port + index
    if port > 65535:
        raise ValueError(f"side_channel_port={settings.side_channel_port} + data-parallel rank {index} is past "
                         "65535: choose a lower side_channel_port (each DP engine listens on base + its rank)")
    return dataclasses.replace(settings, side_channel_port=port)


def dp_route(vllm_config: VllmConfig, engine_id: str = "") -> tuple[int, int]:
    """(index, count) told to a proxy's discovery request: the ``X-data-parallel-rank`` value that routes a
    request to this DP engine through the API server in front of it, and how many engines that API server routes
    among (0: several, how many unknown: the proxy asks for each index until the API server refuses one; 1: no
    header needed). vLLM's internal load balancer fronts every rank (index = the DP rank). The hybrid and
    external ones front the node's local engines: a known local count gives the rank among them (contiguous per
    node); otherwise (1 engine per API server, or a dense model whose count the engine cannot see) (0, 1): no
    pinning. Never raises."""
    index, size = dp_position(vllm_config, engine_id)
    if size == 1:
        return 0, 1
    pc = vllm_config.parallel_config
    if bool(getattr(pc, "local_engines_only", False)):
        local = int(getattr(pc, "data_parallel_size_local", 1) or 1)
        return (index % local, local) if size > 1 and local > 1 else (0, 1)
    return index, size


def check_parallel(vllm_config: VllmConfig) -> None:
    """Refuse what the connector cannot serve, at start-up, with our own message (ValueError): pipeline
    parallelism, decode and prefill context parallelism."""
    pc = vllm_config.parallel_config
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ValueError(PP_UNSUPPORTED.format(pp=pp))
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = int(getattr(pc, name, 1) or 1)
        if size > 1:
            raise ValueError(CP_UNSUPPORTED.format(name=name, size=size))


def _compat_fields(vllm_config: VllmConfig, model_id: str | None) -> dict[str, Any]:
    """What must be equal on both sides (hashed; a peer that differs is refused, told which fields differ). TP
    size, block size and the head order may differ: the workers map them (:mod:`kvtransport.reshard`)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    info: dict[str, Any] = {"connector": __version__, "cache_dtype": str(cc.cache_dtype)}
    if mc is not None:
        info.update(
            model=model_id or str(mc.model).rstrip("/").split("/")[-1],
            architectures=list(getattr(mc.hf_config, "architectures", None) or []),
            dtype=str(mc.dtype).removeprefix("torch."),
            num_layers=mc.get_num_layers(pc),
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_size=mc.get_head_size(),
        )
    return info


SUPPORTED_GROUPS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")
"""KV cache group kinds whose blocks the connector moves (exact class names). MLA's latent cache (one
``kv_lora_rank + rope`` vector per token, no heads, the same on every TP rank) moves as whole blocks between
instances of one TP size and block size."""


def check_groups(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    """Layer name -> KV cache group, after refusing (ValueError, at start-up) groups the connector cannot move:
    anything but full and sliding-window attention (e.g. Mamba/SSM state), and groups of unlike block sizes."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    out: dict[str, int] = {}
    sizes = set()
    for g, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if kind not in SUPPORTED_GROUPS:
            what = "Mamba/SSM state" if "Mamba" in kind else f"{kind} caches"
            raise ValueError(
                f"KVTransportConnector cannot move KV cache group {g} ({kind}, layers {list(group.layer_names)[:4]}):"
                f" it moves full, sliding-window and MLA attention KV only; {what} is not supported. Serve this model "
                "without disaggregation, or without KVTransportConnector")
        sizes.add(int(spec.block_size))
        for name in group.layer_names:
            out[name] = g
    if len(sizes) > 1:
        raise ValueError(f"KVTransportConnector needs one block size for every KV cache group, got {sorted(sizes)}")
    return out


_BASES: tuple[type, ...] = (KVConnectorBase_V1, SupportsHMA) if SupportsHMA is not None else (KVConnectorBase_V1,)


class KVTransportConnector(*_BASES):  # type: ignore[misc]
    """See the module docstring. vLLM constructs one per role and process."""

    if P2P_CACHE_HIT_SOURCE is not None:  # vLLM 0.32+: decode prompt tokens counted as "p2p" hits
        _cache_hit_source = P2P_CACHE_HIT_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.settings = resolve_settings(ktc.kv_connector_extra_config)
        self.engine_id = str(ktc.engine_id)
        self._sched: SchedulerSide | None = None
        self._worker: Any = None
        self._load_errors: set[int] = set()
        check_parallel(vllm_config)
        self.settings = per_dp_engine(self.settings, vllm_config, self.engine_id)
        layer_groups = check_groups(kv_cache_config)
        num_groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or [None])
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                settings=self.settings, engine_id=self.engine_id, block_size=vllm_config.cache_config.block_size,
                producer=ktc.is_kv_producer, consumer=ktc.is_kv_consumer,
                compat_info=_compat_fields(vllm_config, self.settings.model_id),
                tp_size=vllm_config.parallel_config.tensor_parallel_size, num_groups=num_groups,
                dp_route=dp_route(vllm_config, self.engine_id),
            )
        else:
            from .worker import WorkerSide

            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
            except Exception:  # parallel state not initialised (unit tests)
                rank = 0
            num_blocks = getattr(kv_cache_config, "num_blocks", None) or vllm_config.cache_config.num_gpu_blocks
            mc = vllm_config.model_config
            self._worker = WorkerSide(settings=self.settings, engine_id=self.engine_id, tp_rank=rank,
                                      num_blocks=num_blocks, tp_size=vllm_config.parallel_config.tensor_parallel_size,
                                      num_kv_heads=mc.get_total_num_kv_heads() if mc is not None else None,
                                      cpu_attn=_cpu_attention(), layer_groups=layer_groups,
                                      block_size=vllm_config.cache_config.block_size)

    # ------------------------------------------------------------------ class-level
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True for a producer (or kv_both) in push mode: its puts are issued from ``save_kv_layer``, which a
        full CUDA graph would skip. A decode (``kv_consumer``) never puts, so it keeps full CUDA graphs."""
        return requires_layerwise(extra_config, role_of_extra_config(extra_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """None: any stride permutation works (KVLayout reads strides); both sides must just agree."""
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTransportStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVTransportPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None or self._worker.cm is None:
            return None
        return KVTransportHandshake(self._worker.handshake())

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, KVTransportMetadata):
            self._worker.bind(connector_metadata.plan)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to start: receives are driven by the prefill side; pushes were queued at bind time."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Never blocks: a decode request is only scheduled once all its layers landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    if REPORTS_FAILED_RECVING:  # vLLM 0.32+
        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            r = self._worker.transfer_results()
            return KVConnectorTransferResults(finished_sending=r.finished_sending,
                                              finished_recving=r.finished_recving, failed_recving=r.failed_recving)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM before 0.32 (0.32+ asks :meth:`get_transfer_results`): a failed receive is reported finished
        here and its blocks by :meth:`get_block_ids_with_load_errors` in the same step."""
        r = self._worker.transfer_results()
        if not REPORTS_FAILED_RECVING:
            self._load_errors |= self._worker.blocks_of(r.failed_recving)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        fails = self._worker.take_send_failures() if self._worker is not None else []
        return KVTransportWorkerMeta(fails) if fails else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: transport counters; scheduler: lease expirations and lost peers. None when empty."""
        if self._worker is not None:
            data = self._worker.stats_delta()
        elif self._sched is not None:
            data = self._sched.stats_delta()
        else:
            return None
        stats = KVTransportStats(data=data)
        return None if stats.is_empty() else stats

    # ------------------------------------------------------------------ scheduler side
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        if self._sched is not None:
            self._sched.set_worker_metadata({int(r): m.data for r, m in metadata.items()
                                             if isinstance(m, KVTransportHandshake)})

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._sched is not None:
            self._sched.bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        return KVTransportMetadata(self._sched.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._sched is None:
            return
        meta = connector_output.kv_connector_worker_meta
        fails = meta.failures if isinstance(meta, KVTransportWorkerMeta) else []
        self._sched.update_connector_output(fails, connector_output.finished_recving)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM with the hybrid allocator (SupportsHMA): the request's blocks of every KV cache group."""
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_push_work()

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
