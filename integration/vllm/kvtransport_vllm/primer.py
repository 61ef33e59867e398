"""The API server's detokenizer of a P/D request, primed with its prompt while the request waits for its first
output, so that the first output does not pay for the whole prompt.

vLLM (0.24 and 0.32: the same code) starts each request's incremental detokenizer as
``DecodeStream(ids=prompt)``, and the stream's first ``step`` decodes the whole prompt twice, on the answer path of
the request's first output: at 2k / 8k prompt tokens 0.41 / 1.58 ms with a byte-level decoder (Llama 3's kind),
2.03 / 8.06 ms with a WordPiece one, 0.20 / 0.79 ms with the serving benchmark's WordLevel tokenizer
(``benchmarks/detok_prime.py``, docs/cpu-runs/2026-12-03-primer). A single instance pays it once, inside its time to
first token. A P/D pair pays it on the prefill's answer (inside the TTFT) and again on the decode's first output,
between token 1 and token 2 (on one H200 that output reached the proxy 9.5 ms after the decode scheduled the
request, against a 4.7 ms decode step: docs/gpu-runs/2026-12-03-h200x1-vllm-6). Both requests wait long for their
first output (the prefill for its forward, the decode for its KV), so the same work done in that wait is off the
path.

How: for a request whose ``kv_transfer_params`` make it a P/D leg (``parse_transfer_params`` gives it a role),
the wrapped ``FastIncrementalDetokenizer.__init__`` schedules, on the API server's event loop, PRIME_AFTER_S later
(vLLM builds the detokenizer just before it sends the request to the engine: the send must not wait for the
decode), a replacement stream ``DecodeStream(ids=prompt[:-1])`` stepped once
with the prompt's last token. The text of every later step is the same as the original stream's (the test checks
byte-level BPE, WordPiece and Metaspace decoders on random prompts); the replacement is taken only if that step
gave text (a prompt ending inside a character keeps the original stream) and only if the request's own stream has
not been stepped yet (its first output came first: nothing to gain, nothing changed). Requests without P/D
params, other detokenizers and vLLM versions that start the stream otherwise (older ones prime it with a few
prompt tokens: nothing to gain) are left as they are (one log line says so).

Who calls: the plugin's ``install`` (every vLLM process, once); vLLM's output processor (the wrapped ``__init__``
and step, per request, in the API server's event loop). Nothing blocks beyond the decode itself; never raises
into vLLM.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .metadata import TransferParamsError, parse_transfer_params
from .patching import on_import

log = logging.getLogger("vllm.kvtransport")

TARGET_MODULE = "vllm.v1.engine.detokenizer"
TARGET_CLASS = "FastIncrementalDetokenizer"
PRIME_AFTER_S = 0.002
"""How long after the detokenizer is built the priming runs (the request's send to the engine comes first)."""
MIN_PROMPT = 64
"""Prompts shorter than this are not primed: their first step costs microseconds."""
TARGET_STEP = "_protected_step"
_MARK = "_kvtransport_primes"
_STEPPED = "_kvtransport_stepped"


def is_pd_leg(request: Any) -> bool:
    """Whether ``request`` (vLLM's EngineCoreRequest) carries ``kv_transfer_params`` that give it a P/D role."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    if not isinstance(extra, dict) or not isinstance(extra.get("kv_transfer_params"), dict):
        return False
    try:
        return parse_transfer_params(extra["kv_transfer_params"]).role is not None
    except TransferParamsError:
        return False


def primed_stream(stream_type: Callable[..., Any], tokenizer: Any, prompt: Sequence[int],
                  skip_special_tokens: bool) -> Any | None:
    """A ``stream_type`` (tokenizers' DecodeStream) over ``prompt`` that has already decoded it: the text of
    every later step is the same as ``stream_type(ids=prompt)``'s. None when the prompt's last token completes no
    text (a character split across it and the next token): the original stream is kept then."""
    stream = stream_type(ids=list(prompt[:-1]), skip_special_tokens=skip_special_tokens)
    if stream.step(tokenizer, prompt[-1]) is None:
        return None
    return stream


def prime(detokenizer: Any, stream_type: Callable[..., Any], prompt: Sequence[int]) -> bool:
    """Swap ``detokenizer``'s stream for a primed one unless it has been stepped already; True if swapped.
    Runs on the API server's event loop (as every step does); never raises."""
    if getattr(detokenizer, _STEPPED, True):
        return False
    try:
        stream = primed_stream(stream_type, detokenizer.tokenizer, prompt, detokenizer.skip_special_tokens)
    except Exception as exc:  # a tokenizer that refuses the prompt: the original stream stays
        log.debug("kvtransport: detokenizer not primed: %s", exc)
        return False
    if stream is None or getattr(detokenizer, _STEPPED, True):
        return False
    detokenizer.stream = stream
    return True


def stream_type_of(module: ModuleType) -> Callable[..., Any] | None:
    """The DecodeStream class vLLM's detokenizer module uses (looked up at each request, as vLLM does, so a shim
    that replaces it is honoured), or None."""
    found = getattr(module, "DecodeStream", None)
    if found is None:
        decoders = getattr(getattr(module, "tokenizers", None), "decoders", None)
        found = getattr(decoders, "DecodeStream", None)
    return found if callable(found) else None


def primes_natively(init: Callable[..., Any]) -> bool:
    """Whether ``init`` (a detokenizer's constructor) starts its stream with the whole prompt
    (``DecodeStream(ids=request.prompt_token_ids)``, vLLM 0.24 to 0.32). Older vLLMs prime it with a short suffix of
    the prompt instead: nothing to gain, and a full-prompt stream could word an edge case differently."""
    try:
        source = inspect.getsource(init)
    except (OSError, TypeError):
        return False
    return "ids=request.prompt_token_ids" in "".join(source.split())


def wrap(cls: type, module: ModuleType) -> bool:
    """Wrap ``cls.__init__`` (schedule the priming) and ``cls._protected_step`` (mark the stream stepped); True
    if wrapped now or already, False if ``cls`` lacks either or does not start its stream with the whole
    prompt (:func:`primes_natively`)."""
    init = cls.__dict__.get("__init__")
    step = cls.__dict__.get(TARGET_STEP)
    if init is None or step is None:
        return False
    if getattr(init, _MARK, False):
        return True
    if not primes_natively(init):
        return False

    @functools.wraps(init)
    def __init__(self: Any, tokenizer: Any, request: Any, *args: Any, **kwargs: Any) -> None:
        init(self, tokenizer, request, *args, **kwargs)
        prompt = getattr(request, "prompt_token_ids", None)
        if not isinstance(prompt, list) or len(prompt) < MIN_PROMPT or not is_pd_leg(request):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not under the API server's loop (offline LLM): left as it is
            return
        stream_type = stream_type_of(module)
        if stream_type is None:
            return
        setattr(self, _STEPPED, False)
        loop.call_later(PRIME_AFTER_S, prime, self, stream_type, prompt)

    @functools.wraps(step)
    def _protected_step(self: Any, next_token_id: int) -> Any:
        setattr(self, _STEPPED, True)
        return step(self, next_token_id)

    setattr(__init__, _MARK, True)
    setattr(cls, "__init__", __init__)  # noqa: B010 (mypy refuses assigning to a class's __init__)
    setattr(cls, TARGET_STEP, _protected_step)
    return True


def _patch(module: ModuleType) -> None:
    cls = getattr(module, TARGET_CLASS, None)
    if not isinstance(cls, type) or not wrap(cls, module):
        log.info("kvtransport: vLLM's %s.%s is not what the primer knows: P/D requests' detokenizers are not "
                 "primed (their first output decodes the whole prompt)", TARGET_MODULE, TARGET_CLASS)


def install() -> None:
    """Prime the detokenizers of P/D requests (module docstring). Idempotent; never raises."""
    on_import(TARGET_MODULE, _patch)
