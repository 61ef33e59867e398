"""What ``kvtransport-proxy`` adds to a request's first token, measured against instant fake instances.

    python benchmarks/proxy_overhead.py [--requests 200] [--prompt-words 2048] [--decode-delay-ms 0]

Starts, on loopback and each in a process of its own, a fake prefill and a fake decode (FastAPI under uvicorn,
answering the way vLLM's OpenAI server does) and the real proxy in front of them (``kvtransport-proxy``'s own
entry point: push mode, the first-token flow), then sends the same streamed completion request, a prompt of
``--prompt-words`` words, ``--requests`` times: once straight to the fake prefill (the baseline: one HTTP leg) and
once through the proxy. Prints the p50, p90 and p99 time to the first streamed event of each, and their
differences at p50 and p99: the proxy's own cost on the time to first token (two more HTTP legs on loopback,
parsing, the decode leg started beside the prefill leg).

``--decode-delay-ms``: how long the fake decode waits before it streams. 0 (the default) is the worst case for
the proxy: the decode parses its request and streams at the very moment the prefill's answer comes back, so the
two compete for the host's cores with the proxy's first event. A real decode in the first-token flow cannot
answer before the prefill's first token has reached it (over the side channel, after the prefill sampled it), so
``--decode-delay-ms 5`` is the realistic case. The figure used is reported as ``decode_delay_ms``. Mind that the
pause also lets the client, the proxy and the fake prefill go idle before every proxied request, while the direct
requests run back to back: on a small VM the same work then runs slower after the pause (on the 2-vCPU VM where
this was written, the proxy's CPU time per request rose from ~0.40 to ~0.57 ms, and the direct path, given the
same 5 ms pause between its requests, measured ~0.5 ms slower itself), so there the difference at 5 ms includes
wake-up costs that are not the proxy's. Needs the
fakes' web dependencies (fastapi, uvicorn, httpx) and the proxy's (httptools; uvloop when installed); no vLLM,
no GPU.
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


def fake_instance(kind: str, side_port: int, decode_delay_s: float = 0.0) -> Any:
    """A fake vLLM OpenAI server: ``prefill`` answers one token (not streamed), ``decode`` streams the answer,
    the first token included (as a decode of the first-token flow does), after ``decode_delay_s``."""
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
            if kind == "decode" and decode_delay_s > 0:
                await asyncio.sleep(decode_delay_s)
            for text in (" w7 w8", " w9", " w10"):
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


def serve(name: str, ports: dict[str, int], side_port: int, decode_delay_s: float) -> None:
    """Child process: one server (a fake instance or the proxy) on its port until terminated."""
    if name == "proxy":
        from kvtransport_vllm import proxy as proxy_mod

        proxy_mod.main(["--prefill", f"http://127.0.0.1:{ports['prefill']}", "--decode",
                        f"http://127.0.0.1:{ports['decode']}", "--port", str(ports["proxy"]), "--log-level", "warning"])
        return
    import uvicorn

    uvicorn.run(fake_instance(name, side_port, decode_delay_s), host="127.0.0.1", port=ports[name],
                log_level="warning")


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)

    def at(q: float) -> float:
        return round(1000 * s[int(q * (len(s) - 1))], 3)

    return {"p50_ms": round(1000 * statistics.median(s), 3), "p90_ms": at(0.9), "p99_ms": at(0.99)}


async def main(requests: int, words: int, decode_delay_ms: float = 0.0) -> dict[str, Any]:
    """Each server in a process of its own (as in a deployment); the client here."""
    import subprocess
    import sys

    import httpx

    side = socket.create_server(("127.0.0.1", 0))
    ports = {k: free_port() for k in ("prefill", "decode", "proxy")}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve", n, "--ports", json.dumps(ports),
                               "--side-port", str(side.getsockname()[1]),
                               "--decode-delay-ms", str(decode_delay_ms)]) for n in ports]
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
                out[name] = percentiles([await first_event(client, url, body) for _ in range(requests)])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        side.close()
    out["proxy_cost_p50_ms"] = round(out["proxy"]["p50_ms"] - out["prefill"]["p50_ms"], 3)
    out["proxy_cost_p99_ms"] = round(out["proxy"]["p99_ms"] - out["prefill"]["p99_ms"], 3)
    out.update(requests=requests, prompt_words=words, decode_delay_ms=decode_delay_ms)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-words", type=int, default=2048)
    ap.add_argument("--decode-delay-ms", type=float, default=0.0,
                    help="the fake decode's wait before it streams (0: at once, the worst case; 5: realistic, "
                         "see the module docstring)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)  # child process: run this one server
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--side-port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve, json.loads(a.ports), a.side_port, a.decode_delay_ms / 1000)
    else:
        print(json.dumps(asyncio.run(main(a.requests, a.prompt_words, a.decode_delay_ms)), indent=1))
