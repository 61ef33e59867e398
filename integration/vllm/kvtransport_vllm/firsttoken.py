"""Splitwise's order in the proxy: the client gets the first token from the prefill as soon as it is sampled, then
the decode's tokens, which continue from it. Which requests qualify (:func:`first_token_ineligible`), the two legs'
request bodies, and the prefill's first token merged into the decode's answer, whole (:func:`merge_response`)
or streamed (:func:`first_chunk`, :func:`continue_event`). Pure functions of JSON bodies and SSE bytes; used by
:mod:`.proxy`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

FIRST_TOKEN = ("prefill", "decode")
_CONSTRAINED = ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend")


def first_token_ineligible(body: dict[str, Any]) -> str | None:
    """Why the prefill cannot answer this request's first token (None: it can). ``"max_tokens=1"``: the
    prefill's token is the whole answer. Otherwise the decode samples the first token, as without the option:
    ``n`` > 1 (each child samples its own), ``seed`` (one generator must sample every token to reproduce it),
    ``best_of``/beam search, ``echo``, ``prompt_logprobs`` (the decode computes no prompt) and structured output
    or tools (the decode's grammar would not have seen the first token)."""
    if int(body.get("n") or 1) != 1:
        return "n>1"
    for key in ("seed", "best_of", "use_beam_search", "echo", "prompt_logprobs", *_CONSTRAINED):
        if body.get(key) not in (None, False, 1 if key == "best_of" else None):
            return key
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(limit, int) and not isinstance(limit, bool) and limit <= 1:
        return "max_tokens=1"
    return None


def one_token_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A prefill leg of either flow: ``body`` with ``params`` as its kv_transfer_params, one token, not
    streamed (a shallow copy: only top-level keys change)."""
    out = dict(body)
    out["kv_transfer_params"] = params
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def first_token_prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg of the first-token flow: the client's sampling, one token, not streamed."""
    out = one_token_body(body, params)
    if isinstance(out.get("min_tokens"), int):
        out["min_tokens"] = min(out["min_tokens"], 1)
    return out


def first_token_decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of the first-token flow: one token fewer to generate (and to reach), since the first one
    comes from the prefill and counts as the decode's prompt."""
    out = dict(body)
    out["kv_transfer_params"] = params
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if isinstance(out.get(key), int) and not isinstance(out[key], bool):
            out[key] = max(0, out[key] - 1)
    return out


def first_choice(resp: Any) -> dict[str, Any] | None:
    """The prefill answer's one choice, or None when the prefill failed (an error response, no choice)."""
    if not isinstance(resp, dict):
        return None
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    return choices[0]


def _text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        msg = choice.get("message") or choice.get("delta") or {}
        return str(msg.get("content") or "")
    return str(choice.get("text") or "")


def _token_ids(choice: dict[str, Any]) -> list[int] | None:
    ids = choice.get("token_ids")
    if ids is None and isinstance(choice.get("message"), dict):
        ids = choice["message"].get("token_ids")
    return list(ids) if isinstance(ids, list) else None


def _merge_logprobs(first: Any, rest: Any, chat: bool, shift: int) -> Any:
    if not isinstance(first, dict) or not isinstance(rest, dict):
        return rest if rest is not None else first
    if chat:
        return {**rest, "content": list(first.get("content") or []) + list(rest.get("content") or [])}
    out = dict(rest)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        out[key] = list(first.get(key) or []) + list(rest.get(key) or [])
    out["text_offset"] = list(first.get("text_offset") or []) + [o + shift for o in rest.get("text_offset") or []]
    return out


def _count_first_token(usage: Any) -> Any:
    if isinstance(usage, dict):
        for key in ("completion_tokens", "total_tokens"):
            if isinstance(usage.get(key), int):
                usage[key] += 1
    return usage


def merge_response(prefill: dict[str, Any], decode: dict[str, Any], chat: bool) -> dict[str, Any]:
    """One non-streamed answer from the prefill's first token and the decode's continuation."""
    first = first_choice(prefill) or {}
    out = dict(decode)
    choices = [dict(c) for c in decode.get("choices") or []]
    if choices:
        c = choices[0]
        text0 = _text(first, chat)
        if chat:
            msg = dict(c.get("message") or {})
            msg["content"] = text0 + str(msg.get("content") or "")
            if isinstance(msg.get("token_ids"), list) and _token_ids(first) is not None:
                msg["token_ids"] = _token_ids(first) + msg["token_ids"]  # type: ignore[operator]
            c["message"] = msg
        else:
            c["text"] = text0 + str(c.get("text") or "")
        if isinstance(c.get("token_ids"), list) and _token_ids(first) is not None:
            c["token_ids"] = _token_ids(first) + c["token_ids"]  # type: ignore[operator]
        if first.get("logprobs") is not None or c.get("logprobs") is not None:
            c["logprobs"] = _merge_logprobs(first.get("logprobs"), c.get("logprobs"), chat, len(text0))
        out["choices"] = choices
    out["usage"] = _count_first_token(dict(decode["usage"]) if isinstance(decode.get("usage"), dict) else None)
    out.pop("kv_transfer_params", None)
    return out


def first_chunk(prefill: dict[str, Any], chat: bool, finished: bool) -> dict[str, Any]:
    """The stream's first event: the prefill's token, in the format the decode's events have."""
    c0 = first_choice(prefill) or {}
    choice: dict[str, Any] = {"index": 0, "logprobs": c0.get("logprobs"),
                              "finish_reason": c0.get("finish_reason") if finished else None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": _text(c0, True)}
    else:
        choice["text"] = _text(c0, False)
        if finished:
            choice["stop_reason"] = c0.get("stop_reason")
    ids = _token_ids(c0)
    if ids is not None:
        choice["token_ids"] = ids
    if c0.get("prompt_token_ids") is not None:
        choice["prompt_token_ids"] = c0["prompt_token_ids"]
    return {"id": prefill.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": prefill.get("created"), "model": prefill.get("model"), "choices": [choice]}


def usage_chunk(prefill: dict[str, Any], chat: bool) -> dict[str, Any]:
    return {"id": prefill.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": prefill.get("created"), "model": prefill.get("model"), "choices": [],
            "usage": prefill.get("usage")}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (``data: ...`` up to the blank line) from a byte stream cut anywhere."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while True:
            cut = buf.find(b"\n\n")
            if cut < 0:
                break
            event, buf = buf[:cut], buf[cut + 2:]
            if event.strip():
                yield event
    if buf.strip():
        yield buf


def continue_event(event: bytes, prefill: dict[str, Any], chat: bool) -> bytes | None:
    """A decode event of the first-token flow as the client gets it: under the prefill's completion id, with
    the first token counted in ``usage``, and without the decode's opening role-only event (chat), which the
    first event already carried. Events that are not JSON data pass as they are."""
    line = event.strip()
    if not line.startswith(b"data:"):
        return event + b"\n\n"
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return b"data: [DONE]\n\n"
    try:
        obj = json.loads(payload)
    except ValueError:
        return event + b"\n\n"
    if not isinstance(obj, dict):
        return event + b"\n\n"
    if "error" in obj:
        return sse(obj)
    choices = obj.get("choices") or []
    if chat and len(choices) == 1 and isinstance(choices[0], dict) and not obj.get("usage"):
        delta = choices[0].get("delta") or {}
        if delta.get("role") and not delta.get("content") and not choices[0].get("finish_reason") \
                and not choices[0].get("token_ids") and set(delta) <= {"role", "content"}:
            return None
    for c in choices:
        if isinstance(c, dict):
            c.pop("prompt_token_ids", None)  # the first event carried them
    if prefill.get("id") is not None:
        obj["id"] = prefill["id"]
    if obj.get("usage"):
        _count_first_token(obj["usage"])
    return sse(obj)
