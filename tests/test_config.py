"""Configuration rules: typed options of open(), strict booleans, one naming scheme, deprecated names."""

from __future__ import annotations

import warnings

import pytest

import kvtransport as kt
from kvtransport import config, registry
from kvtransport.backend import Availability, BackendSpec
from kvtransport.config import env_bool, env_float, env_int, parse_bool, read_env, resolve
from kvtransport.workload.caches import HostCache, preset

LAYOUT = HostCache(preset("llama-3.1-8b", 4)).layout


@pytest.mark.parametrize("word", ["1", "true", "True", "YES", "on", " On "])
def test_true_words(word):
    assert parse_bool("X", word) is True
    assert env_bool("X", False, env={"X": word}) is True


@pytest.mark.parametrize("word", ["0", "false", "FALSE", "no", "off", "Off\n"])
def test_false_words(word):
    assert parse_bool("X", word) is False
    assert env_bool("X", True, env={"X": word}) is False


@pytest.mark.parametrize("word", ["2", "enable", "y", "nope", "t", "1.0", "-1", "of"])
def test_anything_else_is_a_configuration_error_naming_the_variable(word):
    with pytest.raises(kt.ConfigurationError) as info:
        env_bool("KV_TRANSPORT_CHECKSUM", False, env={"KV_TRANSPORT_CHECKSUM": word})
    assert str(info.value) == (f"KV_TRANSPORT_CHECKSUM={word!r} is not a boolean: use one of 1, true, yes, on "
                               "or 0, false, no, off")


def test_unset_or_blank_is_the_default():
    assert env_bool("X", True, env={}) is True
    assert env_bool("X", False, env={"X": ""}) is False
    assert env_bool("X", True, env={"X": "  "}) is True
    assert env_int("X", 7, env={"X": ""}) == 7
    assert env_float("X", 2.5, env={}) == 2.5


def test_numbers_are_parsed_or_refused_by_name():
    assert env_int("N", 0, env={"N": "12"}) == 12
    with pytest.raises(kt.ConfigurationError, match=r"^N='1.5' is not an integer$"):
        env_int("N", 0, env={"N": "1.5"})
    with pytest.raises(kt.ConfigurationError, match=r"^T='soon' is not a number of seconds$"):
        env_float("T", 1.0, env={"T": "soon"}, unit="number of seconds")


def test_open_refuses_garbage_booleans_it_used_to_read_as_false(monkeypatch):
    monkeypatch.setenv("KV_TRANSPORT_CHECKSUM", "enabled")  # was silently "off"
    with pytest.raises(kt.ConfigurationError, match="KV_TRANSPORT_CHECKSUM='enabled' is not a boolean"):
        kt.open(LAYOUT, backend="inproc")
    monkeypatch.delenv("KV_TRANSPORT_CHECKSUM")
    monkeypatch.setenv("KV_TRANSPORT_DOORBELL", "disabled")  # was silently "on"
    with pytest.raises(kt.ConfigurationError, match="KV_TRANSPORT_DOORBELL='disabled'"):
        kt.open(LAYOUT, backend="inproc")


def test_every_core_option_reads_its_variable_and_an_argument_wins():
    env = {"KV_TRANSPORT_CAPACITY": "5", "KV_TRANSPORT_TIMEOUT": "7.5", "KV_TRANSPORT_PORT": "0",
           "KV_TRANSPORT_COALESCE": "off", "KV_TRANSPORT_CHECKSUM": "yes", "KV_TRANSPORT_DOORBELL": "no",
           "KV_TRANSPORT_SECRET": "s"}
    s = resolve(env=env)
    assert (s.capacity, s.timeout, s.port, s.coalesce, s.checksum, s.doorbell, s.secret) == (
        5, 7.5, 0, False, True, False, b"s")
    s = resolve(env=env, capacity=9, timeout=1.0, coalesce=True, checksum=False, doorbell=True, secret=b"t")
    assert (s.capacity, s.timeout, s.coalesce, s.checksum, s.doorbell, s.secret) == (9, 1.0, True, False, True, b"t")
    assert set(config.CORE_OPTIONS) == {"capacity", "timeout", "port", "secret", "coalesce", "checksum", "doorbell"}


@pytest.mark.parametrize(("option", "value"), [("capacity", "10"), ("capacity", True), ("capacity", 2.0),
                                               ("port", "80"), ("coalesce", 1), ("checksum", "yes"),
                                               ("doorbell", "off"), ("secret", 5)])
def test_core_options_are_typed(option, value):
    with pytest.raises(kt.ConfigurationError, match=f"^{option}"):
        resolve(env={}, **{option: value})


