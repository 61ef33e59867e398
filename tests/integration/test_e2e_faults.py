"""End-to-end faults: real vLLM instances killed with SIGKILL in the middle of P/D requests, for each (backend,
device) of ``test_e2e_pd.MATRIX`` (CPU in CI; GPU variants on a GPU host, skipped elsewhere with the reason).

Instances (started once for the module, concurrently):
    P, P2  kv_producer, push mode, lease=6 s, debug_push_delay=600 s (only for requests that ask for it with
           ``kvt_debug_delay``: their final signal waits, so the transfer stays open until P is killed). P is
           killed; P2 is the prefill that the decodes turn to afterwards, and the one the decode-kill test uses
           (started with the others: a restart would cost another ~45 s of start-up on 2 cores)
    DF     kv_consumer, kv_load_failure_policy=fail
    DR     kv_consumer, kv_load_failure_policy=recompute, debug_hold (a request that asks for it with
           ``kvt_debug_hold`` is never admitted: it waits unallocated, like a decode with no room for it, while
           DR keeps renewing its lease on the prefill)

Nothing here depends on how fast the machine is: the open transfer and the waiting decode request are held by
the two test-only knobs, not by racing a sleep or a long generation (a 2-core machine once lost that race: the
"busy" decode finished its local work first, took the KV and the prefill freed its blocks early). Every
"blocks held" observation is backed by a counter that says *why* they were freed (``lease_expirations``,
``decode_disconnects``, ``prefill_disconnects``).

The tests drive the instances directly (no proxy), as the proxy would in push mode, and run in file order:
the prefill P is killed first, then the decode DR.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")
httpx = pytest.importorskip("httpx")

from .test_e2e_pd import (  # noqa: E402
    Proc,
    base_env,
    free_port,
    matrix_params,
    metrics,
    running,
    vllm_cmd,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# The prefill's lease. A live decode renews it every LEASE/3, so a renewal may come up to 2/3 LEASE late before
# the blocks are (wrongly) freed: 10 s tolerates ~6 s stalls of a decode engine on a loaded 2-core machine
# (four vLLM instances share its cores here), and gives the "still held" checks below ~7 s to look.
LEASE = float(os.environ.get("KVT_FAULT_LEASE", "10"))
PUSH_DELAY = 600.0  # "never" before the kill; the decodes' transfer_timeout (120 s) is not reached either
MAX_TOKENS = 12
USAGE = "vllm:kv_cache_usage_perc"
LEASE_EXPIRED = "vllm:kvtransport_lease_expirations_total"
DECODE_GONE = "vllm:kvtransport_decode_disconnects_total"
PREFILL_GONE = "vllm:kvtransport_prefill_disconnects_total"


def _p_cmd(model: str, port: int, device: str) -> list[str]:
    return vllm_cmd(model, port, {"kv_connector": "KVTransportConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"lease": LEASE, "debug_push_delay": PUSH_DELAY,
                                                                "connect_timeout": 10}}, device=device)


@pytest.fixture(scope="module", params=matrix_params())
def faults(request: pytest.FixtureRequest, tiny_model: str, tmp_path_factory: pytest.TempPathFactory):
    backend, device = request.param
    log_dir = Path(os.environ.get("KVT_E2E_LOG_DIR") or tmp_path_factory.mktemp("e2e-fault-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = base_env(backend, device)
    tag = f"{backend}-{device}"

    def decode(name: str, policy: str, extra: dict[str, Any]) -> Proc:
        port = free_port()
        kv = {"kv_connector": "KVTransportConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": policy,
              "kv_connector_extra_config": {"connect_timeout": 10, **extra}}
        return Proc(f"{name}-{tag}", vllm_cmd(tiny_model, port, kv, device=device), env, port, log_dir)

    p_port, p2_port = free_port(), free_port()
    procs = {"P": Proc(f"fault-prefill-{tag}", _p_cmd(tiny_model, p_port, device), env, p_port, log_dir),
             "P2": Proc(f"fault-prefill-2-{tag}", _p_cmd(tiny_model, p2_port, device), env, p2_port, log_dir),
             "DF": decode("fault-decode-fail", "fail", {}),
             "DR": decode("fault-decode-recompute", "recompute", {"debug_hold": True})}
    state: dict[str, Any] = {"procs": procs, "env": env, "log_dir": log_dir, "model": tiny_model}
    with running(procs, "faults", log_dir):
        yield state


# ---------------------------------------------------------------------- helpers
def words(seed: int, n: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 1000 + 4}" for i in range(n))


def complete(url: str, body: dict[str, Any], timeout: float = 180) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "temperature": 0, "return_token_ids": True,
                                                      **body}, timeout=timeout)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def discover(p: Proc) -> dict[str, Any]:
    r = complete(p.url, {"prompt": [1], "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True, "kvt_discover": True}})
    assert r.status_code == 200, r.text
    return dict(r.json()["kv_transfer_params"])


def prefill_leg(p: Proc, prompt: str, xfer: str, *, debug_delay: bool = False) -> httpx.Response:
    params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": xfer, "kvt_fanout": 1}
    if debug_delay:
        params["kvt_debug_delay"] = True
    return complete(p.url, {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": params})


def decode_leg(d: Proc, side: dict[str, Any], prompt: str, xfer: str, *, hold: bool = False) -> httpx.Response:
    params = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": xfer,
              "remote_host": side["kvt_host"], "remote_port": side["kvt_port"],
              "remote_engine_id": side["kvt_engine_id"]}
    if hold:
        params["kvt_debug_hold"] = True
    return complete(d.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params})


def wait_for(what: str, pred: Callable[[], bool], timeout: float, step: float = 0.25) -> float:
    """Seconds until ``pred()`` held; AssertionError naming ``what`` after ``timeout``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:g}s")
        time.sleep(step)
    return time.monotonic() - t0


