"""The one module that knows which vLLM is installed: every other connector module imports vLLM names from here.

Supported: vLLM 0.24.x through 0.33.x (``SUPPORTED``). What differs inside that range, and how it is bridged:

* **Completions.** 0.32+ asks ``get_transfer_results`` and takes failed receives as ``failed_recving``;
  0.24-0.31 asks ``get_finished`` and learns of a failed receive only from the block ids it gets from
  ``get_block_ids_with_load_errors`` in the same step (``REPORTS_FAILED_RECVING``).
* **Cache-hit source** (prompt tokens by source in metrics): ``CacheHitSource.P2P`` from 0.32; older
  versions have no such attribute (``P2P_CACHE_HIT_SOURCE`` is None).
* **KV cache tensors.** Each layer's tensor may keep its block dimension first (0.32+ CPU and GPU,
  FlashInfer) or second (0.24's FlashAttention ``[2, num_blocks, block_size, heads, head_size]``):
  :func:`block_dim` finds it from the number of blocks.
* **Token #1 of the first-token flow** is appended to a decode request's prompt inside the engine, where the API
  server's detokenizer never sees it; :data:`first_token_emitter` wraps ``Scheduler.update_from_output`` (the
  same in 0.24 through 0.33) so that the request's first output carries it in front of token #2, and the
  client's text is detokenized from both, as a single instance's.
* **The connector's role** is not passed to ``requires_piecewise_for_cudagraph`` (any version):
  :func:`role_of_extra_config` finds the ``KVTransferConfig`` that owns the dict being asked about.

An unsupported vLLM fails at import with one message that names the supported range (:func:`check_version`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

SUPPORTED = ((0, 24), (0, 33))
"""Inclusive (major, minor) range of vLLM releases this connector supports."""

SUPPORTED_TEXT = "vLLM 0.24 to 0.33"


def parse_version(text: str) -> tuple[int, int]:
    """``"0.24.0"`` / ``"0.32.0+cpu"`` / ``"0.33.1rc1.dev3"`` -> (0, 24) / (0, 32) / (0, 33). Raises ValueError."""
    m = re.match(r"^\s*(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"cannot read a version from {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_version(text: str) -> tuple[int, int]:
    """The (major, minor) of ``text``; raises RuntimeError naming the supported range when outside it."""
    try:
        ver = parse_version(text)
    except ValueError:
        raise RuntimeError(f"kvtransport-vllm supports {SUPPORTED_TEXT}; cannot read the installed vLLM's "
                           f"version ({text!r})") from None
    lo, hi = SUPPORTED
    if not lo <= ver <= hi:
        raise RuntimeError(f"kvtransport-vllm supports {SUPPORTED_TEXT}; the installed vLLM is {text}. "
                           f"Install a vLLM in that range (pip install 'vllm>=0.24,<0.34'), or a kvtransport-vllm "
                           "release that supports yours")
    return ver


VLLM_VERSION = check_version(str(getattr(vllm, "__version__", "")))

KVConnectorBase_V1 = _base.KVConnectorBase_V1
SupportsHMA: Any = getattr(_base, "SupportsHMA", None)
"""vLLM's marker for connectors that take several KV cache groups (hybrid allocator); None where absent."""
KVConnectorHandshakeMetadata = _base.KVConnectorHandshakeMetadata
KVConnectorMetadata = _base.KVConnectorMetadata
KVConnectorRole = _base.KVConnectorRole
KVConnectorWorkerMetadata = _base.KVConnectorWorkerMetadata
KVConnectorTransferResults: Any = getattr(_base, "KVConnectorTransferResults", None)

REPORTS_FAILED_RECVING = KVConnectorTransferResults is not None
"""True where vLLM takes failed receives as ``failed_recving`` (0.32+); else they go as load-error block ids."""

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource

    P2P_CACHE_HIT_SOURCE: Any = _CacheHitSource.P2P
except ImportError:  # before 0.32
    P2P_CACHE_HIT_SOURCE = None


