"""Mooncake's bootstrap endpoint, for the routers that speak its shape (vllm-router ``--kv-connector mooncake``,
llm-d's routing sidecar): ``GET /query`` on the prefill's ``bootstrap_port`` answers which engine serves each
data-parallel rank, as vLLM's MooncakeConnector does (``{dp_rank: {"engine_id", "worker_addr": {tp: {pp: addr}}}}``).

The router hands the engine id it read there to the decode as ``remote_engine_id``, with a ``transfer_id`` and the
``remote_bootstrap_addr``; ours carries the prefill's side-channel address (``<engine id>@<host>:<port>``), so a
decode finds the side channel from the request alone (:func:`.metadata.side_channel_of`) and the push flow runs
under such a router unchanged.

Runs the project's HTTP/1.1 server (:mod:`.http11`: bounded heads and bodies, no thread per connection) on an
event loop of its own, in a daemon thread of the prefill's engine-core process. Nothing else is served (404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import http11

log = logging.getLogger("vllm.kvtransport")

START_TIMEOUT_S = 10.0


def query_answer(engine_id: str, host: str, port: int, dp_rank: int = 0) -> dict[str, Any]:
    """The ``/query`` answer of a prefill engine whose side channel is at ``host:port``."""
    return {str(dp_rank): {"engine_id": f"{engine_id}@{host}:{port}", "worker_addr": {"0": {"0": f"{host}:{port}"}}}}


class BootstrapServer:
    """``GET /query`` on ``(host, port)`` answering ``answer()``. Constructed by the prefill's scheduler side;
    raises OSError (the port is taken, say) or TimeoutError when it cannot start within START_TIMEOUT_S."""

    def __init__(self, host: str, port: int, answer: Callable[[], dict[str, Any]]) -> None:
        self._answer = answer
        self._loop = asyncio.new_event_loop()
        self._server = http11.Server(self._handle, max_body_bytes=64 << 10)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, port), name="kvt-bootstrap", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError(f"the bootstrap endpoint on {host}:{port} did not start in {START_TIMEOUT_S:g}s")
        if self._error is not None:
            raise self._error
        self.host, self.port = host, self._server.port

    def _run(self, host: str, port: int) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._server.start(host, port))
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    async def _handle(self, request: http11.Request, reply: http11.Reply) -> None:
        if request.method == "GET" and request.path == "/query":
            reply.send(200, json.dumps(self._answer()).encode(), "application/json")
        else:
            reply.send(404, b'{"error": "not found: this endpoint serves GET /query only"}', "application/json")

    def close(self) -> None:
        if not self._loop.is_running():
            return
        fut = asyncio.run_coroutine_threadsafe(self._server.aclose(), self._loop)
        try:
            fut.result(5)
        except Exception as exc:  # closing anyway
            log.debug("kvtransport bootstrap endpoint: close: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
