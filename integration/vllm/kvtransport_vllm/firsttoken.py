"""Splitwise's order in the proxy: the client gets the first token from the prefill as soon as it is sampled, then
the decode's answer, which includes that token as its first output token (the decode engine reports it together
with the second one, detokenized together, so a character split across the two tokens and a stop string that
spans them come out as a single instance would give them).

Which requests qualify (:func:`first_token_ineligible`), the two legs' request bodies, the stream's first event
built from the prefill's answer (:func:`first_chunk`, its text held back as vLLM's detokenizer holds back streamed
text when stop strings are set: :func:`holdback`), and the decode's events as the client gets them
(:class:`Continuation`: only the text beyond what the first event carried, without token #1's id, under the
prefill's completion id). A non-streamed answer is the decode's, relayed as is. Pure functions of JSON bodies and
SSE bytes; used by :mod:`.proxy`."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("kvtransport.proxy")

FIRST_TOKEN = ("prefill", "decode")
_CONSTRAINED = ("tools", "functions", "response_format", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar", "guided_whitespace_pattern", "guided_decoding_backend")
MAX_EVENT_BYTES = 16 * 1024 * 1024
"""Bound on one server-sent event of a decode's stream."""


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The request's stop strings (``stop``: a string or a list of strings)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str) and s]
    return []


def holdback(body: dict[str, Any]) -> int:
    """How many trailing characters of a streamed, unfinished text vLLM's detokenizer holds back for ``body``:
    ``max(len(s) for s in stop) - 1`` when stop strings are set and not ``include_stop_str_in_output`` (so a
    stop string completed by a later token is never sent), else 0."""
    stops = stop_strings(body)
    if not stops or body.get("include_stop_str_in_output"):
        return 0
    return max(len(s) for s in stops) - 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def first_token_ineligible(body: dict[str, Any]) -> str | None:
    """Why the prefill cannot answer this request's first token (None: it can). ``"max_tokens=1"``: the
    prefill's token is the whole answer. Otherwise the decode samples the first token, as without the option:
    ``n`` > 1 (each child samples its own), ``seed`` (one generator must sample every token to reproduce it),
    ``best_of``/beam search, ``echo``, ``prompt_logprobs`` (the decode computes no prompt), structured output or
    tools (the decode's grammar would not have seen the first token), ``logprobs`` (the decode's answer carries
    the first token without its logprobs) and ``min_tokens`` > 1 with stop strings (the decode, one token fewer to
    reach, would check the stop strings one token early)."""
    if int(body.get("n") or 1) != 1:
        return "n>1"
    for key in ("seed", "best_of", "use_beam_search", "echo", "prompt_logprobs", *_CONSTRAINED):
        if body.get(key) not in (None, False, 1 if key == "best_of" else None):
            return key
    if "messages" in body:  # chat: ``logprobs: true`` or ``top_logprobs`` set
        if body.get("logprobs") or body.get("top_logprobs") is not None:
            return "logprobs"
    elif body.get("logprobs") is not None:  # completions: an int, 0 asks for the sampled token's
        return "logprobs"
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 1 and stop_strings(body):
        return "min_tokens"
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
    """The decode leg of the first-token flow: one token fewer to generate (and to reach), since the decode engine
    counts the first one, which comes from the prefill, as a prompt token (its answer still includes it)."""
    out = dict(body)
    out["kv_transfer_params"] = params
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if _is_int(out.get(key)):
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


