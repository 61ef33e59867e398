"""The proxy's first-token flow (Splitwise's order): the client gets the first token from the prefill as soon as
it is sampled, then the decode's continuation, in one well-formed answer. Fake prefill/decode servers (an httpx
transport, the formats vLLM's OpenAI server writes) and a real side-channel socket; no vLLM process."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the proxy's web dependencies are not installed")
proxy_mod = pytest.importorskip("kvtransport_vllm.proxy", reason="kvtransport-vllm is not installed")

pytestmark = pytest.mark.timeout(60)


def jsonstream(obj: Any) -> Any:
    """A JSON body as a network response has it (streamed, as vLLM's server sends it)."""
    return httpx.ByteStream(json.dumps(obj).encode())


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class Fake:
    """A prefill (``http://p``) answering one token, and a decode (``http://d``) answering the rest. The
    decode's answer waits for ``release`` (the test sets it), so the first token must reach the client first."""

    def __init__(self, *, first: str = " w7", first_id: int = 7, finish: str = "length", chat: bool = False) -> None:
        self.side = socket.create_server(("127.0.0.1", 0))
        self.first, self.first_id, self.finish, self.chat = first, first_id, finish, chat
        self.bodies: dict[str, list[dict[str, Any]]] = {"p": [], "d": []}
        self.release = asyncio.Event()
        self.decode_closed = asyncio.Event()

    def close(self) -> None:
        self.side.close()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny"}]})
        body = json.loads(request.content)
        params = body.get("kv_transfer_params") or {}
        if host == "p" and params.get("kvt_discover"):
            return httpx.Response(200, json={"kv_transfer_params": {
                "kvt_host": "127.0.0.1", "kvt_port": self.side.getsockname()[1], "kvt_engine_id": "P"}})
        self.bodies[host].append(body)
        if host == "p":
            choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish, "stop_reason": None,
                                      "logprobs": None, "token_ids": [self.first_id], "prompt_token_ids": [1, 2]}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": self.first}
            else:
                choice["text"] = self.first
            return httpx.Response(200, headers={"content-type": "application/json"}, stream=jsonstream({
                "id": "cmpl-prefill", "object": "chat.completion" if self.chat else "text_completion", "created": 1,
                "model": "tiny", "choices": [choice],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
                "kv_transfer_params": {"remote_host": "127.0.0.1", "remote_port": self.side.getsockname()[1],
                                       "remote_engine_id": "P"}}))
        return httpx.Response(200, headers={"content-type": "text/event-stream" if body.get("stream")
                                            else "application/json"}, stream=self.decode_stream(body))

    def decode_stream(self, body: dict[str, Any]) -> Any:
        fake = self

        class Stream(httpx.AsyncByteStream):
            async def __aiter__(self) -> Any:
                await fake.release.wait()
                if body.get("stream"):
                    if fake.chat:
                        yield sse({"id": "chatcmpl-d", "object": "chat.completion.chunk", "choices": [
                            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
                        for tok, text in ((8, " w8"), (9, " w9")):
                            yield sse({"id": "chatcmpl-d", "object": "chat.completion.chunk", "choices": [
                                {"index": 0, "delta": {"content": text}, "token_ids": [tok], "finish_reason": None}]})
                    else:
                        part = sse({"id": "cmpl-d", "object": "text_completion", "choices": [
                            {"index": 0, "text": " w8", "token_ids": [8], "prompt_token_ids": [1, 2],
                             "finish_reason": None}]})
                        yield part[:17]  # an event cut across two reads
                        yield part[17:]
                        yield sse({"id": "cmpl-d", "object": "text_completion", "choices": [
                            {"index": 0, "text": " w9", "token_ids": [9], "finish_reason": "length"}]})
                    if (body.get("stream_options") or {}).get("include_usage"):
                        yield sse({"id": "cmpl-d", "choices": [],
                                   "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}})
                    yield b"data: [DONE]\n\n"
                    return
                c: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": [8, 9],
                                     "logprobs": {"tokens": ["w8", "w9"], "token_logprobs": [-1.0, -2.0],
                                                  "top_logprobs": [None, None], "text_offset": [0, 3]}}
                if fake.chat:
                    c["message"] = {"role": "assistant", "content": " w8 w9"}
                    c["logprobs"] = {"content": [{"token": "w8"}, {"token": "w9"}]}
                else:
                    c["text"] = " w8 w9"
                yield json.dumps({"id": "cmpl-d", "choices": [c],
                                  "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}}).encode()

            async def aclose(self) -> None:
                fake.decode_closed.set()

        return Stream()


def run(fake: Fake, scenario: Any, *, served: bool = False, **kw: Any) -> None:
    """Run ``scenario(client)`` against the proxy; ``served``: behind a real HTTP server (uvicorn on loopback),
    where a streamed answer reaches the client event by event (httpx's in-process ASGI transport buffers the
    whole answer)."""
    proxy = proxy_mod.Proxy(["http://p"], ["http://d"], transport=httpx.MockTransport(fake.handler), **kw)

    async def main() -> None:
        app = proxy_mod.build_app(proxy)
        if not served:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy",
                                         timeout=30) as client:
                await scenario(client)
            await proxy.close()
            return
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                await scenario(client)
        finally:
            server.should_exit = True
            await task

    try:
        asyncio.run(main())
    finally:
        fake.close()


def events(lines: list[str]) -> list[Any]:
    return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data: ")]


def test_streamed_first_token_comes_from_the_prefill_before_the_decode_answers() -> None:
    fake = Fake()

    async def scenario(client: Any) -> None:
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 3, "min_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.7, "return_token_ids": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.aiter_lines()
            first = await asyncio.wait_for(anext(lines), 10)  # the decode has not answered yet
            rest = [first]
            fake.release.set()
            async for line in lines:
                rest.append(line)
        got = events(rest)
        assert got[0]["choices"][0]["text"] == " w7" and got[0]["choices"][0]["token_ids"] == [7]
        assert got[0]["choices"][0]["prompt_token_ids"] == [1, 2] and got[0]["id"] == "cmpl-prefill"
        assert [e["choices"][0]["token_ids"] for e in got[1:3]] == [[8], [9]]
        assert all(e["id"] == "cmpl-prefill" for e in got[:4])  # one completion id throughout
        assert "prompt_token_ids" not in got[1]["choices"][0]
        assert got[3]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        assert got[4] == "[DONE]" and len(got) == 5
        p, d = fake.bodies["p"][0], fake.bodies["d"][0]
        # the prefill samples the first token as the client asked, one token, not streamed
        assert (p["max_tokens"], p["min_tokens"], p["temperature"], p["stream"]) == (1, 1, 0.7, False)
        assert "stream_options" not in p and p["kv_transfer_params"]["kvt_first_token"] is True
        # the decode continues: one token fewer to generate and to reach, told to take the prefill's token
        assert (d["max_tokens"], d["min_tokens"], d["stream"]) == (2, 1, True)
        assert d["kv_transfer_params"]["kvt_first_token"] is True
        assert d["kv_transfer_params"]["kvt_xfer"] == p["kv_transfer_params"]["kvt_xfer"]

    run(fake, scenario, served=True)


def test_streamed_chat_keeps_one_role_event() -> None:
    fake = Fake(chat=True)

    async def scenario(client: Any) -> None:
        fake.release.set()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "max_tokens": 3, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            got = events([line async for line in r.aiter_lines()])
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": " w7"}
        assert got[0]["object"] == "chat.completion.chunk"
        assert [e["choices"][0]["delta"] for e in got[1:3]] == [{"content": " w8"}, {"content": " w9"}]
        assert got[3] == "[DONE]" and len(got) == 4  # the decode's own role-only event is gone

    run(fake, scenario)


@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_joins_text_ids_logprobs_and_usage(chat: bool) -> None:
    fake = Fake(chat=chat)

    async def scenario(client: Any) -> None:
        fake.release.set()
        api = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": "tiny", "max_tokens": 3, **({"messages": [{"role": "user", "content": "w1"}]} if chat
                                                     else {"prompt": "w1 w2"})}
        r = await client.post(api, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        c = out["choices"][0]
        assert (c["message"]["content"] if chat else c["text"]) == " w7 w8 w9"
        assert c["token_ids"] == [7, 8, 9]
        assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
        assert "kv_transfer_params" not in out
        if not chat:  # the prefill's token has no logprobs here: the decode's keep their offsets past its text
            assert c["logprobs"]["text_offset"] == [0, 3]

    run(fake, scenario)


def test_a_first_token_that_ends_the_answer_cancels_the_decode() -> None:
    fake = Fake(finish="stop")

    async def scenario(client: Any) -> None:
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 5, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            got = events([line async for line in r.aiter_lines()])
        assert got[0]["choices"][0]["finish_reason"] == "stop" and got[0]["choices"][0]["text"] == " w7"
        assert got[1:] == ["[DONE]"]
        await asyncio.wait_for(fake.decode_closed.wait(), 10)  # the decode's stream was closed (aborted)

    run(fake, scenario, served=True)


def test_a_client_that_leaves_after_the_first_token_ends_the_decode_leg() -> None:
    fake = Fake()

    async def scenario(client: Any) -> None:
        body = {"model": "tiny", "prompt": "w1 w2", "max_tokens": 5, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            first = await asyncio.wait_for(anext(r.aiter_lines()), 10)
            assert json.loads(first[6:])["choices"][0]["text"] == " w7"
        # the client closed its connection while the decode had not answered yet
        await asyncio.wait_for(fake.decode_closed.wait(), 10)

    run(fake, scenario, served=True)


def test_one_token_goes_to_the_prefill_alone() -> None:
    fake = Fake()

    async def scenario(client: Any) -> None:
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " w7"
        assert fake.bodies["d"] == [] and "kv_transfer_params" not in fake.bodies["p"][0]

    run(fake, scenario)


@pytest.mark.parametrize("extra", [{"n": 2}, {"seed": 3}, {"response_format": {"type": "json_object"}},
                                   {"echo": True}, {"prompt_logprobs": 1}])
def test_requests_the_prefill_cannot_start_keep_the_decodes_first_token(extra: dict[str, Any]) -> None:
    fake = Fake()

    async def scenario(client: Any) -> None:
        fake.release.set()
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 3, **extra})
        assert r.status_code == 200
        d = fake.bodies["d"][0]
        assert d["max_tokens"] == 3 and "kvt_first_token" not in d["kv_transfer_params"]
        assert "kvt_first_token" not in fake.bodies["p"][0]["kv_transfer_params"]
        assert r.json()["choices"][0]["text"] == " w8 w9"  # the decode's answer as it is

    run(fake, scenario)


def test_first_token_decode_keeps_vllms_order() -> None:
    fake = Fake()

    async def scenario(client: Any) -> None:
        fake.release.set()
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "w1", "max_tokens": 3})
        assert r.status_code == 200 and fake.bodies["d"][0]["max_tokens"] == 3
        assert fake.bodies["p"][0]["temperature"] == 0  # its own sample is discarded: greedy

    run(fake, scenario, first_token="decode")


def test_the_proxy_overhead_benchmark_runs() -> None:
    """benchmarks/proxy_overhead.py (the proxy's own cost on the first token, against instant fake instances)
    still runs end to end; its figure is measured on the GPU host (docs/benchmarks.md), not asserted here."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "proxy_overhead.py"
    spec = importlib.util.spec_from_file_location("proxy_overhead", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = asyncio.run(mod.main(requests=5, words=16))
    assert set(out) == {"prefill", "proxy", "proxy_cost_p50_ms", "requests", "prompt_words"}
    assert out["proxy"]["p50_ms"] > 0 and out["prefill"]["p50_ms"] > 0