def metric(p: Proc, key: str) -> float:
    return metrics(p.url).get(key, 0.0)


def grew(p: Proc, before: dict[str, float], key: str) -> float:
    """How much counter ``key`` of ``p`` grew since the snapshot ``before``."""
    return metric(p, key) - before.get(key, 0.0)


def kv_fetch(p: Proc, stage: str) -> float:
    """Decode requests in a stage of their KV fetch, from the connector's own gauges (vLLM's
    ``num_requests_kv_fetch_by_stage`` exists only from 0.32): ``waiting_to_start`` (not allocated yet) or
    ``in_progress`` (allocated, waiting for their KV)."""
    key = {"waiting_to_start": "vllm:kvtransport_recv_unallocated", "in_progress": "vllm:kvtransport_recv_in_progress"}
    return metric(p, key[stage])


def kill9(p: Proc) -> None:
    """SIGKILL the instance's whole process group (API server and engine core) and reap it."""
    os.killpg(p.proc.pid, signal.SIGKILL)
    p.proc.wait(timeout=30)


def pd_roundtrip(p: Proc, d: Proc, side: dict[str, Any], prompt: str) -> list[int]:
    """One P/D request sent the way the push proxy sends it; the decode's token ids."""
    xfer = uuid.uuid4().hex
    with ThreadPoolExecutor(2) as ex:
        fd = ex.submit(decode_leg, d, side, prompt, xfer)
        fp = ex.submit(prefill_leg, p, prompt, xfer)
        assert fp.result().status_code == 200, fp.result().text
        return tokens(fd.result())


def failed(r: httpx.Response | BaseException) -> bool:
    """An errored request: an HTTP error status or a choice that finished with ``error``."""
    if isinstance(r, BaseException):
        return True
    if r.status_code != 200:
        return True
    return any(c.get("finish_reason") == "error" for c in r.json().get("choices", []))