def first_chunk(prefill: dict[str, Any], chat: bool, finished: bool, hold: int = 0) -> tuple[dict[str, Any], str]:
    """The stream's first event from the prefill's answer, in the format the decode's events have, and the text
    it carries: the prefill's text less its last ``hold`` characters (:func:`holdback`) unless the token
    finished the answer (then vLLM sends all of it)."""
    c0 = first_choice(prefill) or {}
    text = _text(c0, chat)
    if hold > 0 and not finished:
        text = text[:max(0, len(text) - hold)]
    choice: dict[str, Any] = {"index": 0, "logprobs": c0.get("logprobs"),
                              "finish_reason": c0.get("finish_reason") if finished else None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
        if finished:
            choice["stop_reason"] = c0.get("stop_reason")
    ids = _token_ids(c0)
    if ids is not None:
        choice["token_ids"] = ids
    if c0.get("prompt_token_ids") is not None:
        choice["prompt_token_ids"] = c0["prompt_token_ids"]
    return {"id": prefill.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": prefill.get("created"), "model": prefill.get("model"), "choices": [choice]}, text


def usage_chunk(prefill: dict[str, Any], chat: bool) -> dict[str, Any]:
    return {"id": prefill.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": prefill.get("created"), "model": prefill.get("model"), "choices": [],
            "usage": prefill.get("usage")}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class EventTooLarge(ValueError):
    """A server-sent event longer than its bound."""


class SSESplitter:
    """Whole server-sent events (up to the blank line) from a byte stream cut anywhere; an event is at most
    ``max_event_bytes`` long (:class:`EventTooLarge`)."""

    __slots__ = ("_buf", "max_event_bytes")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._buf = b""
        self.max_event_bytes = max_event_bytes

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        events = []
        start = 0
        while True:
            cut = buf.find(b"\n\n", start)
            if cut < 0:
                break
            event = buf[start:cut]
            if event.strip():
                events.append(event)
            start = cut + 2
        self._buf = buf[start:]
        if len(self._buf) > self.max_event_bytes:
            raise EventTooLarge(f"a server-sent event longer than {self.max_event_bytes} bytes")
        return events

    def tail(self) -> bytes | None:
        """What is left after the stream ended (an event without its blank line), if anything."""
        rest, self._buf = self._buf, b""
        return rest if rest.strip() else None


class Continuation:
    """The decode's events of a streamed first-token answer, as the client gets them (:meth:`event`): only the
    text beyond what the client already has (the decode's cumulative text starts with token #1's), token #1's id
    dropped from the first event that carries ``token_ids``, the prefill's completion id, no
    ``prompt_token_ids``, no chat role-only opening event (the first event carried the role); ``usage`` as the
    decode reports it (it counts token #1). ``emitted``: the text the first event carried."""

    __slots__ = ("_chat", "_decoded", "_emitted", "_id", "_ids_dropped", "_synced", "_url", "diverged")

    def __init__(self, prefill: dict[str, Any], chat: bool, emitted: str, url: str = "the decode") -> None:
        self._id = prefill.get("id")
        self._chat = chat
        self._emitted = emitted
        self._decoded = ""
        self._synced = False  # the decode's text caught up with the client's: its deltas pass as they are
        self._ids_dropped = False
        self._url = url
        self.diverged = False  # the decode's text did not continue the client's (a warning was logged)

    def _continue_text(self, holder: dict[str, Any], key: str) -> None:
        piece = holder.get(key)
        if self._synced or not isinstance(piece, str):
            return
        self._decoded += piece
        decoded, emitted = self._decoded, self._emitted
        if len(decoded) >= len(emitted):
            if decoded.startswith(emitted):
                holder[key] = decoded[len(emitted):]
                self._synced = True
                self._decoded = self._emitted = ""
                return
        elif emitted.startswith(decoded):
            holder[key] = ""  # the decode has not reached the text the client already has
            return
        self.diverged = self._synced = True
        log.warning("%s's text %r does not continue the first token's %r: relaying its deltas as they are",
                    self._url, decoded[:80], emitted[:80])

    def event(self, event: bytes) -> bytes | None:
        """One decode event (without its blank line) as the client gets it, or None to drop it."""
        line = event.strip()
        if not line.startswith(b"data:"):
            return event + b"\n\n"
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return DONE
        try:
            obj = json.loads(payload)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict):
            return event + b"\n\n"
        if "error" in obj:
            return sse(obj)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            choices = []
        if self._chat and len(choices) == 1 and isinstance(choices[0], dict) and not obj.get("usage"):
            delta = choices[0].get("delta") or {}
            if isinstance(delta, dict) and delta.get("role") and not delta.get("content") \
                    and not choices[0].get("finish_reason") and not choices[0].get("token_ids") \
                    and set(delta) <= {"role", "content"}:
                return None
        for c in choices:
            if not isinstance(c, dict):
                continue
            c.pop("prompt_token_ids", None)  # the first event carried them
            if c.get("index", 0) != 0:
                continue
            if self._chat:
                delta = c.get("delta")
                if isinstance(delta, dict):
                    self._continue_text(delta, "content")
            else:
                self._continue_text(c, "text")
            if not self._ids_dropped and isinstance(c.get("token_ids"), list):
                c["token_ids"] = c["token_ids"][1:]  # token #1: the client has it from the first event
                self._ids_dropped = True
        if self._id is not None:
            obj["id"] = self._id
        return sse(obj)
