"""nccl-specific behaviour: the link request a sender's HELLO carries (where its rendezvous store listens) is
checked before any of it reaches torch.distributed."""

from __future__ import annotations

from typing import Any

import pytest

import kvtransport as kt
from kvtransport import registry
from kvtransport.workload.caches import CacheSpec, HostCache, verify_transfer

pytestmark = pytest.mark.skipif(not registry.probe("nccl").ok, reason=f"nccl backend unavailable: {registry.probe('nccl').reason}")
SPEC = CacheSpec(num_layers=2, num_blocks=8, heads=2, block_size=4, head_dim=8, order="NHD")

ALTERED = {  # how a hostile sender alters its link request -> the field the refusal names
    "host-long": ({"store_host": "a" * 250 + ".example"}, "store_host"),
    "host-label-long": ({"store_host": "a" * 64 + ".example"}, "store_host"),
    "host-chars": ({"store_host": "127.0.0.1; rm -rf /"}, "store_host"),
    "host-empty": ({"store_host": ""}, "store_host"),
    "host-list": ({"store_host": ["127.0.0.1"]}, "store_host"),
    "host-missing": ({"store_host": None}, "store_host"),
    "port-zero": ({"store_port": 0}, "store_port"),
    "port-big": ({"store_port": 65536}, "store_port"),
    "port-negative": ({"store_port": -1}, "store_port"),
    "port-bool": ({"store_port": True}, "store_port"),
    "port-str": ({"store_port": "29500"}, "store_port"),
    "port-float": ({"store_port": 29500.0}, "store_port"),
    "prefix-path": ({"prefix": "../../etc"}, "prefix"),
    "prefix-short": ({"prefix": "abc"}, "prefix"),
    "prefix-long": ({"prefix": "a" * 65}, "prefix"),
    "prefix-upper": ({"prefix": "DEADBEEF"}, "prefix"),
    "prefix-int": ({"prefix": 12345678}, "prefix"),
}


@pytest.mark.parametrize("how", list(ALTERED))
def test_altered_nccl_link_request_is_refused_before_it_reaches_torch_distributed(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sender whose link request names a store host that is neither an IP address nor a hostname of at
    most 253 characters, a port outside 1..65535 (or not an int), or a prefix other than 8..64 hex digits is
    refused with IncompatiblePeer naming the field, before the receiver's WELCOME: the receiver never opens a
    store client (nothing connects anywhere). The genuine request still links and transfers afterwards."""
    from kvtransport_nccl import transport

    changes, field = ALTERED[how]
    clients: list[tuple[Any, ...]] = []
    real_store, real_dialer = transport.dist.TCPStore, transport._TorchDialer

    def spy_store(*args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("is_master", False):
            clients.append(args)
        return real_store(*args, **kwargs)

    class AlteringDialer(transport._TorchDialer):
        def __init__(self, tr: Any) -> None:
            super().__init__(tr)
            self.request = {k: v for k, v in {**self.request, **changes}.items() if v is not None}

    src, dst = HostCache(SPEC, fill_seed=3), HostCache(SPEC)
    with kt.open(dst.layout, backend="nccl", timeout=5) as r, kt.open(src.layout, backend="nccl", timeout=5) as s:
        monkeypatch.setattr(transport.dist, "TCPStore", spy_store)
        monkeypatch.setattr(transport, "_TorchDialer", AlteringDialer)
        with pytest.raises(kt.IncompatiblePeer, match=f"malformed nccl link request: {field} ") as info:
            s.connect(r.metadata())
        assert str(info.value).startswith("peer reported: "), info.value  # the receiver's refusal
        assert clients == [] and r.inbound_peers() == []
        monkeypatch.setattr(transport, "_TorchDialer", real_dialer)
        peer = s.connect(r.metadata())
        s.put_layers(peer, "q", None, [1, 2], [5, 6])
        s.signal(peer, "q")
        r.wait("q", timeout=20)
        assert len(clients) == 1  # the genuine request reached the store, once
    assert verify_transfer(dst, src, {0: [(1, 5), (2, 6)], 1: [(1, 5), (2, 6)]}) == []


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "fe80::1%lo", "node-7.cluster.local", "localhost", "a" * 63,
                                  ".".join(["a" * 63] * 3) + "." + "b" * 61])
def test_a_genuine_link_request_passes_the_check(host: str) -> None:
    """IP literals (v4, v6, with a zone) and hostnames up to 253 characters in labels of at most 63 pass."""
    from kvtransport_nccl.transport import link_request

    assert link_request({"store_host": host, "store_port": 65535, "prefix": "0123abcd"}) == (host, 65535, "0123abcd")
    assert link_request({"store_host": host, "store_port": 1, "prefix": "f" * 64}) == (host, 1, "f" * 64)