def test_a_misspelt_option_names_the_closest_valid_one():
    with pytest.raises(kt.ConfigurationError) as info:
        kt.open(LAYOUT, backend="inproc", capacty=10)
    assert str(info.value) == ("kvtransport.open() with backend inproc: unknown option 'capacty' (did you mean "
                               "'capacity'?); valid options: backend, capacity, checksum, coalesce, doorbell, ifname, "
                               "port, secret, timeout")
    with pytest.raises(kt.ConfigurationError, match=r"unknown option 'zzz'; valid options"):
        kt.open(LAYOUT, backend="inproc", zzz=1)


def test_backend_options_are_checked_against_the_declared_ones():
    class Declared(BackendSpec):
        name = "declared"
        options = ("strategy",)

        def probe(self):
            return Availability(True)

        def create(self, layout, settings):
            raise AssertionError("not reached")

    registry.check_options(Declared(), ["strategy"])
    with pytest.raises(kt.ConfigurationError, match=r"unknown option 'strategi' \(did you mean 'strategy'\?\)"):
        registry.check_options(Declared(), ["strategi"])
    Declared.options = None  # undeclared: the backend itself judges its options
    registry.check_options(Declared(), ["anything"])


def test_old_names_work_and_warn_new_names_win():
    env = {"KVTRANSPORT_UCX_LIBDIR": "/old"}
    with pytest.warns(DeprecationWarning, match="KVTRANSPORT_UCX_LIBDIR is deprecated: set KV_TRANSPORT_UCX_LIBDIR"):
        assert read_env("KV_TRANSPORT_UCX_LIBDIR", deprecated=["KVTRANSPORT_UCX_LIBDIR"], env=env) == "/old"
    env["KV_TRANSPORT_UCX_LIBDIR"] = "/new"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_env("KV_TRANSPORT_UCX_LIBDIR", deprecated=["KVTRANSPORT_UCX_LIBDIR"], env=env) == "/new"
    with pytest.warns(DeprecationWarning), pytest.raises(kt.ConfigurationError, match=r"^OLD_FLAG='maybe'"):
        env_bool("NEW_FLAG", False, deprecated=["OLD_FLAG"], env={"OLD_FLAG": "maybe"})


def test_ucx_knobs_follow_the_scheme(monkeypatch):
    _ucp = pytest.importorskip("kvtransport_ucx._ucp")
    monkeypatch.setenv("KVTRANSPORT_UCX_NO_C_HELPER", "1")
    with pytest.warns(DeprecationWarning, match="set KV_TRANSPORT_UCX_NO_C_HELPER"):
        assert _ucp.env_flag("NO_C_HELPER") is True
    monkeypatch.setenv("KV_TRANSPORT_UCX_ALLOW_UNVERIFIED", "perhaps")
    with pytest.raises(kt.ConfigurationError, match="KV_TRANSPORT_UCX_ALLOW_UNVERIFIED='perhaps'"):
        _ucp.check_environment()  # what UcxTransport calls at open()


def test_test_only_backends_are_usable_but_not_listed():
    assert "inproc" not in [r.name for r in kt.available_backends()]
    assert "inproc" in [r.name for r in kt.available_backends(include_test_only=True)]
    assert registry.get_spec("inproc").test_only
    with pytest.raises(kt.UnknownBackend) as info:
        registry.get_spec("inprocc")
    assert "inproc" not in str(info.value).split("installed: ")[1].split(")")[0]
    assert "did you mean 'inproc'?" in str(info.value)


def test_auto_takes_the_best_usable_backend_and_probes_no_further(monkeypatch):
    probed = []

    class Fake(BackendSpec):
        def __init__(self, name, priority, ok, test_only=False):
            self.name, self.priority, self.ok, self.test_only = name, priority, ok, test_only

        def probe(self):
            probed.append(self.name)
            return Availability(self.ok, "" if self.ok else "cannot")

        def create(self, layout, settings):
            raise AssertionError("not reached")

    fakes = {"fast": Fake("fast", 30, False), "mid": Fake("mid", 20, True), "slow": Fake("slow", 10, True),
             "testing": Fake("testing", 99, True, test_only=True)}
    monkeypatch.setattr(registry, "_specs", lambda: fakes)
    registry.probe.cache_clear()
    try:
        assert registry.choose("auto", "cpu").name == "mid"
        assert probed == ["fast", "mid"]  # "slow" (whose probe may import torch) was never probed
    finally:
        registry.probe.cache_clear()


def test_open_and_resolve_offer_the_same_typed_options():
    """open() repeats resolve()'s keyword options so that each is typed where users call it; they must not drift."""
    import inspect

    def options(fn):
        return [(p.name, p.annotation, p.default) for p in inspect.signature(fn).parameters.values()
                if p.kind is inspect.Parameter.KEYWORD_ONLY or p.name in ("backend", "ifname")]

    assert options(kt.open) == options(resolve)
    assert {name for name, _, _ in options(kt.open)} == {"backend", "ifname", *config.CORE_OPTIONS}
