"""kvtransport for vLLM: ``KVTransportConnector`` (layer-wise push and pull P/D transfer) and a P/D proxy.

Importing this package does not import vLLM; ``kvtransport_vllm.connector`` does.
"""

from __future__ import annotations

__version__ = "0.1.0"

CONNECTOR_NAME = "KVTransportConnector"
CONNECTOR_MODULE = "kvtransport_vllm.connector"

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "__version__"]
