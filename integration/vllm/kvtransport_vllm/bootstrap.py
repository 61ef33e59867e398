"""Mooncake's bootstrap endpoint, for the routers that speak its shape (vllm-router ``--kv-connector mooncake``,
llm-d's routing sidecar): ``GET /query`` on the prefill's ``bootstrap_port`` answers which engine serves each
data-parallel rank, as vLLM's MooncakeConnector does (``{dp_rank: {"engine_id", "worker_addr": {tp: {pp: addr}}}}``).

The router hands the engine id it read there to the decode as ``remote_engine_id``, with a ``transfer_id`` and the
``remote_bootstrap_addr``; ours carries the prefill's side-channel address (``<engine id>@<host>:<port>``), so a
decode finds the side channel from the request alone (:func:`.metadata.side_channel_of`) and the push flow runs
under such a router unchanged.

Runs the project's HTTP/1.1 server (:mod:`.http11`: bounded heads and bodies, no thread per connection) on an
event loop of its own, in a daemon thread of the prefill's engine-core process. Nothing else is served (404).

Data parallelism (vLLM's internal load balancer: every DP engine of the instance on this host): DP engine 0
serves the endpoint for all of them. The others register in a directory of this host's temporary space named
after the instance's engine id (:class:`DPRegistry`: one small JSON file per engine, written atomically, private
to the user, removed at shutdown, ignored once its process is gone), and ``/query`` answers every registered
rank, so a router pins each prefill leg with ``X-data-parallel-rank`` and gives its decode that engine's side
channel. No network face is added for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import http11

log = logging.getLogger("vllm.kvtransport")

START_TIMEOUT_S = 10.0


def query_answer(engine_id: str, host: str, port: int, dp_rank: int = 0) -> dict[str, Any]:
    """The ``/query`` answer of a prefill engine whose side channel is at ``host:port``."""
    return {str(dp_rank): {"engine_id": f"{engine_id}@{host}:{port}", "worker_addr": {"0": {"0": f"{host}:{port}"}}}}


MAX_DP_ENTRIES = 1024
"""DP engines one ``/query`` answer lists (more files in the directory are ignored)."""
MAX_ENTRY_BYTES = 4096
_DP_SUFFIX = re.compile(r"_dp\d+$")


def instance_of(engine_id: str) -> str:
    """The instance's engine id: a DP engine's without vLLM's ``_dp<rank>`` suffix."""
    return _DP_SUFFIX.sub("", engine_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to trust
        return False
    return True


class DPRegistry:
    """The DP engines of one instance on this host, as files ``<rank>.json`` in a directory (mode 0700) named
    after the instance's engine id. Who calls: each DP engine's scheduler side (``register`` at start-up,
    ``remove`` at shutdown); DP engine 0's bootstrap endpoint (``entries`` per ``/query``). Nothing blocks;
    nothing raises but ``register`` (OSError)."""

    def __init__(self, engine_id: str, root: str | None = None) -> None:
        digest = hashlib.sha256(instance_of(engine_id).encode()).hexdigest()[:24]
        self.dir = Path(root or tempfile.gettempdir()) / f"kvtransport-dp-{os.getuid()}-{digest}"
        self._mine: Path | None = None

    def register(self, rank: int, engine_id: str, host: str, port: int) -> None:
        """File this engine (DP ``rank``, its side channel at ``host:port``). Raises OSError."""
        self.dir.mkdir(mode=0o700, exist_ok=True)
        if self.dir.stat().st_uid != os.getuid():
            raise PermissionError(f"{self.dir} belongs to another user")
        path = self.dir / f"{rank}.json"
        tmp = self.dir / f".{rank}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"rank": rank, "engine_id": engine_id, "host": host, "port": port,
                                   "pid": os.getpid()}))
        os.replace(tmp, path)
        self._mine = path

    def remove(self) -> None:
        if self._mine is not None:
            try:
                self._mine.unlink()
            except OSError:
                pass
            self._mine = None

    def entries(self) -> dict[int, dict[str, Any]]:
        """rank -> {engine_id, host, port} of the engines filed whose process is alive; unreadable or
        malformed files are skipped."""
        out: dict[int, dict[str, Any]] = {}
        try:
            names = sorted(os.listdir(self.dir))[:MAX_DP_ENTRIES]
        except OSError:
            return out
        for name in names:
            if not name.endswith(".json"):
                continue
            try:
                with open(self.dir / name, "rb") as fh:
                    raw = fh.read(MAX_ENTRY_BYTES + 1)
                e = json.loads(raw) if len(raw) <= MAX_ENTRY_BYTES else None
            except (OSError, ValueError):
                continue
            if not isinstance(e, dict):
                continue
            rank, engine, host, port, pid = (e.get(k) for k in ("rank", "engine_id", "host", "port", "pid"))
            if (type(rank) is int and 0 <= rank < MAX_DP_ENTRIES and isinstance(engine, str) and isinstance(host, str)
                    and type(port) is int and 0 < port < 65536 and type(pid) is int and _alive(pid)):
                out[rank] = {"engine_id": engine, "host": host, "port": port}
        return out


def dp_query_answer(own: dict[str, Any], registry: DPRegistry) -> dict[str, Any]:
    """``/query`` of DP engine 0: its own entry (``own``: ``query_answer``'s) and every registered engine's."""
    out = {str(rank): query_answer(e["engine_id"], e["host"], e["port"], rank)[str(rank)]
           for rank, e in registry.entries().items()}
    out.update(own)
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


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
