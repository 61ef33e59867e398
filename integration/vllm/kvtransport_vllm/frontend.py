"""The API server's check of ``kv_transfer_params``: a request whose params the connector would refuse is answered
HTTP 400 naming the field, before it reaches the engine.

Any API client sets ``kv_transfer_params``. The engine reads them in one place
(:func:`kvtransport_vllm.metadata.parse_transfer_params`) and fails a refused request through vLLM's failure
path, which vLLM's API server answers HTTP 500 "Internal server error" (the reason only in the engine's log).
The same parse run in the API server makes it a client error: vLLM's ``InputProcessor`` validates every
request's sampling parameters there (``AsyncLLM.add_request``, the way every endpoint hands a request to the
engine) and answers its ``VLLMValidationError`` with HTTP 400 and the message; a streamed request has begun
(200) and gets the 400 as its error event. test_e2e_pd checks ``/v1/completions`` on running servers.

How: the ``vllm.general_plugins`` entry point calls :func:`install`, which wraps
``InputProcessor._validate_params`` once ``vllm.v1.engine.input_processor`` is imported (at once if it already
is). The wrapper checks only for an engine whose ``kv_transfer_config`` names this connector; under any other
connector it passes through. When vLLM has no such method (another version), nothing is wrapped and one log line
says refusals stay HTTP 500; the engine's own check is unchanged either way.

Who calls: the plugin (every vLLM process, once); vLLM's API server (the wrapper, per request; no blocking).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import CONNECTOR_NAME
from .metadata import TransferParamsError, parse_transfer_params
from .patching import on_import

log = logging.getLogger("vllm.kvtransport")

TARGET_MODULE = "vllm.v1.engine.input_processor"
TARGET_CLASS = "InputProcessor"
TARGET_METHOD = "_validate_params"
_MARK = "_kvtransport_checks_params"


def names_this_connector(vllm_config: Any) -> bool:
    """True when ``vllm_config.kv_transfer_config`` names KVTransportConnector (by name or module path)."""
    cfg = getattr(vllm_config, "kv_transfer_config", None)
    if cfg is None:
        return False
    name = getattr(cfg, "kv_connector", None)
    module = getattr(cfg, "kv_connector_module_path", None)
    return name == CONNECTOR_NAME or (isinstance(module, str) and module.startswith("kvtransport_vllm"))


def refusal(exc: TransferParamsError) -> Exception:
    """The error vLLM's API server answers with HTTP 400: its ``VLLMValidationError`` when it has one (a
    ValueError in vLLM 0.24, a VLLMClientError in 0.32), else a ValueError."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:
        return ValueError(str(exc))
    error: Exception = VLLMValidationError(str(exc), parameter="kv_transfer_params")
    return error


def check_request(params: Any) -> None:
    """Raise :func:`refusal`'s error when ``params`` (a SamplingParams) carries ``kv_transfer_params`` that
    :func:`parse_transfer_params` refuses; nothing otherwise (pooling requests, no params, valid params)."""
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict) or "kv_transfer_params" not in extra:
        return
    try:
        parse_transfer_params(extra["kv_transfer_params"])
    except TransferParamsError as exc:
        raise refusal(exc) from None


def wrap(cls: type) -> bool:
    """Wrap ``cls._validate_params`` with :func:`check_request` for engines running this connector; True if it
    is wrapped now or already was, False if ``cls`` has no such method."""
    original: Callable[..., Any] | None = getattr(cls, TARGET_METHOD, None)
    if original is None or not callable(original):
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def _validate_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if names_this_connector(getattr(self, "vllm_config", None)):
            check_request(params)
        return original(self, params, *args, **kwargs)

    setattr(_validate_params, _MARK, True)
    setattr(cls, TARGET_METHOD, _validate_params)
    return True


def _patch(module: ModuleType) -> None:
    cls = getattr(module, TARGET_CLASS, None)
    if not isinstance(cls, type) or not wrap(cls):
        log.info("kvtransport: vLLM's %s.%s.%s is not there: a request with kv_transfer_params the connector "
                 "refuses gets HTTP 500 (its reason in the engine's log) instead of 400", TARGET_MODULE,
                 TARGET_CLASS, TARGET_METHOD)


def install() -> None:
    """Make the API server refuse bad ``kv_transfer_params`` with HTTP 400 (module docstring). Idempotent; never
    raises; cheap (:func:`.patching.on_import`)."""
    on_import(TARGET_MODULE, _patch)
