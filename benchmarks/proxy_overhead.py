"""What ``kvtransport-proxy`` adds to a request's first token, measured against instant fake instances.

    python benchmarks/proxy_overhead.py [--requests 200] [--prompt-words 2048]

Starts, on loopback and each in a process of its own, a fake prefill and a fake decode (FastAPI under uvicorn,
answering the way vLLM's OpenAI server does, at once) and the real proxy in front of them (push mode, the first-token flow), then sends the
same streamed completion request, a prompt of ``--prompt-words`` words, ``--requests`` times: once straight to the
fake prefill (the baseline: one HTTP leg) and once through the proxy. Prints the median and p90 time to the
first streamed event of each, and their difference: the proxy's own cost on the time to first token (two more
HTTP legs on loopback, parsing, the decode leg started beside the prefill leg). Needs the proxy's web
dependencies (fastapi, uvicorn, httpx); no vLLM, no GPU.
"""


import argparse
import asyncio
import json
import socket
import statistics
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fake_instance(kind: str, side_port: int) -> Any:
    """A fake vLLM OpenAI server: ``prefill`` answers one token (not streamed), ``decode`` streams three."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "tiny"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        if kind == "prefill" and params.get("kvt_discover"):
            return {"kv_transfer_params": {"kvt_host": "127.0.0.1", "kvt_port": side_port, "kvt_engine_id": "P"}}
        if kind == "prefill" and not body.get("stream"):
            return JSONResponse({"id": "cmpl-p", "object": "text_completion", "created": 1, "model": "tiny",
                                 "choices": [{"index": 0, "text": " w7", "finish_reason": "length",
                                              "logprobs": None}],
                                 "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

        async def events() -> Any:
            for text in (" w7", " w8", " w9"):
                yield ("data: " + json.dumps({"id": "cmpl-d", "object": "text_completion", "choices": [
                    {"index": 0, "text": text, "finish_reason": None}]}) + "\n\n").encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def first_event(client: Any, url: str, body: dict[str, Any]) -> float:
    """Seconds from sending ``body`` to the first streamed ``data:`` line."""
    t0 = time.perf_counter()
    took = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if took is None and line.startswith("data: "):
                took = time.perf_counter() - t0
    if took is None:
        raise RuntimeError(f"no event from {url}")
    return took


def serve(name: str, ports: dict[str, int], side_port: int) -> None:
    """Child process: one server (a fake instance or the proxy) on its port until terminated."""
    import uvicorn

    if name == "proxy":
        from kvtransport_vllm import proxy as proxy_mod

        prx = proxy_mod.Proxy([f"http://127.0.0.1:{ports['prefill']}"], [f"http://127.0.0.1:{ports['decode']}"])
        app = proxy_mod.build_app(prx)
    else:
        app = fake_instance(name, side_port)
    uvicorn.run(app, host="127.0.0.1", port=ports[name], log_level="warning")


async def main(requests: int, words: int) -> dict[str, Any]:
    """Each server in a process of its own (as in a deployment); the client here."""
    import subprocess
    import sys

    import httpx

    side = socket.create_server(("127.0.0.1", 0))
    ports = {k: free_port() for k in ("prefill", "decode", "proxy")}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", n, "--ports", json.dumps(ports),
                               "--side-port", str(side.getsockname()[1])]) for n in ports]
    prompt = " ".join(f"w{i % 1000}" for i in range(words))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for name in ("prefill", "decode", "proxy"):
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if (await client.get(f"http://127.0.0.1:{ports[name]}/v1/models")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} did not start")
                    await asyncio.sleep(0.1)
            for name in ("prefill", "proxy"):
                url = f"http://127.0.0.1:{ports[name]}"
                for _ in range(10):  # warm-up: connections, caches
                    await first_event(client, url, body)
                samples = sorted([await first_event(client, url, body) for _ in range(requests)])
                out[name] = {"p50_ms": round(1000 * statistics.median(samples), 3),
                             "p90_ms": round(1000 * samples[int(0.9 * (len(samples) - 1))], 3)}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        side.close()
    out["proxy_cost_p50_ms"] = round(out["proxy"]["p50_ms"] - out["prefill"]["p50_ms"], 3)
    out.update(requests=requests, prompt_words=words)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-words", type=int, default=2048)
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # child process: run this one server
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--side-port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, json.loads(a.ports), a.side_port)
    else:
        print(json.dumps(asyncio.run(main(a.requests, a.prompt_words)), indent=1))
