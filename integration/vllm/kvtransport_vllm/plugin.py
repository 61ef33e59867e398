"""The ``vllm.general_plugins`` entry point: registers ``KVTransportConnector`` with vLLM's factory.

vLLM loads general plugins once per process (API server, engine core, each worker), and the factory raises
when a name is registered twice, so :func:`register` is idempotent and tolerant of an existing entry.
"""

from __future__ import annotations

import logging
import threading

from . import CONNECTOR_MODULE, CONNECTOR_NAME

log = logging.getLogger("vllm.kvtransport")
_lock = threading.Lock()


def register() -> bool:
    """Register the connector name; returns True if this call registered it. Never raises for a repeat."""
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
