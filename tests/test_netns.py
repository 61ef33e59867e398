"""Two hosts on one machine (network namespaces joined by a veth pair, kvtransport.workload.netns): NET_IFNAME
for real, every listener bound to that interface only, the TCP path named, and a network partition.

Needs root and iproute2 (CI runs as root); elsewhere every test here skips with the reason.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from kvtransport import registry
from kvtransport.workload import netns
from kvtransport.workload.harness import run_pair

pytest.importorskip("numpy")
REASON = netns.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
BACKENDS = ["ucx", "nccl"]
TYPED = {"TransferTimeout", "PeerDisconnected"}


def _need(backend: str) -> None:
    if not any(b.name == backend and b.available for b in registry.available_backends()):
        pytest.skip(f"{backend} backend unavailable")


@pytest.fixture
def net() -> Iterator[netns.Network]:
    """Hosts a, b (linked) and c (linked to a's second interface); removed after the test, even on failure."""
    netns.remove_stale()
    with netns.two_hosts(third=True) as network:
        yield network
    assert network.leftovers() == []


def _hosts(net: netns.Network) -> dict[str, Any]:
    return {"receiver": net.host("a"), "sender": net.host("b")}


def _assert_own_hosts(results: dict[str, dict[str, Any]], hosts: dict[str, Any]) -> None:
    """Each role process saw its host's hostname from inside, in UTS and network namespaces of its own."""
    for role, r in results.items():
        assert r["hostname"] == hosts[role].hostname != socket.gethostname(), (role, r["hostname"])
    for key, ns in (("uts_ns", "uts"), ("net_ns", "net")):
        seen = {r[key] for r in results.values()}
        assert len(seen) == len(results) and os.readlink(f"/proc/self/ns/{ns}") not in seen, (ns, seen)


@pytest.mark.timeout(60)
def test_network_is_built_and_torn_down_even_when_the_body_fails() -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="body failed"), netns.two_hosts(third=True) as network:
        a, b, c = (network.host(n) for n in "abc")
        names = [*network.namespaces.values(), *network.veths]
        assert a.address == "198.18.0.1" and b.address == "198.18.0.2" and c.address == "198.18.1.2"
        assert [addr for _, addr in a.interfaces] == ["198.18.0.1", "198.18.1.1"]
        assert network.host("a", via="c").ifname == a.interfaces[1][0] != a.ifname
        assert network.host("a", via="c").address == "198.18.1.1" and network.host("a", via="b") == a
        with pytest.raises(ValueError, match="no link"):
            network.host("b", via="c")
        assert len({a.hostname, b.hostname, c.hostname}) == 3
        # b reaches a over the veth (refused: nothing listens, but the SYN got there), c cannot reach the a-b net
        assert netns.connect_error(b, a.address, 9) == "ConnectionRefusedError"
        assert netns.connect_error(c, b.address, 9) in ("OSError", "TimeoutError")  # ENETUNREACH: no route
        raise RuntimeError("body failed")
    assert len(names) == 7 and network.leftovers() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    for name in names:
        assert name not in listed and name not in links, name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("iface", ["first", "second"])
