"""The connector's settings (``kv_connector_extra_config`` > environment > defaults): the kvtransport naming
scheme for its environment variables (older names warn), and bad values refused with the key named."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")

from kvtransport_vllm.config import requires_layerwise, resolve_settings

pytestmark = [pytest.mark.vllm]


def test_defaults() -> None:
    s = resolve_settings(None, env={})
    assert (s.mode, s.side_channel_port, s.backend, s.ifname, s.secret) == ("push", 0, "auto", None, None)
    assert (s.transfer_timeout, s.lease, s.connect_timeout, s.admit_below) == (120.0, 30.0, 30.0, 0.5)
    assert (s.debug_push_delay, s.debug_dst_delay, s.debug_hold) == (0.0, 0.0, False)
    assert not hasattr(s, "dst_wait")  # a prefill never waits for its destination


def test_environment_uses_the_kv_transport_prefix() -> None:
    s = resolve_settings({}, env={"KV_TRANSPORT_VLLM_MODE": "PULL", "KV_TRANSPORT_VLLM_SIDE_CHANNEL_PORT": "8123"})
    assert (s.mode, s.side_channel_port) == ("pull", 8123)


def test_older_names_still_work_with_a_deprecation_warning() -> None:
    env = {"KVT_VLLM_MODE": "pull", "KVT_VLLM_SIDE_CHANNEL_PORT": "8124"}
    with pytest.warns(DeprecationWarning, match="KVT_VLLM_MODE is deprecated: set KV_TRANSPORT_VLLM_MODE"):
        s = resolve_settings({}, env=env)
    assert (s.mode, s.side_channel_port) == ("pull", 8124)
    # the new name wins over the old one; the extra config over both
    s = resolve_settings({}, env={**env, "KV_TRANSPORT_VLLM_MODE": "push", "KV_TRANSPORT_VLLM_SIDE_CHANNEL_PORT": "9"})
    assert (s.mode, s.side_channel_port) == ("push", 9)
    s = resolve_settings({"mode": "pull", "side_channel_port": 7}, env={"KV_TRANSPORT_VLLM_MODE": "push"})
    assert (s.mode, s.side_channel_port) == ("pull", 7)


@pytest.mark.parametrize("port", [-1, 65536, "abc", 1.5, "8e3", True, math.inf])
def test_a_side_channel_port_outside_the_port_range_is_refused(port: object) -> None:
    with pytest.raises(ValueError, match=r"side_channel_port must be a port number 0\.\.65535"):
        resolve_settings({"side_channel_port": port}, env={})


def test_a_bad_port_in_the_environment_is_refused() -> None:
    with pytest.raises(ValueError, match="side_channel_port must be a port number"):
        resolve_settings({}, env={"KV_TRANSPORT_VLLM_SIDE_CHANNEL_PORT": "70000"})


@pytest.mark.parametrize("key", ["transfer_timeout", "lease", "connect_timeout"])
@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "soon", None])
def test_timeouts_must_be_positive_finite_numbers(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"kv_connector_extra_config.{key} must be"):
        resolve_settings({key: value}, env={})


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode='sideways'"):
        resolve_settings({"mode": "sideways"}, env={})


def test_only_a_pushing_producer_asks_for_piecewise_cuda_graphs() -> None:
    assert requires_layerwise({}, "kv_producer") is True
    assert requires_layerwise({}, "kv_both") is True
    assert requires_layerwise({}, "kv_consumer") is False
    assert requires_layerwise({"mode": "pull"}, "kv_producer") is False


def _non_loopback_interface() -> str | None:
    from kvtransport.config import list_interfaces

    for name, addr in list_interfaces().items():
        if addr and not addr.startswith("127."):
            return name
    return None


def test_without_a_secret_the_side_channels_listen_beyond_loopback_only_when_told() -> None:
    """Issue 29: with no secret, anyone who reaches the port can claim an engine id; an interface beyond
    loopback is refused (one line naming both fixes) unless allow_open says so; with a secret it is fine."""
    from kvtransport_vllm.config import startup_problem

    from kvtransport.errors import ConfigurationError

    ifname = _non_loopback_interface()
    if ifname is None:
        pytest.skip("this machine has no interface beyond loopback")
    assert resolve_settings({}, env={}).address == "127.0.0.1"
    with pytest.raises(ConfigurationError, match=r"KV_TRANSPORT_SECRET.*KV_TRANSPORT_ALLOW_OPEN=1"):
        resolve_settings({}, env={"NET_IFNAME": ifname}).address  # noqa: B018
    problem = startup_problem({}, env={"NET_IFNAME": ifname})
    assert problem is not None and problem.startswith("ConfigurationError: NET_IFNAME=") and "\n" not in problem
    opened = resolve_settings({}, env={"NET_IFNAME": ifname, "KV_TRANSPORT_ALLOW_OPEN": "1"}).address
    assert not opened.startswith("127.")
    assert resolve_settings({"allow_open": True}, env={"NET_IFNAME": ifname}).address == opened
    assert resolve_settings({"allow_open": "yes"}, env={"NET_IFNAME": ifname}).allow_open is False  # a bool only
    assert resolve_settings({}, env={"NET_IFNAME": ifname, "KV_TRANSPORT_SECRET": "s"}).address == opened
