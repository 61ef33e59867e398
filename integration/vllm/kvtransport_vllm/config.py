"""Connector settings: ``kv_connector_extra_config`` > environment > defaults. No vLLM import.

Keys of ``kv_connector_extra_config`` (all optional)::

    backend            kvtransport backend name            (env KV_TRANSPORT, default "auto")
    ifname             interface for side channels and data (env NET_IFNAME, default loopback)
    mode               "push" (layer-wise, default) | "pull"   (what this instance does when it
                       prefills: "pull" never puts from inside the forward, only after it; env
                       KV_TRANSPORT_VLLM_MODE, or the older KVT_VLLM_MODE with a deprecation warning)
    side_channel_port  port of the scheduler's side channel (env KV_TRANSPORT_VLLM_SIDE_CHANNEL_PORT, default 0 =
                       any; the older KVT_VLLM_SIDE_CHANNEL_PORT still works, with a deprecation warning); under
                       data parallelism a base: DP engine r listens on base + r (connector.per_dp_engine)
    bootstrap_port     prefill: serve Mooncake's bootstrap endpoint (GET /query) on this port, for routers that
                       speak Mooncake's kv_transfer_params (vllm-router --kv-connector mooncake, llm-d's sidecar)
                       (env KV_TRANSPORT_VLLM_BOOTSTRAP_PORT, default 0 = none)
    transfer_timeout   seconds a decode request waits for its KV before the failure path (default 120)
    lease              seconds a prefill instance holds blocks for a remote decode (a delay-freed request
                       waiting for its destination, or for being pulled) without hearing from that decode;
                       decode instances renew it every lease/3 while they still want the KV. Expired: the
                       blocks are freed (default 30; ``source_ttl`` is accepted as an older name)
    connect_timeout    seconds for side-channel and transport connects (default 30)
    dst_wait           no longer used: a prefill request never waits for its destination (the workers bind it
                       whenever it comes); accepted, with a warning, so older configurations still start
    admit_below        decode: the fraction of its KV blocks in use below which a push-flow request is
                       allocated as soon as it arrives (default 0.5). Above it, the decode allocates only
                       when the prefill says it is about to compute the request (``ready``), so blocks are
                       not held while requests queue at the prefill. 1 = always at once, 0 = always wait
    secret             shared secret both side channels prove (HMAC), the core's and the scheduler's
                       (``backend_options.secret``, else env KV_TRANSPORT_SECRET, default none: open)
    allow_open         without a secret the side channels listen on loopback only: an interface beyond it
                       (NET_IFNAME) is refused at start-up unless this is true (env KV_TRANSPORT_ALLOW_OPEN=1):
                       anyone who reaches the port could then claim an engine id, send destinations or cancel
                       (default false)
    model_id           model identity for the compatibility hash (default: basename of the model path)
    backend_options    dict handed to kvtransport.open (capacity, timeout, backend knobs)
    debug_push_delay   test-only: seconds the prefill worker holds back the final signal of a request whose
                       prefill-leg kv_transfer_params carry ``kvt_debug_delay: true``; other requests are
                       served meanwhile (default 0)
    debug_dst_delay    test-only: seconds a decode instance holds back the destination blocks of a request whose
                       decode-leg kv_transfer_params carry ``kvt_debug_late: true`` (a late decode: the prefill
                       computes without them, and binds them whenever they come; default 0)
    debug_hold         test-only: a decode instance with ``debug_hold: true`` never admits a request whose
                       decode-leg kv_transfer_params carry ``kvt_debug_hold: true``: it stays waiting,
                       unallocated (as if the decode had no room for it) and keeps renewing its lease on the
                       prefill, until it is aborted or the instance dies (default false)
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtransport.config import read_env

MODES = ("push", "pull")
log = logging.getLogger("vllm.kvtransport")


@dataclass(frozen=True)
class ConnectorSettings:
    """Resolved connector settings (see module docstring)."""

    backend: str = "auto"
    ifname: str | None = None
    mode: str = "push"
    side_channel_port: int = 0
    bootstrap_port: int = 0
    transfer_timeout: float = 120.0
    lease: float = 30.0
    connect_timeout: float = 30.0
    admit_below: float = 0.5
    model_id: str | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    debug_push_delay: float = 0.0
    debug_dst_delay: float = 0.0
    debug_hold: bool = False
    secret: bytes | None = field(default=None, repr=False)
    allow_open: bool = False

    @property
    def source_ttl(self) -> float:
        """Older name of :attr:`lease`."""
        return self.lease

    @property
    def address(self) -> str:
        """The IPv4 address of ``ifname`` (loopback when unset) the side channels listen on. Raises
        InterfaceNotFound, or ConfigurationError for an address beyond loopback without a secret (unless
        ``allow_open``)."""
        if not self.ifname:
            return "127.0.0.1"
        import ipaddress

        from kvtransport.config import interface_address
        from kvtransport.errors import ConfigurationError

        address = str(interface_address(self.ifname))
        if self.secret is None and not self.allow_open and not ipaddress.ip_address(address).is_loopback:
            raise ConfigurationError(
                f"NET_IFNAME={self.ifname} ({address}) is beyond loopback and no secret is set: anyone who reaches "
                "the side channel could claim an engine id or send destinations; fix: set KV_TRANSPORT_SECRET "
                "(the same on every instance), or KV_TRANSPORT_ALLOW_OPEN=1 (extra config allow_open: true) on a "
                "network you trust")
        return address


def resolve_settings(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> ConnectorSettings:
    """Build settings from ``kv_connector_extra_config`` and the environment. Raises ValueError for bad values."""
    extra = dict(extra or {})
    env = os.environ if env is None else env
    mode = str(extra.get("mode") or read_env("KV_TRANSPORT_VLLM_MODE", deprecated=("KVT_VLLM_MODE",), env=env)
               or "push").strip().lower()
    if mode not in MODES:
        raise ValueError(f"kv_connector_extra_config.mode={mode!r}: choose one of {MODES}")
    def _port(key: str, env_name: str, deprecated: tuple[str, ...], zero: str) -> int:
        raw = extra.get(key)
        if raw is None:
            raw = read_env(env_name, deprecated=deprecated, env=env) or 0
        try:
            value = int(str(raw).strip()) if not isinstance(raw, bool) else -1
        except ValueError:
            value = -1
        if not 0 <= value <= 65535:
            raise ValueError(f"{key} must be a port number 0..65535 (0: {zero}), got {raw!r}")
        return value

    port = _port("side_channel_port", "KV_TRANSPORT_VLLM_SIDE_CHANNEL_PORT", ("KVT_VLLM_SIDE_CHANNEL_PORT",),
                 "any free port")
    bootstrap_port = _port("bootstrap_port", "KV_TRANSPORT_VLLM_BOOTSTRAP_PORT", (), "no bootstrap endpoint")
    opts = extra.get("backend_options", {})
    if not isinstance(opts, Mapping):
        raise ValueError("kv_connector_extra_config.backend_options must be a JSON object")

    def _finite(key: str, default: float) -> float:
        raw = extra.get(key, default)
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"kv_connector_extra_config.{key} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"kv_connector_extra_config.{key} must be finite, got {raw!r}")
        return value

    def _num(key: str, default: float) -> float:
        value = _finite(key, default)
        if not value > 0:
            raise ValueError(f"kv_connector_extra_config.{key} must be > 0, got {value}")
        return value

    if "dst_wait" in extra:
        _finite("dst_wait", 0.0)  # still refused when not a number, as before
        log.warning("kv_connector_extra_config.dst_wait is no longer used: a prefill request never waits for its "
                    "destination (its workers bind it whenever it comes); remove it")
    return ConnectorSettings(
        backend=str(extra.get("backend") or env.get("KV_TRANSPORT") or "auto").lower(),
        ifname=(extra.get("ifname") or env.get("NET_IFNAME") or None),
        mode=mode,
        side_channel_port=port,
        bootstrap_port=bootstrap_port,
        transfer_timeout=_num("transfer_timeout", 120.0),
        lease=_num("lease", float(extra.get("source_ttl", 30.0))),
        connect_timeout=_num("connect_timeout", 30.0),
        admit_below=min(1.0, max(0.0, _finite("admit_below", 0.5))),
        model_id=extra.get("model_id"),
        backend_options=dict(opts),
        debug_push_delay=max(0.0, _finite("debug_push_delay", 0.0)),
        debug_dst_delay=max(0.0, _finite("debug_dst_delay", 0.0)),
        debug_hold=extra.get("debug_hold", False) is True,
        secret=_secret(opts.get("secret"), env),
        allow_open=extra.get("allow_open") is True
        or str(env.get("KV_TRANSPORT_ALLOW_OPEN", "")).strip().lower() in ("1", "true", "yes"),
    )


def _secret(option: Any, env: Mapping[str, str]) -> bytes | None:
    """The kvtransport core's rule: ``backend_options.secret``, else KV_TRANSPORT_SECRET; empty means none."""
    raw = option if option is not None else env.get("KV_TRANSPORT_SECRET")
    if not raw:
        return None
    return raw.encode() if isinstance(raw, str) else bytes(raw)