def test_transfers_between_two_hosts_use_net_ifname_only(net: netns.Network, backend: str, iface: str) -> None:
    """``first``: the receiver (host a) uses its first interface, towards b. ``second``: NET_IFNAME names a's
    second interface, towards c, and the peer is c; a build that binds the first non-loopback interface
    instead of NET_IFNAME passes ``first`` but fails here (c has no route to a's first interface)."""
    _need(backend)
    peer, third = ("b", "c") if iface == "first" else ("c", "b")
    hosts = {"receiver": net.host("a", via=peer), "sender": net.host(peer)}
    cfg = {"backend": backend, "num_blocks": 48, "n_seqs": 3, "seed": 21, "order": "NHD",
           "hosts": hosts, "third": net.host(third), "options": {"timeout": 20.0}}
    rx, tx = run_pair("kvtransport.testing.twohost.bound_receiver", "kvtransport.testing.twohost.bound_sender",
                      cfg, timeout=100, hosts=hosts)
    assert rx["problems"] == []
    if backend == "nccl":  # two-sided: the receiver counts what it received (one-sided puts are not seen)
        assert rx["bytes_received"] == tx["bytes_sent"] > 0
    assert rx["slots_in_use"] == 0
    ifname_a, ifname_b = hosts["receiver"].ifname, hosts["sender"].ifname
    # the TCP lane, over the sender's NET_IFNAME, reported as the slow path
    want = {"ucx": f"ucx tcp via {ifname_b} (slow path)", "nccl": f"gloo tcp via {ifname_b} (slow path)"}[backend]
    assert tx["paths"] == [want] and tx["path"] == want
    for role, report, host in (("receiver", rx["binding"], hosts["receiver"]), ("sender", tx["binding"], hosts["sender"])):
        assert report["ifname"] == host.ifname and report["address"] == host.address
        # side channel + the backend's sockets (UCX's TCP iface; gloo's pair, the rendezvous store on the sender)
        assert len(report["listeners"]) >= 2, report
        assert {addr for addr, _ in report["listeners"]} == {host.address}, f"{role} listens beyond NET_IFNAME: {report}"
        assert report["probes"] and set(report["probes"].values()) == {"ConnectionRefusedError"}, report["probes"]
    # the receiver's other interface (towards the third host) was tried for every listener too
    assert sum(f"from host {third}" in k for k in rx["binding"]["probes"]) == len(rx["binding"]["listeners"])
    assert ifname_a != ifname_b
    # the case tells NET_IFNAME from "the first interface that is not loopback" (as the role sees them)
    a_first, a_second = (i for i, _ in hosts["receiver"].interfaces)
    assert rx["binding"]["first_interface"] == a_first
    assert ifname_a == (a_first if iface == "first" else a_second)
    assert hosts["receiver"].address == ("198.18.0.1" if iface == "first" else "198.18.1.1")
    _assert_own_hosts({"receiver": rx["binding"], "sender": tx["binding"]}, hosts)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_partition_mid_stream_ends_every_wait_in_bound_and_recovers(net: netns.Network, backend: str) -> None:
    _need(backend)
    hosts = _hosts(net)
    bound = 2.0
    cfg = {"backend": backend, "num_blocks": 160, "seed": 7, "pre": 1, "mid": 4, "post": 1, "re": 2,
           "wait_timeout": bound, "flush_timeout": bound, "stale_link_bound": 30.0, "hosts": hosts,
           "options": {"timeout": bound}}
    rx, tx = run_pair("kvtransport.testing.twohost.partition_receiver", "kvtransport.testing.twohost.partition_sender",
                      cfg, timeout=130, hosts=hosts,
                      at_barrier={"partition": lambda: net.set_link("a", "b", up=False),
                                  "heal": lambda: net.set_link("a", "b", up=True)})
    # every wait ended within its bound: landed before the cut, or a typed error
    for seq, w in rx["waits"].items():
        for r in (w, w["layer0"]):
            assert r["seconds"] <= bound + 1.0, (seq, r)
            assert r["error"] is None or r["error"] in TYPED, (seq, r)
    assert rx["waits"]["post-0"]["error"] in TYPED  # issued after the cut: can never land
    assert tx["flush"]["error"] in TYPED and tx["flush"]["seconds"] <= bound + 1.0, tx["flush"]
    assert tx["post_puts"]["error"] in (None, *TYPED) and tx["post_puts"]["seconds"] <= bound + 1.0, tx["post_puts"]
    assert tx["disconnect"]["error"] is None and tx["disconnect"]["seconds"] <= bound + 5.0, tx["disconnect"]
    # nothing leaked: no slot, no link
    assert rx["slots_after_release"] == cfg["pre"] and rx["slots_in_use"] == 0, (rx, tx)  # pre-* held until verified
    assert tx["outbound_after_disconnect"] == 0
    assert rx["inbound_peers"] == 1 and tx["outbound_peers"] == 1, (rx, tx)
    # the receiver counts one failure per lost link that had sequences in flight: the old link, once, exactly
    # when the cut failed a sequence it was waiting for (PeerDisconnected). ucx is one-sided: the receiver
    # takes no part in the data path, so nothing breaks on its side during the cut (keepalive needs ~25 s)
    # and every wait times out; nccl's receiver runs gloo recvs, and one in progress at the cut times out.
    # Nothing is counted after the heal: the old link ends with no sequence in flight.
    lost = any(r["error"] == "PeerDisconnected" for w in rx["waits"].values() for r in (w, w["layer0"]))
    if backend == "ucx":
        assert not lost, rx["waits"]
    assert rx["failures_before_heal"] == (1 if lost else 0), (rx["failures_before_heal"], rx["waits"])
    assert rx["failures"] == rx["failures_before_heal"], rx
    _assert_own_hosts({"receiver": rx, "sender": tx}, hosts)
    # recovered: a new connect over the healed link, and its transfers verify byte for byte
    assert rx["problems"] == []
    assert tx["paths"] == [tx["path"]] and "slow path" in tx["path"]
    assert os.environ.get("NET_IFNAME") is None  # the roles set it in their own processes only


@pytest.mark.timeout(300)
def test_bench_netns_measures_backends_next_to_a_raw_tcp_stream(tmp_path: Any) -> None:
    """``kvtransport bench --netns``: every pair runs between the two hosts, with the raw TCP stream of the same
    bytes over the same veth as a baseline (speed is not asserted here: docs/benchmarks.md has the figures)."""
    pytest.importorskip("torch")
    import json
    import sys

    out = str(tmp_path / "bench")
    netns.remove_stale()
    proc = subprocess.run([sys.executable, "-m", "kvtransport.cli", "bench", "--netns", "--device", "cpu", "--backends",
                           "ucx", "--workloads", "kv", "--presets", "llama-3.1-8b", "--tokens", "128", "--patterns",
                           "random", "--reps-scale", "0.2", "--quiet-wait-s", "0", "--no-nixl", "--out", out],
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert netns.stale_namespaces() == []  # the bench removed its hosts
    with open(os.path.join(out, "results.json")) as f:
        result = json.load(f)
    assert not result["errors"], result["errors"]
    hosts = result["netns"]
    assert hosts["receiver"]["address"] == "198.18.0.1" and hosts["sender"]["address"] == "198.18.0.2"
    systems = {r["system"] for r in result["rows"]}
    used = [b["name"] for b in result["backends"] if b["used"] == "yes"]
    assert used == ["ucx"]
    assert {"tcp stream", "torch.distributed/gloo", *(f"kvtransport/{b}" for b in used)} <= systems
    for b in used:  # each backend crossed the veth by TCP
        assert result["paths"][b].endswith(f"via {hosts['sender']['ifname']} (slow path)"), result["paths"]
    assert result["paths"]["tcp"] == "tcp 198.18.0.2 -> 198.18.0.1"
    # Mooncake's transfer engine (scripts/setup.sh installs it) crossed the same veth
    assert "mooncake" in systems and result["paths"]["mooncake"] == "mooncake TCP (P2P handshake) 198.18.0.2 -> 198.18.0.1"
    assert all(r["verified"] for r in result["rows"])
    assert "Between two hosts" in proc.stdout
