"""The ``vllm.general_plugins`` entry point: registers ``KVTransportConnector`` with vLLM's factory.

vLLM loads general plugins once per process (API server, engine core, each worker), and the factory raises
when a name is registered twice, so :func:`register` is idempotent and tolerant of an existing entry.

It also fails fast: in the process started with ``--kv-transfer-config`` naming this connector (``vllm serve``'s
API server, which loads plugins before it parses its arguments and long before any model is loaded), a setting
the connector would refuse — an unknown or unusable ``KV_TRANSPORT``, a ``NET_IFNAME`` that is not there, a bad
``kv_connector_extra_config`` value — stops the process at once with one line on stderr (exit status 2),
instead of after the model load and compilation (92.5 s on the H200 host).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from . import CONNECTOR_MODULE, CONNECTOR_NAME

log = logging.getLogger("vllm.kvtransport")
_lock = threading.Lock()
_checked = False


def our_extra_config(argv: Sequence[str]) -> dict[str, Any] | None:
    """The ``kv_connector_extra_config`` of a ``--kv-transfer-config`` in ``argv`` that names this connector
    (``{}`` when it has none); None when ``argv`` carries no such config (another connector, none, or JSON vLLM
    will refuse itself)."""
    raw = None
    for i, arg in enumerate(argv):
        for flag in ("--kv-transfer-config", "--kv_transfer_config"):
            if arg == flag and i + 1 < len(argv):
                raw = argv[i + 1]
            elif arg.startswith(flag + "="):
                raw = arg[len(flag) + 1:]
    if raw is None:
        return None
    try:
        cfg = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(cfg, dict):
        return None
    ours = cfg.get("kv_connector") == CONNECTOR_NAME or str(cfg.get("kv_connector_module_path") or "").startswith(
        "kvtransport_vllm")
    extra = cfg.get("kv_connector_extra_config") or {}
    return dict(extra) if ours and isinstance(extra, dict) else None


def fail_fast(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Raise SystemExit(2) with one line on stderr when ``argv`` starts this connector with a setting it would
    refuse (see the module docstring); nothing otherwise."""
    extra = our_extra_config(argv)
    if extra is None:
        return
    from .config import startup_problem

    problem = startup_problem(extra, env)
    if problem is not None:
        print(f"kvtransport-vllm: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def register() -> bool:
    """Register the connector name; returns True if this call registered it. Never raises for a repeat; raises
    SystemExit (see :func:`fail_fast`) in a process started with a configuration the connector would refuse."""
    global _checked
    if not _checked:
        _checked = True
        fail_fast(sys.argv, os.environ)
    from . import frontend, primer

    frontend.install()  # bad kv_transfer_params: HTTP 400 from the API server (kvtransport_vllm.frontend)
    primer.install()  # P/D requests' detokenizers primed while they wait (kvtransport_vllm.primer)
    with _lock:
        try:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        except ImportError as exc:  # vLLM missing or broken: nothing to register into
            log.debug("kvtransport-vllm plugin: vLLM not importable (%s)", exc)
            return False
        if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
            return False
        try:
            KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
        except ValueError:  # registered concurrently / by another path
            return False
        return True
