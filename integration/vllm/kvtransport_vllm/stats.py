"""Connector stats (``get_kv_connector_stats``) and Prometheus metrics (``build_prom_metrics``)."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = ("bytes_sent", "bytes_received", "puts", "puts_received", "failures", "transfers_sent",
            "transfers_layerwise", "transfers_whole", "transfers_received", "transfer_failures",
            "lease_expirations", "decode_disconnects", "prefill_disconnects")


class KVTransportStats(KVConnectorStats):
    """Per-interval counters from every worker (bytes, puts, transfers, transfer times, failures, backend,
    paths) and from the scheduler (lease expirations, lost peers).

    ``data`` holds ints for COUNTERS, ``transfer_times`` (seconds, one per landed request), and ``backend`` /
    ``paths`` (lists of names). Aggregation sums counters and unions the names.
    """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        od = other.data or {}
        for k in COUNTERS:
            if k in od:
                self.data[k] = int(self.data.get(k, 0)) + int(od[k])
        if od.get("transfer_times"):
            self.data["transfer_times"] = list(self.data.get("transfer_times", [])) + list(od["transfer_times"])
        for k in ("backend", "paths"):
            if od.get(k):
                self.data[k] = sorted(set(self.data.get(k, [])) | set(od[k]))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in COUNTERS}
        times = self.data.get("transfer_times") or []
        if times:
            out["avg_transfer_ms"] = round(1000 * sum(times) / len(times), 3)
            out["max_transfer_ms"] = round(1000 * max(times), 3)
        return out

    def is_empty(self) -> bool:
        return not any(int(self.data.get(k, 0)) for k in COUNTERS) and not self.data.get("transfer_times")


class KVTransportPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtransport_*`` counters and a transfer-time histogram, per engine."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        docs = {
            "bytes_sent": "KV bytes put to decode instances",
            "bytes_received": "KV bytes received from prefill instances",
            "puts": "layer puts issued",
            "puts_received": "layer puts received",
            "failures": "transport-level failures (NACKs, lost peers)",
            "transfers_sent": "requests whose KV was fully sent",
            "transfers_layerwise": "requests sent layer by layer during the prefill forward",
            "transfers_whole": "requests sent after the forward (destination known late, or pull)",
            "transfers_received": "requests whose KV fully landed",
            "transfer_failures": "requests whose KV transfer failed or timed out",
            "lease_expirations": "prefill requests whose held blocks were freed after the lease expired",
            "decode_disconnects": "prefill requests given up because their decode's side channel went away",
            "prefill_disconnects": "decode requests failed because their prefill's side channel went away",
        }
        self.counters: dict[str, dict[int, Any]] = {}
        for key, doc in docs.items():
            c = self._counter_cls(name=f"vllm:kvtransport_{key}", documentation=doc, labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(c, self.per_engine_labelvalues)
        h = self._histogram_cls(  # type: ignore[call-arg]
            name="vllm:kvtransport_transfer_seconds",
            documentation="Time from a decode request's allocation to its KV having landed",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
            labelnames=labelnames,
        )
        self.hist = create_metric_per_engine(h, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = int(transfer_stats_data.get(key, 0) or 0)
            if v > 0:
                per_engine[engine_idx].inc(v)
        for t in transfer_stats_data.get("transfer_times") or []:
            self.hist[engine_idx].observe(t)  # type: ignore[union-attr]
