"""A minimal stand-in for vLLM's tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (not shipped in
the wheel): the same flow and the same NixlConnector ``kv_transfer_params`` keys. Prefill first with
``max_tokens=1`` and ``do_remote_decode``, then the prefill's ``kv_transfer_params`` go to the decode instance,
whose answer is streamed back.

    python toy_proxy.py --port 8000 --prefiller-host 127.0.0.1 --prefiller-port 8100 \
        --decoder-host 127.0.0.1 --decoder-port 8200
"""

from __future__ import annotations

import argparse
import itertools
import uuid

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse


def build(prefills: list[str], decodes: list[str]) -> FastAPI:
    app = FastAPI()
    pc = [httpx.AsyncClient(base_url=u, timeout=None) for u in prefills]
    dc = [httpx.AsyncClient(base_url=u, timeout=None) for u in decodes]
    pi, di = itertools.cycle(pc), itertools.cycle(dc)

    async def handle(api: str, request: Request) -> StreamingResponse:
        data = await request.json()
        rid = str(uuid.uuid4())
        pdata = dict(data)
        pdata["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None,
                                       "remote_host": None, "remote_port": None}
        pdata["stream"] = False
        pdata["max_tokens"] = 1
        if "max_completion_tokens" in pdata:
            pdata["max_completion_tokens"] = 1
        pdata.pop("stream_options", None)
        pdata.pop("min_tokens", None)
        r = await next(pi).post(api, json=pdata, headers={"X-Request-Id": rid})
        r.raise_for_status()
        params = r.json().get("kv_transfer_params") or {}
        if params:
            data["kv_transfer_params"] = params
        client = next(di)

        async def gen():
            async with client.stream("POST", api, json=data, headers={"X-Request-Id": rid}) as resp:
                resp.raise_for_status()
                async for chunk in resp.aiter_bytes():
                    yield chunk

        return StreamingResponse(gen(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        return await handle("/v1/chat/completions", request)

    @app.get("/healthcheck")
    async def health() -> dict:
        return {"status": "ok"}

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--prefiller-host", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--prefiller-port", type=int, nargs="+", default=[8100])
    ap.add_argument("--decoder-host", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--decoder-port", type=int, nargs="+", default=[8200])
    a = ap.parse_args()
    pre = [f"http://{h}:{p}" for h, p in zip(a.prefiller_host, a.prefiller_port, strict=True)]
    dec = [f"http://{h}:{p}" for h, p in zip(a.decoder_host, a.decoder_port, strict=True)]
    uvicorn.run(build(pre, dec), host=a.host, port=a.port, log_level="warning")
