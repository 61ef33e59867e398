"""The proxy's checks of a client's API request: a 400 before any instance sees it.

:func:`parse_request` reads the body (strict JSON, an object; a body that would balloon when parsed is refused
before it is: the JSON_GUARD_BYTES guard, bounded by :func:`max_items_for`); :func:`invalid` checks the fields the
proxy reads or rewrites. The body's size itself (413, ``--max-body-bytes``, default REQUEST_BODY_BYTES) is
bounded by :mod:`.http11` as it arrives, before these run.

Contract: called by :meth:`.proxy.Proxy.handle` on the event loop, once per API request (:func:`max_items_for` once,
by ``Proxy.__init__``). Pure and synchronous: no I/O, no state, nothing awaited; CPU bounded by the body (the
guard's count at C speed, ~5 ms per MiB; parsing what passes it). Errors are values: :func:`parse_request` and
:func:`invalid` raise nothing, they return why a request is refused (the 400's message) or the parsed body /
None. Imports nothing of the proxy.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["JSON_GUARD_BYTES", "MAX_N", "REQUEST_BODY_BYTES", "finite", "invalid", "max_items_for", "parse_request"]

REQUEST_BODY_BYTES = 4 * 1024 * 1024
"""Default bound on a request body (~1M tokens of text, ~600k token ids; raise it for base64 images)."""
JSON_GUARD_BYTES = 64 * 1024
"""Larger bodies hold at most one JSON string, object or array per 64 bytes of the body limit, checked before they
are parsed (a body of empty arrays parses into ~25 times its size, and takes the event loop ~0.1 s per MiB)."""
MAX_N = 256
"""Largest ``n`` and ``best_of``: a prefill serves at most this many decode children (the producer's MAX_FANOUT)."""


def max_items_for(max_body_bytes: int) -> int:
    """:func:`parse_request`'s ``max_items`` for a body limit of ``max_body_bytes``: one JSON string, object or
    array per 64 bytes of it (at least 1024)."""
    return max(max_body_bytes // 64, 1024)


def finite(text: str) -> float:
    """A JSON number as a float; ValueError when it is out of range (``1e999``)."""
    if not math.isfinite(value := float(text)):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_float=finite, parse_constant=_constant)
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')


def parse_request(raw: bytes, max_items: int) -> dict[str, Any] | str:
    """The request body as a JSON object, or why not (a 400's message). Strict JSON: no NaN or Infinity, every
    number finite, nesting bounded (the interpreter's recursion limit). A body over JSON_GUARD_BYTES with more
    than ``max_items`` strings, objects and arrays is refused before it is parsed (counted outside strings, C
    speed: ~5 ms per MiB)."""
    if len(raw) > JSON_GUARD_BYTES:
        items = max_items + 1
        # every string's opening quote is unescaped: the count bounds the strings the pattern then visits
        if raw.count(b'"') - raw.count(b'\\"') <= 2 * max_items:
            bare, strings = _STRING.subn(b"", raw)
            items = strings + bare.count(b"[") + bare.count(b"{")
        if items > max_items:
            return (f"the request body holds more than {max_items} JSON strings, objects and arrays (one per 64 "
                    "bytes of --max-body-bytes): raise --max-body-bytes if such requests are meant")
    try:
        body = _DECODER.decode(raw.decode())
    except RecursionError:
        return "the request body is not JSON the proxy reads: nested too deeply"
    except ValueError as exc:
        return f"the request body is not JSON: {exc}"
    if not isinstance(body, dict):
        return "the request body is not a JSON object"
    return body


_BOOLS = ("stream", "echo", "include_stop_str_in_output", "use_beam_search")
_TOKENS = (0, 2**31 - 1)
_INTS: dict[str, tuple[int, int]] = {
    "max_tokens": _TOKENS, "max_completion_tokens": _TOKENS, "min_tokens": _TOKENS, "min_completion_tokens": _TOKENS,
    "n": (1, MAX_N), "best_of": (1, MAX_N), "prompt_logprobs": (-1, 2**31 - 1), "top_logprobs": _TOKENS,
    "seed": (-(2**63), 2**63 - 1)}


def _show(value: Any) -> str:
    if isinstance(value, list | dict):
        return "an array" if isinstance(value, list) else "an object"
    return json.dumps(value[:40] if isinstance(value, str) else value)[:40]


def invalid(body: dict[str, Any], chat: bool) -> str | None:
    """Why the proxy cannot route ``body`` (a 400's message), or None. Checks the fields the proxy reads or
    rewrites, with the types and ranges vLLM's OpenAI server gives them (``n`` at most MAX_N); the rest is the
    instances' to check."""
    for key in _BOOLS:
        value = body.get(key)
        if value is not None and value.__class__ is not bool:
            return f"{key} must be true or false, got {_show(value)}"
    for key, (lo, hi) in _INTS.items():
        value = body.get(key)
        if value is not None and (value.__class__ is not int or not lo <= value <= hi):
            return f"{key} must be an integer in [{lo}, {hi}], got {_show(value)}"
    value = body.get("logprobs")
    if value is not None and (value.__class__ is not bool if chat else value.__class__ is not int or value < 0):
        return f"logprobs must be {'true or false' if chat else 'a non-negative integer'}, got {_show(value)}"
    value = body.get("stop")
    if value is not None and not isinstance(value, str) and not (isinstance(value, list) and all(
            isinstance(s, str) for s in value)):
        return f"stop must be a string or an array of strings, got {_show(value)}"
    value = body.get("stream_options")
    if value is not None and not (isinstance(value, dict) and body.get("stream") is True
                                  and value.get("include_usage") in (None, True, False)):
        return "stream_options must be an object (include_usage: true or false) of a streamed request"
    value = body.get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        return f"kv_transfer_params must be an object, got {_show(value)}"
    return None
