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
            "lease_expirations", "decode_disconnects", "prefill_disconnects", "first_tokens_sent",
            "first_tokens_received", "dst_bound_before", "dst_bound_during", "dst_bound_after")
TIMINGS = ("transfer_times",)
"""Lists of seconds: decode blocks held from allocation until the KV landed."""
GAUGES = ("recv_unallocated", "recv_in_progress")
"""Decode scheduler, current values (sent when they change): P/D requests that arrived but have no blocks yet
(waiting for admission), and requests whose blocks are allocated and wait for their KV."""


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
        for k in TIMINGS:
            if od.get(k):
                self.data[k] = list(self.data.get(k, [])) + list(od[k])
        for k in ("backend", "paths"):
            if od.get(k):
                self.data[k] = sorted(set(self.data.get(k, [])) | set(od[k]))
        for k in GAUGES:  # the later value wins
            if k in od:
                self.data[k] = int(od[k])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: int(self.data.get(k, 0)) for k in COUNTERS}
        out.update({k: int(self.data[k]) for k in GAUGES if k in self.data})
        for key, name in (("transfer_times", "transfer"),):
            times = self.data.get(key) or []
            if times:
                out[f"avg_{name}_ms"] = round(1000 * sum(times) / len(times), 3)
                out[f"max_{name}_ms"] = round(1000 * max(times), 3)
        return out

    def is_empty(self) -> bool:
        return (not any(int(self.data.get(k, 0)) for k in COUNTERS) and not any(self.data.get(k) for k in TIMINGS)
                and not any(k in self.data for k in GAUGES))


class KVTransportPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtransport_*`` counters, gauges and a histogram (transfer time), per engine."""

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
            "dst_bound_before": "prefill: destinations bound before their request's first layer was computed",
            "dst_bound_during": "prefill: destinations bound while their request was computed (what was computed went "
                                "in one batched put, the rest layer by layer)",
            "dst_bound_after": "prefill: destinations bound after their request's prompt was computed (one put)",
            "first_tokens_sent": "prefill: first tokens sent to a decode instance (the client got them from here)",
            "first_tokens_received": "decode: requests continued from the first token their prefill sampled",
        }
        self.counters: dict[str, dict[int, Any]] = {}
        for key, doc in docs.items():
            c = self._counter_cls(name=f"vllm:kvtransport_{key}", documentation=doc, labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(c, self.per_engine_labelvalues)
        self.gauges: dict[str, dict[int, Any]] = {}
        for key, doc in (("recv_unallocated", "decode: P/D requests waiting for admission (no blocks allocated yet)"),
                         ("recv_in_progress", "decode: P/D requests with allocated blocks waiting for their KV")):
            g = self._gauge_cls(name=f"vllm:kvtransport_{key}", documentation=doc, multiprocess_mode="mostrecent",
                                labelnames=labelnames)
            self.gauges[key] = create_metric_per_engine(g, self.per_engine_labelvalues)
        buckets = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        self.hists: dict[str, dict[int, Any]] = {}
        for key, name, doc in (
            ("transfer_times", "transfer_seconds",
             "Time a decode request's blocks were held: from their allocation until its KV landed"),
        ):
            h = self._histogram_cls(  # type: ignore[call-arg]
                name=f"vllm:kvtransport_{name}", documentation=doc, buckets=buckets, labelnames=labelnames)
            self.hists[key] = create_metric_per_engine(h, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.counters.items():
            v = int(transfer_stats_data.get(key, 0) or 0)
            if v > 0:
                per_engine[engine_idx].inc(v)
        for key, per_engine in self.gauges.items():
            if key in transfer_stats_data:
                per_engine[engine_idx].set(int(transfer_stats_data[key]))
        for key, per_engine in self.hists.items():
            for t in transfer_stats_data.get(key) or []:
                per_engine[engine_idx].observe(t)