def requires_layerwise(extra: Mapping[str, Any] | None, role: str | None = None) -> bool:
    """Whether an instance with this extra config and ``kv_role`` puts from ``save_kv_layer``: a producer (or
    kv_both, or an unknown role) in push mode. A ``kv_consumer`` never does."""
    if role == "kv_consumer":
        return False
    try:
        return resolve_settings(extra).mode == "push"
    except ValueError:
        return True


def startup_problem(extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None) -> str | None:
    """What would stop the connector of an instance with this ``kv_connector_extra_config`` (and environment),
    found without loading any model: a bad setting, an unknown or unusable backend (``KV_TRANSPORT``), an
    interface that is not there (``NET_IFNAME``); one line naming it and its fix, or None. Probes the chosen
    backend (imports it)."""
    from kvtransport import registry
    from kvtransport.errors import KVTransportError

    def line(exc: KVTransportError) -> str:
        fix = getattr(exc, "fix", None)
        return f"{type(exc).__name__}: {exc}" + (f"; fix: {fix}" if fix else "")

    try:
        settings = resolve_settings(extra, env)
    except ValueError as exc:
        return f"ConfigurationError: {exc}"
    if settings.backend != "auto":
        try:
            registry.get_spec(settings.backend)
        except KVTransportError as exc:
            return line(exc)
        found = registry.probe(settings.backend)
        if not found.ok:
            return (f"BackendUnavailable: KV_TRANSPORT={settings.backend} cannot run here: {found.reason}; fix: "
                    "`kvtransport backends` lists the usable ones")
    try:
        settings.address  # noqa: B018 (resolves NET_IFNAME; raises when it is not there)
    except KVTransportError as exc:
        return line(exc)
    return None