# ---------------------------------------------------------------------- tests
def test_prefill_killed_mid_transfer(faults: dict[str, Any]) -> None:
    """SIGKILL the prefill while two decodes wait for their KV (the layers landed, the final signal is held back
    by debug_push_delay): the decode with policy ``fail`` answers with an error, the one with ``recompute`` with
    the right tokens, both within a bound, counted as lost prefills and with no KV block left; then both serve
    fresh P/D requests from another prefill instance correctly, from transferred KV."""
    procs = faults["procs"]
    P, DF, DR = procs["P"], procs["DF"], procs["DR"]
    side = discover(P)
    pf, pr = words(1, 150), words(2, 170)
    ref_r = tokens(complete(P.url, {"prompt": pr, "max_tokens": MAX_TOKENS}))  # (policy=fail: no output to compare)
    f0, r0, p0 = metrics(DF.url), metrics(DR.url), metrics(P.url)
    xf, xr = uuid.uuid4().hex, uuid.uuid4().hex
    ex = ThreadPoolExecutor(4)
    try:
        fut_f = ex.submit(decode_leg, DF, side, pf, xf)
        fut_r = ex.submit(decode_leg, DR, side, pr, xr)
        legs = [ex.submit(prefill_leg, P, pf, xf, debug_delay=True), ex.submit(prefill_leg, P, pr, xr, debug_delay=True)]
        for leg in legs:
            assert leg.result(timeout=120).status_code == 200
        # mid-transfer: both decodes allocated their blocks and the prefill put every layer of both requests into
        # them (counted by the prefill: a one-sided receiver learns of puts only from signals, and a destination
        # that bound after the forward is put in one go, without layer signals); the final signals wait
        for d in (DF, DR):
            wait_for(f"{d.name}: allocated, receiving KV", lambda d=d: kv_fetch(d, "in_progress") >= 1, 60)  # type: ignore[misc]
        wait_for("the prefill put both requests' layers", lambda: grew(P, p0, "vllm:kvtransport_puts_total") >= 2 * 2, 60)
        assert metric(DF, USAGE) > 0 and metric(DR, USAGE) > 0
        assert not fut_f.done() and not fut_r.done(), "the transfers completed before the prefill was killed"
        kill9(P)
        t_kill = time.monotonic()
        res_f: httpx.Response | BaseException
        try:
            res_f = fut_f.result(timeout=60)
        except Exception as exc:  # any error counts as the request failing
            res_f = exc
        took_f = time.monotonic() - t_kill
        res_r = fut_r.result(timeout=120)
        took_r = time.monotonic() - t_kill
    finally:
        ex.shutdown(wait=False)
    print(f"\n[faults] prefill killed: policy=fail -> {getattr(res_f, 'status_code', res_f)} after {took_f:.1f}s, "
          f"policy=recompute -> {res_r.status_code} after {took_r:.1f}s")
    assert failed(res_f), f"policy=fail: the request should have failed, got {res_f.text}"  # type: ignore[union-attr]
    assert took_f < 30, f"policy=fail: the error took {took_f:.1f}s"
    assert tokens(res_r) == ref_r, "policy=recompute: recomputed output differs from the reference"
    assert took_r < 60, f"policy=recompute: took {took_r:.1f}s"
    for d, m0 in ((DF, f0), (DR, r0)):
        wait_for(f"{d.name} KV usage back to 0", lambda d=d: metric(d, USAGE) == 0, 30)  # type: ignore[misc]
        wait_for(f"{d.name}: the lost prefill counted", lambda d=d, m0=m0: grew(d, m0, PREFILL_GONE) >= 1,  # type: ignore[misc]
                 20)
    # the decode servers stayed healthy: fresh P/D requests through another prefill, from transferred KV
    P2 = procs["P2"]
    side = discover(P2)
    for i, d in enumerate((DF, DR)):
        prompt = words(10 + i, 120)
        ref = tokens(complete(P2.url, {"prompt": prompt, "max_tokens": MAX_TOKENS}))
        m0 = metrics(d.url)
        assert pd_roundtrip(P2, d, side, prompt) == ref, f"{d.name}: fresh P/D output differs after the prefill was killed"
        wait_for(f"{d.name} stats", lambda d=d, m0=m0: grew(d, m0, "vllm:kvtransport_transfers_received_total")  # type: ignore[misc]
                 > 0, 20)
        m1 = metrics(d.url)
        key = "vllm:prompt_tokens_by_source_total:local_compute"
        assert m1.get(key, 0) == m0.get(key, 0), f"{d.name} recomputed a prompt it should have received"
        wait_for(f"{d.name} KV usage back to 0", lambda d=d: metric(d, USAGE) == 0, 30)  # type: ignore[misc]


