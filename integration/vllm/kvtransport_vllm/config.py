"""Connector settings: ``kv_connector_extra_config`` > environment > defaults. No vLLM import.

Keys of ``kv_connector_extra_config`` (all optional)::

    backend            kvtransport backend name            (env KV_TRANSPORT, default "auto")
    ifname             interface for side channels and data (env NET_IFNAME, default loopback)
    mode               "push" (layer-wise, default) | "pull"   (what this instance does when it
                       prefills: "pull" never puts from inside the forward, only after it)
    side_channel_port  port of the scheduler's side channel (env KVT_VLLM_SIDE_CHANNEL_PORT, default 0 = any)
    transfer_timeout   seconds a decode request waits for its KV before the failure path (default 120)
    lease              seconds a prefill instance holds blocks for a remote decode (a delay-freed request
                       waiting for its destination, or for being pulled) without hearing from that decode;
                       decode instances renew it every lease/3 while they still want the KV. Expired: the
                       blocks are freed (default 30; ``source_ttl`` is accepted as an older name)
    connect_timeout    seconds for side-channel and transport connects (default 30)
    dst_wait           seconds a prefill request of the push flow may wait for its destination blocks
                       before it is scheduled anyway (default 0: never delay prefill; the push then
                       happens after the forward when the destination comes late)
    model_id           model identity for the compatibility hash (default: basename of the model path)
    backend_options    dict handed to kvtransport.open (capacity, timeout, backend knobs)
    debug_push_delay   test-only: seconds the prefill worker holds back the final signal of a request whose
                       prefill-leg kv_transfer_params carry ``kvt_debug_delay: true``; other requests are
                       served meanwhile (default 0)
    debug_hold         test-only: a decode instance with ``debug_hold: true`` never admits a request whose
                       decode-leg kv_transfer_params carry ``kvt_debug_hold: true``: it stays waiting,
                       unallocated (as if the decode had no room for it) and keeps renewing its lease on the
                       prefill, until it is aborted or the instance dies (default false)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODES = ("push", "pull")


@dataclass(frozen=True)
class ConnectorSettings:
    """Resolved connector settings (see module docstring)."""

    backend: str = "auto"
    ifname: str | None = None
    mode: str = "push"
    side_channel_port: int = 0
    transfer_timeout: float = 120.0
    lease: float = 30.0
    connect_timeout: float = 30.0
    dst_wait: float = 0.0
    model_id: str | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    debug_push_delay: float = 0.0
    debug_hold: bool = False

    @property
    def source_ttl(self) -> float:
        """Older name of :attr:`lease`."""
        return self.lease

    @property
    def address(self) -> str:
        """The IPv4 address of ``ifname`` (loopback when unset). Raises InterfaceNotFound."""
        if not self.ifname:
            return "127.0.0.1"
        from kvtransport.config import interface_address

        return str(interface_address(self.ifname))


def resolve_settings(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorSettings:
    """Build settings from ``kv_connector_extra_config`` and the environment. Raises ValueError for bad values."""
    extra = dict(extra or {})
    env = os.environ if env is None else env
    mode = str(extra.get("mode", env.get("KVT_VLLM_MODE", "push"))).lower()
    if mode not in MODES:
        raise ValueError(f"kv_connector_extra_config.mode={mode!r}: choose one of {MODES}")
    port = extra.get("side_channel_port", env.get("KVT_VLLM_SIDE_CHANNEL_PORT", 0))
    opts = extra.get("backend_options", {})
    if not isinstance(opts, Mapping):
        raise ValueError("kv_connector_extra_config.backend_options must be a JSON object")

    def _num(key: str, default: float) -> float:
        value = float(extra.get(key, default))
        if not value > 0:
            raise ValueError(f"kv_connector_extra_config.{key} must be > 0, got {value}")
        return value

    return ConnectorSettings(
        backend=str(extra.get("backend") or env.get("KV_TRANSPORT") or "auto").lower(),
        ifname=(extra.get("ifname") or env.get("NET_IFNAME") or None),
        mode=mode,
        side_channel_port=int(port),
        transfer_timeout=_num("transfer_timeout", 120.0),
        lease=_num("lease", float(extra.get("source_ttl", 30.0))),
        connect_timeout=_num("connect_timeout", 30.0),
        dst_wait=max(0.0, float(extra.get("dst_wait", 0.0))),
        model_id=extra.get("model_id"),
        backend_options=dict(opts),
        debug_push_delay=max(0.0, float(extra.get("debug_push_delay", 0.0))),
        debug_hold=extra.get("debug_hold", False) is True,
    )


def requires_layerwise(extra: Mapping[str, Any] | None) -> bool:
    """Whether an instance with this extra config puts from ``save_kv_layer`` (push mode)."""
    try:
        return resolve_settings(extra).mode == "push"
    except ValueError:
        return True