class FirstTokenEmitter:
    """Decode requests (first-token flow) whose token #1, appended to their prompt inside the engine, is to be
    reported to the API server with their first output (``new_token_ids = [#1, #2]``): its detokenizer then
    starts from #1 as a single instance's does (a UTF-8 character split across #1/#2, a stop string across
    them), and the answer counts #1 (the decode leg asks for one token fewer, so the total is the client's).

    :meth:`install` wraps ``vllm.v1.core.sched.scheduler.Scheduler.update_from_output`` once per process (the
    engine-core process of a decode); :meth:`add` / :meth:`discard` run on the scheduler thread, as does the
    wrapper. At most ``limit`` requests are held (requests in flight; the oldest go first)."""

    def __init__(self, limit: int = 65536) -> None:
        self.limit = limit
        self.pending: dict[str, int] = {}
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        from vllm.v1.core.sched.scheduler import Scheduler

        original = Scheduler.update_from_output
        emitter = self

        def update_from_output(sched: Any, scheduler_output: Any, model_runner_output: Any) -> Any:
            outputs = original(sched, scheduler_output, model_runner_output)
            if emitter.pending:
                emitter.apply(outputs)
            return outputs

        update_from_output.__wrapped__ = original  # type: ignore[attr-defined]
        Scheduler.update_from_output = update_from_output  # type: ignore[method-assign]
        self.installed = True

    def add(self, request_id: str, token: int) -> None:
        self.install()
        self.pending[request_id] = int(token)
        while len(self.pending) > self.limit:
            self.pending.pop(next(iter(self.pending)))

    def discard(self, request_id: str) -> None:
        self.pending.pop(request_id, None)

    def apply(self, outputs: Mapping[int, Any]) -> None:
        """Put each pending request's token #1 in front of the first output that carries tokens."""
        for eco in outputs.values():
            for out in getattr(eco, "outputs", None) or []:
                if out.new_token_ids and out.request_id in self.pending:
                    out.new_token_ids = [self.pending.pop(out.request_id), *out.new_token_ids]


first_token_emitter = FirstTokenEmitter()


def block_dim(shape: Sequence[int], num_blocks: int | None) -> int:
    """The dimension of a per-layer KV tensor that indexes blocks.

    vLLM keeps it first (``[num_blocks, ...]``) or, for FlashAttention before 0.32, second behind the K/V
    split (``[2, num_blocks, ...]``). ``num_blocks`` (the cache config's block count) decides; without it,
    or when it is ambiguous, the first dimension."""
    if num_blocks and len(shape) >= 2 and shape[0] != num_blocks and shape[1] == num_blocks and shape[0] == 2:
        return 1
    return 0


def role_of_extra_config(extra_config: Mapping[str, Any] | None) -> str | None:
    """The ``kv_role`` of the ``KVTransferConfig`` whose ``kv_connector_extra_config`` is ``extra_config``
    (the very object), found on the caller's stack; None when no such config is found.

    vLLM asks ``requires_piecewise_for_cudagraph(extra_config)`` from ``VllmConfig``'s set-up without the role;
    a decode instance should keep full CUDA graphs, so the role is recovered from the config being built."""
    if extra_config is None:
        return None
    frame = inspect.currentframe()
    try:
        depth = 0
        while frame is not None and depth < 16:
            for value in frame.f_locals.values():
                ktc = getattr(value, "kv_transfer_config", None)
                if ktc is not None and getattr(ktc, "kv_connector_extra_config", None) is extra_config:
                    role = getattr(ktc, "kv_role", None)
                    return str(role) if role is not None else None
            frame = frame.f_back
            depth += 1
    finally:
        del frame
    return None


__all__ = [
    "P2P_CACHE_HIT_SOURCE",
    "REPORTS_FAILED_RECVING",
    "SUPPORTED",
    "SUPPORTED_TEXT",
    "VLLM_VERSION",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "block_dim",
    "first_token_emitter",
    "check_version",
    "parse_version",
    "role_of_extra_config",
]