def test_decode_killed_holds_are_freed(faults: dict[str, Any]) -> None:
    """A prefill holding blocks for a decode that is alive but has not allocated yet keeps them past the lease
    (the decode renews it); SIGKILL that decode and the blocks are freed at once, because its side channel
    closed (counted as a decode disconnect, not a lease expiration). Blocks held for a decode that never comes
    are freed by the lease (counted). The prefill then serves a fresh P/D request correctly."""
    procs = faults["procs"]
    P, DF, DR = procs["P2"], procs["DF"], procs["DR"]
    side = discover(P)
    wait_for("prefill KV usage 0 before the test", lambda: metric(P, USAGE) == 0, 30)
    p0 = metrics(P.url)
    prompt = words(20, 200)
    ex = ThreadPoolExecutor(2)
    try:
        xfer = uuid.uuid4().hex
        fut: Future[httpx.Response] = ex.submit(decode_leg, DR, side, prompt, xfer, hold=True)
        wait_for("DR has the P/D request, unallocated", lambda: kv_fetch(DR, "waiting_to_start") >= 1, 60)
        assert prefill_leg(P, prompt, xfer).status_code == 200
        t_held = time.monotonic()
        wait_for("the prefill holds the blocks for the decode", lambda: metric(P, USAGE) > 0, 20)
        # past the lease: the live decode's renewals keep the blocks held
        time.sleep(max(0.0, t_held + LEASE * 1.5 - time.monotonic()))
        assert metric(P, USAGE) > 0, "blocks freed although the decode renewed its lease"
        assert grew(P, p0, LEASE_EXPIRED) == 0, "the lease expired although the decode renewed it"
        assert kv_fetch(DR, "waiting_to_start") >= 1 and not fut.done(), "the decode request did not stay waiting"
        kill9(DR)
        t_kill = time.monotonic()
        took = wait_for("prefill blocks freed after the decode died", lambda: metric(P, USAGE) == 0, LEASE + 20)
    finally:
        ex.shutdown(wait=False)
    wait_for("decode disconnect counted", lambda: grew(P, p0, DECODE_GONE) >= 1, 20)
    p1 = metrics(P.url)
    print(f"\n[faults] decode killed: prefill blocks freed {time.monotonic() - t_kill:.1f}s after the kill "
          f"(poll {took:.1f}s); counters {({k: p1.get(k, 0) for k in (LEASE_EXPIRED, DECODE_GONE)})}")
    # freed because the side channel closed, not because the lease ran out after the last renewal
    assert p1.get(LEASE_EXPIRED, 0) == p0.get(LEASE_EXPIRED, 0), "freed by the lease, not by the lost side channel"

    # a decode that never comes: the lease frees the blocks
    assert prefill_leg(P, words(21, 100), uuid.uuid4().hex).status_code == 200
    t_done = time.monotonic()
    # (visible until the lease expires, LEASE s after the prefill finished)
    wait_for("the prefill holds the blocks for the missing decode", lambda: metric(P, USAGE) > 0, LEASE * 0.75)
    wait_for("blocks freed by the lease", lambda: metric(P, USAGE) == 0, LEASE + 20)
    took = time.monotonic() - t_done
    wait_for("lease expiration counted", lambda: grew(P, p1, LEASE_EXPIRED) >= 1, 20)
    print(f"[faults] lease expired: blocks freed {took:.1f}s after the prefill finished (lease {LEASE:g}s)")
    assert took > LEASE / 2, f"freed after {took:.1f}s: before the lease ({LEASE:g}s) could have expired"
    assert grew(P, p1, DECODE_GONE) == 0

    # the prefill still serves fresh requests correctly
    prompt = words(22, 130)
    ref = tokens(complete(P.url, {"prompt": prompt, "max_tokens": MAX_TOKENS}))
    assert pd_roundtrip(P, DF, side, prompt) == ref
    wait_for("prefill KV usage back to 0", lambda: metric(P, USAGE) == 0, 30)
