"""Issue 29, "a bad value fails that request with a clear error": garbage ``kv_transfer_params`` are refused by
vLLM's API server with HTTP 400 naming the field (kvtransport_vllm.frontend wraps vLLM's own request check), not
HTTP 500 from the engine. The real ``InputProcessor`` of the installed vLLM is wrapped; the e2e test in
test_e2e_pd.py sends the garbage to running API servers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

import vllm.exceptions
from kvtransport_vllm import frontend
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

OURS = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="KVTransportConnector",
                                                          kv_connector_module_path=None))
BY_PATH = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="Anything",
                                                             kv_connector_module_path="kvtransport_vllm.connector"))
NIXL = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="NixlConnector",
                                                          kv_connector_module_path=None))
NONE = SimpleNamespace(kv_transfer_config=None)


def params(kv: Any) -> SamplingParams:
    return SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv})


class Reached(Exception):
    """vLLM's own validation was reached (the stand-in processor has no model config)."""


class Processor:
    """Stands in for vLLM's InputProcessor: ``_validate_params`` is what the wrapper must call on."""

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config

    def _validate_params(self, params: Any, supported_tasks: Any) -> str:
        raise Reached(supported_tasks)


@pytest.mark.parametrize("kv, field", [
    ({"do_remote_decode": True, "kvt_fanout": "2"}, "kvt_fanout"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "do_remote_decode and do_remote_prefill"),
    ({"do_remote_prefill": True, "kvt_xfer": "x", "remote_host": "h", "remote_port": 70000}, "remote_port"),
    ({"do_remote_prefill": "yes"}, "do_remote_prefill"),
    ([1, 2], "must be a JSON object"),
    ({"do_remote_decode": True, "kvt_xfer": "x" * 600}, "kvt_xfer"),
])
def test_a_refused_value_is_a_validation_error_naming_the_field(kv: Any, field: str) -> None:
    with pytest.raises(VLLMValidationError) as info:
        frontend.check_request(params(kv))
    assert info.value.parameter == "kv_transfer_params"
    assert str(info.value).startswith("kv_transfer_params refused: ") and field in str(info.value), str(info.value)
    # what vLLM's API server answers with HTTP 400: a ValueError (vLLM 0.24), a VLLMClientError (0.32)
    assert isinstance(info.value, (ValueError, getattr(vllm.exceptions, "VLLMClientError", ValueError)))


@pytest.mark.parametrize("sp", [
    params({"do_remote_decode": True, "kvt_xfer": "x", "kvt_fanout": 2}),
    params(None), params({}),
    SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, extra_args={"other": 1}), None,
])
def test_valid_or_absent_params_pass(sp: Any) -> None:
    frontend.check_request(sp)


def test_the_wrapper_checks_only_under_this_connector() -> None:
    class P(Processor):
        pass

    assert frontend.wrap(P) and frontend.wrap(P)  # idempotent: the second call finds its mark
    bad = params({"do_remote_decode": True, "kvt_fanout": 0})
    for cfg in (OURS, BY_PATH):
        with pytest.raises(VLLMValidationError, match="kvt_fanout"):
            P(cfg)._validate_params(bad, ("generate",))
        with pytest.raises(Reached):  # a valid request goes on to vLLM's own checks
            P(cfg)._validate_params(params({"do_remote_decode": True}), ("generate",))
    for cfg in (NIXL, NONE, None):  # another connector's params are its own business
        with pytest.raises(Reached):
            P(cfg)._validate_params(bad, ("generate",))
    assert not frontend.wrap(type("NoMethod", (), {}))


def test_the_plugin_wraps_vllms_input_processor_when_it_is_imported() -> None:
    """In a fresh interpreter (as ``vllm serve`` loads plugins before it imports the input processor): the plugin
    registers, then vLLM's InputProcessor is imported and found wrapped; a second install changes nothing."""
    code = textwrap.dedent("""
        import sys
        from kvtransport_vllm import frontend, plugin
        assert frontend.TARGET_MODULE not in sys.modules
        plugin.register()
        from vllm.v1.engine.input_processor import InputProcessor
        method = InputProcessor._validate_params
        assert getattr(method, frontend._MARK, False), method
        frontend.install()
        assert InputProcessor._validate_params is method
        print("wrapped", method.__wrapped__.__qualname__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "wrapped InputProcessor._validate_params", out.stdout


def test_an_already_imported_input_processor_is_wrapped_at_once() -> None:
    import vllm.v1.engine.input_processor as module

    frontend.install()
    assert getattr(module.InputProcessor._validate_params, frontend._MARK, False)
