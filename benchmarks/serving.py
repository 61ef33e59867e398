"""Serving benchmark: time to first token of a P/D pair against a single vLLM instance, driven by vLLM's own
``vllm bench serve`` client (random dataset), on one GPU host.

Every configuration runs in the same session on the same GPU (instances share it; each gets a fixed KV cache):

    single         one plain ``vllm serve`` instance (the baseline; it runs throughout)
    push-mscclpp   kvtransport P/D, layer-wise push (default settings), KV_TRANSPORT=mscclpp, kvtransport-proxy
                   (default settings: the first token comes from the prefill, Splitwise's order)
    push-mscclpp-decode-first   the same instances, but the decode samples the first token (vLLM's own order:
                   kvtransport-proxy --first-token decode)
    pull-mscclpp   the same instances, pull flow (kvtransport-proxy --mode pull)
    push-ucx       kvtransport P/D, layer-wise push, KV_TRANSPORT=ucx
    push-ucx-syncdecode   the ucx prefill with a decode of its own started with ``--no-async-scheduling`` (is the
                   decode's asynchronous scheduling what puts a step between the KV landing and its first
                   forward? the second token tells; also ``push-mscclpp-syncdecode``)
    nixl           vLLM's NixlConnector (kv_both on both sides) behind a NIXL-style toy proxy (prefill first)
    single-again   the baseline once more at the end (drift over the session)

Model: a Llama-3.1-8B-shaped model (its published config, bf16), weights from ``--load-format dummy``, a
WordLevel tokenizer of 128,256 words made here so that random prompts round-trip. CUDA graphs and
torch.compile on (no ``--enforce-eager``).

    python benchmarks/serving.py make-model DIR
    python benchmarks/serving.py run --model DIR --out OUT [--configs ...] [--wait-for FILE]
    python benchmarks/serving.py report OUT/serving.json --out OUT

The single instance and the mscclpp and ucx pairs start together (five instances fit one H200) and are measured
one configuration at a time; then the two pairs stop and the NixlConnector pair starts. ``OUT/serving.json``
holds, per configuration and setting, the ``vllm bench serve`` results (TTFT, ITL, E2EL percentiles) and the
connector metrics that moved during the run (transfer time per request, share pushed layer-wise, admission
waits; NIXL's transfer times) and, for kvtransport configurations, where each request's time went: the instances
and the proxy record per-request milestones (``KV_TRANSPORT_VLLM_TRACE``, ``OUT/trace``) and
:func:`breakdown` turns those of each run into median segments (proxy, prefill intake, admission wait, forward,
answer path; for the second token: the KV's landing and the decode's first output). Logs go to ``OUT/logs``. ``report`` turns the JSON files into a Markdown table and a plot (runs anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODEL_NAME = "llama8b"

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B config.json (published)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}

SETTINGS = [  # (name, input tokens, output tokens, prompts, max concurrency)
    ("2k-c1", 2048, 64, 40, 1),  # 40 prompts: a p50 the target (3% of ~57 ms) can be read from
    ("8k-c1", 8192, 64, 16, 1),
    ("2k-c4", 2048, 64, 32, 4),
]

KVT_METRICS = {  # Prometheus name -> key (summed over label sets)
    "vllm:kvtransport_transfer_seconds_sum": "hold_s_sum", "vllm:kvtransport_transfer_seconds_count": "hold_n",
    "vllm:kvtransport_transfers_layerwise_total": "layerwise", "vllm:kvtransport_transfers_whole_total": "whole",
    "vllm:kvtransport_transfers_received_total": "received", "vllm:kvtransport_transfer_failures_total": "failures",
    "vllm:kvtransport_dst_bound_before_total": "bound_before", "vllm:kvtransport_dst_bound_during_total": "bound_during",
    "vllm:kvtransport_dst_bound_after_total": "bound_after",
    "vllm:kvtransport_bytes_received_total": "bytes_received",
    "vllm:nixl_xfer_time_seconds_sum": "nixl_xfer_s_sum", "vllm:nixl_xfer_time_seconds_count": "nixl_xfer_n",
    "vllm:nixl_post_time_seconds_sum": "nixl_post_s_sum",
    "vllm:nixl_num_failed_transfers_total": "nixl_failures",
    "vllm:prompt_tokens_by_source_total": "prompt_tokens_by_source",
    # vLLM's own request metrics, read on the instance that computed the prompt (the single instance or the
    # prefill) so that both sides of a comparison have the same segments: arrival at the engine client -> first
    # token, queued -> scheduled, scheduled -> first token
    "vllm:time_to_first_token_seconds_sum": "engine_ttft_s_sum", "vllm:time_to_first_token_seconds_count": "engine_ttft_n",
    "vllm:request_queue_time_seconds_sum": "queue_s_sum", "vllm:request_queue_time_seconds_count": "queue_n",
    "vllm:request_prefill_time_seconds_sum": "prefill_s_sum", "vllm:request_prefill_time_seconds_count": "prefill_n",
}
ENGINE_SEGMENTS = (("engine_ttft", "engine_ttft_s_sum", "engine_ttft_n"), ("queue", "queue_s_sum", "queue_n"),
                   ("prefill", "prefill_s_sum", "prefill_n"))


# ---------------------------------------------------------------------------------------------- model
def make_model(path: Path) -> Path:
    """The Llama-3.1-8B config and a WordLevel tokenizer of its vocabulary size (``w0`` ... ``w128255``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_31_8B, indent=1))
    vocab = {f"w{i}": i for i in range(LLAMA_31_8B["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w128000", eos_token="w128001", unk_token="w0")
    fast.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 128000, "eos_token_id": 128001}))
    return path


# ---------------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A background process (own session, log file); ``stop`` ends its whole process group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, logs: Path,
                 health: str = "/health") -> None:
        self.name, self.port, self.health = name, port, health
        self.url = f"http://127.0.0.1:{port}"
        self.log = logs / f"{name}.log"
        self._fh = open(self.log, "wb")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started = time.monotonic()
        self.ready_after: float | None = None

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; last lines:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + self.health, timeout=2) as r:
                ok = r.status == 200
        except OSError:
            return False
        if ok and self.ready_after is None:
            self.ready_after = time.monotonic() - self.started
        return ok

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

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


def wait_ready(servers: list[Server], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        if time.monotonic() > deadline:
            raise RuntimeError("not ready in time: " + "; ".join(f"{s.name}:\n{s.tail(15)}" for s in pending))
        pending = [s for s in pending if not s.ready()]
        time.sleep(2)


SYNC_DECODE = "-syncdecode"
"""A configuration suffix: the pair's prefill with a decode started with ``--no-async-scheduling``."""


def vllm_server(name: str, model: Path, kv: dict[str, Any] | None, env: dict[str, str], logs: Path,
                kv_bytes: int, extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--load-format", "dummy", "--dtype", "bfloat16", "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "10240", "--max-num-seqs", "16", "--seed", "0",
           "--gpu-memory-utilization", "0.15", "--kv-cache-memory-bytes", str(kv_bytes)]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return Server(name, [*cmd, *extra], env, port, logs)


def proxy_server(name: str, prefill: Server, decode: Server, mode: str, env: dict[str, str], logs: Path,
                 first_token: str = "prefill", trace_dir: Path | None = None) -> Server:
    port = free_port()
    if mode == "nixl":
        cmd = [sys.executable, str(REPO / "tests" / "integration" / "toy_proxy.py"), "--port", str(port),
               "--prefiller-port", str(prefill.port), "--decoder-port", str(decode.port)]
        return Server(name, cmd, env, port, logs, health="/healthcheck")
    cmd = [sys.executable, "-m", "kvtransport_vllm.proxy", "--port", str(port), "--prefill", prefill.url,
           "--decode", decode.url, "--mode", mode, "--log-level", "warning", "--first-token", first_token]
    if trace_dir is not None:
        cmd += ["--trace", str(trace_dir)]
    return Server(name, cmd, env, port, logs)


def base_env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VLLM_USE_FLASHINFER_SAMPLER="0")
    env.setdefault("CUDA_VISIBLE_DEVICES", "0")
    env.pop("NET_IFNAME", None)
    return env


# ---------------------------------------------------------------------------------------------- metrics
_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def scrape(url: str) -> dict[str, float]:
    """Our and NIXL's connector metrics (summed over labels; prompt tokens by source kept per source)."""
    out: dict[str, float] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        m = _METRIC.match(line)
        if not m or m.group(1) not in KVT_METRICS:
            continue
        key = KVT_METRICS[m.group(1)]
        if key == "prompt_tokens_by_source":
            src = re.search(r'source="([a-z_]+)"', m.group(2) or "")
            key = f"prompt_tokens_{src.group(1) if src else 'unknown'}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def moved(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 6) for k, v in after.items() if v - before.get(k, 0.0)}


# ---------------------------------------------------------------------------------------------- bench
def client(url: str, model: Path, label: str, settings: list[str], watch: list[str], out: Path) -> dict[str, Any]:
    """Runs in its own process (``serving.py client``): ``vllm bench serve`` (vLLM's own client, random dataset)
    for each setting in turn against ``url``, in this one interpreter (vLLM is imported once, not per run), with
    the connector metrics of the ``watch`` instances scraped around each run. Writes and returns the results."""
    import argparse as _argparse

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    results: dict[str, Any] = {}
    (out / "raw").mkdir(parents=True, exist_ok=True)
    for setting in [s for s in SETTINGS if s[0] in settings]:
        name, isl, osl, prompts, conc = setting
        fname = f"{label}-{name}.json"
        parser = _argparse.ArgumentParser()
        add_cli_args(parser)
        args = parser.parse_args([
            "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", MODEL_NAME,
            "--tokenizer", str(model), "--dataset-name", "random", "--random-input-len", str(isl),
            "--random-output-len", str(osl), "--num-prompts", str(prompts), "--max-concurrency", str(conc),
            "--ignore-eos", "--seed", "0", "--num-warmups", "2", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed", "--result-dir",
            str(out / "raw"), "--result-filename", fname, "--disable-tqdm", "--ready-check-timeout-sec", "60"])
        before = {w: scrape(w) for w in watch}
        t0 = time.monotonic()
        res: dict[str, Any]
        try:
            data = bench_main(args)
            res = {k: v for k, v in data.items() if not isinstance(v, (list, dict))}
            res["ttfts_ms"] = [round(1000 * t, 3) for t in data.get("ttfts") or []]
        except Exception as exc:  # recorded; the other settings still run
            res = {"error": f"{type(exc).__name__}: {exc}"}
        time.sleep(3)  # connector stats reach Prometheus with the next engine steps / logging interval
        res["connector"] = {w: moved(scrape(w), before[w]) for w in watch}
        res["wall_s"] = round(time.monotonic() - t0, 1)
        res["window"] = [t0, time.monotonic()]  # this host's monotonic clock: the trace lines of this run
        results[name] = res
        print(f"[serving] {label} {name}: TTFT p50 {res.get('median_ttft_ms')} ms, p99 {res.get('p99_ttft_ms')} "
              f"ms, ITL p50 {res.get('median_itl_ms')} ms {res.get('error', '')}", flush=True)
    (out / f"client-{label}.json").write_text(json.dumps(results, indent=1))
    return results


def run_config(label: str, url: str, model: Path, watch: list[Server], out: Path, settings: list[str]) -> dict[str, Any]:
    """One configuration: ``serving.py client`` in a child process, bounded in time; its results."""
    names = {w.url: w.name for w in watch}
    cmd = [sys.executable, str(Path(__file__).resolve()), "client", "--url", url, "--model", str(model), "--label",
           label, "--settings", ",".join(settings), "--out", str(out)]
    if watch:
        cmd += ["--watch", ",".join(names)]
    try:
        with open(out / "logs" / f"client-{label}.log", "wb") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=base_env(), check=True, timeout=900)
        results: dict[str, Any] = json.loads((out / f"client-{label}.json").read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        return {s: {"error": f"client failed: {type(exc).__name__}: {exc}"} for s in settings}
    for res in results.values():  # instance URLs -> names
        res["connector"] = {names.get(k, k): v for k, v in res.get("connector", {}).items()}
        print(f"[serving] {label}: TTFT p50 {res.get('median_ttft_ms')} ms {res.get('error', '')}", flush=True)
    return results


def run_all(model: Path, out: Path, configs: list[str], kv_gib: float, wait_for: Path | None,
            rounds: int = 1) -> dict[str, Any]:
    """Every configuration in one session on one GPU. The single instance runs throughout; the mscclpp and ucx
    pairs start beside it (five instances), are measured, stopped, and the NixlConnector pair takes their place.
    ``wait_for``: start the instances at once but measure nothing before that file exists (another job still
    shares the GPU). ``rounds``: the single instance and the kvtransport configurations are measured that many
    times, interleaved (single, push, ..., single, push, ...); round ``k`` > 1 is stored as ``label#k``, so a
    configuration can be judged against the baseline of its own round (:func:`paired`)."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = base_env()
    kv_bytes = int(kv_gib * (1 << 30))
    names = [s[0] for s in SETTINGS]
    kvt = {"kv_connector": "KVTransportConnector", "kv_connector_module_path": "kvtransport_vllm.connector"}
    single = vllm_server("single", model, None, env, logs, kv_bytes)
    result: dict[str, Any] = {"phase": "gpu", "started": time.strftime("%Y-%m-%d %H:%M:%S"), "configs": {},
                              "settings": SETTINGS, "kv_cache_gib_per_instance": kv_gib, "ready_after_s": {}}
    running: list[Server] = [single]

    def start_pairs(backends: list[str]) -> dict[str, tuple[Server, Server]]:
        """A prefill and a decode per backend; with a ``-syncdecode`` configuration of that backend also a decode
        started with ``--no-async-scheduling`` (pairs key ``<backend>-syncdecode``: the same prefill)."""
        pairs = {}
        for backend in backends:
            if backend == "nixl":
                nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
                p = vllm_server("prefill-nixl", model, nixl, dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
                                logs, kv_bytes)
                d = vllm_server("decode-nixl", model, nixl, dict(env, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())),
                                logs, kv_bytes)
            else:
                e = dict(env, KV_TRANSPORT=backend, KV_TRANSPORT_VLLM_TRACE=str(out / "trace" / backend))
                p = vllm_server(f"prefill-{backend}", model, {**kvt, "kv_role": "kv_producer"}, e, logs, kv_bytes)
                d = vllm_server(f"decode-{backend}", model, {**kvt, "kv_role": "kv_consumer"}, e, logs, kv_bytes)
                if any(c.startswith(f"push-{backend}{SYNC_DECODE}") for c in configs):
                    sd = vllm_server(f"decode-{backend}{SYNC_DECODE}", model, {**kvt, "kv_role": "kv_consumer"}, e,
                                     logs, kv_bytes, ("--no-async-scheduling",))
                    pairs[backend + SYNC_DECODE] = (p, sd)
                    running.append(sd)
            pairs[backend] = (p, d)
            running.extend((p, d))
        return pairs

    def ready(servers: list[Server]) -> list[Server]:
        """The servers that became ready within 10 minutes; one that exited or did not is recorded, the rest go on."""
        deadline = time.monotonic() + 600
        pending, ok = list(servers), []
        while pending and time.monotonic() < deadline:
            for srv in list(pending):
                try:
                    if srv.ready():
                        ok.append(srv)
                        pending.remove(srv)
                except RuntimeError as exc:  # exited
                    pending.remove(srv)
                    result.setdefault("start_failures", []).append(str(exc)[-4000:])
                    print(f"[serving] start failure: {str(exc)[-2000:]}", flush=True)
            time.sleep(2)
        for srv in pending:
            result.setdefault("start_failures", []).append(f"{srv.name} not ready in 600 s:\n{srv.tail(30)}")
        result["ready_after_s"].update({s.name: round(s.ready_after or 0, 1) for s in ok})
        return ok

    def measure(label: str, mode: str, pair: tuple[Server, Server] | None, first_token: str = "prefill",
                trace_dir: Path | None = None) -> None:
        if pair is None:
            result["configs"][label] = run_config(label, single.url, model, [single], out, names)
            return
        prx = proxy_server(f"proxy-{label}", pair[0], pair[1], mode, env, logs, first_token, trace_dir)
        try:
            wait_ready([prx], 60)
            result["configs"][label] = run_config(label, prx.url, model, list(pair), out, names)
            if trace_dir is not None:
                rows = load_trace(trace_dir)
                for res in result["configs"][label].values():
                    if isinstance(res.get("window"), list):
                        res["breakdown"] = breakdown(rows, *res["window"])
        except RuntimeError as exc:
            result["configs"][label] = {n: {"error": str(exc)[-2000:]} for n in names}
        finally:
            prx.stop()

    try:
        first = start_pairs([b for b in ("mscclpp", "ucx") if any(c.split("-")[1:2] == [b] for c in configs)])
        ok = ready(running)
        if wait_for is not None:
            print(f"[serving] instances up; waiting for {wait_for}", flush=True)
            while not wait_for.exists():
                time.sleep(2)
        for k in range(1, rounds + 1):
            tag = "" if k == 1 else f"#{k}"
            for c in configs:
                if c == "single" and single in ok:
                    measure(c + tag, "single", None)
                elif c.split("-")[0] in ("push", "pull") and c.split("-")[1] in first:
                    mode, backend = c.split("-")[:2]
                    pair = first.get(backend + SYNC_DECODE if c.endswith(SYNC_DECODE) else backend)
                    if pair is None:
                        continue
                    if all(s in ok for s in pair):
                        measure(c + tag, mode, pair, "decode" if c.endswith("-decode-first") else "prefill",
                                out / "trace" / backend)
        for s in {s.name: s for pair in first.values() for s in pair}.values():  # a prefill may serve two decodes
            s.stop()
            running.remove(s)
        if "nixl" in configs:
            pair = start_pairs(["nixl"])["nixl"]
            if all(s in ready(list(pair)) for s in pair):
                measure("nixl", "nixl", pair)
        if single in ok:  # the baseline once more at the end: drift over the session
            result["configs"]["single-again"] = run_config("single-again", single.url, model, [], out, names[:1])
    finally:
        for s in running:
            s.stop()
        (out / "serving.json").write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------- breakdown
SEGMENTS = [  # (name, from milestone, to milestone): where a P/D request's time goes (see kvtransport_vllm.trace)
    ("proxy_in", "proxy.recv", "proxy.sent"),
    ("prefill_intake", "proxy.sent", "p.new"),
    ("prefill_admission", "p.new", "p.scheduled"),
    ("prefill_forward", "p.scheduled", "p.finished"),
    ("prefill_answer", "p.finished", "proxy.prefill_done"),
    ("proxy_out", "proxy.prefill_done", "proxy.first_out"),
    ("ttft_at_proxy", "proxy.recv", "proxy.first_out"),
    ("signal_after_finish", "p.finished", "p.signal"),
    ("landed_after_signal", "p.signal", "d.landed"),
    ("first_token_to_decode", "p.finished", "d.first"),
    ("dst_to_worker", "d.alloc", "w.bind"),
    ("dst_to_scheduler", "d.alloc", "p.dst"),
    ("decode_answer", "d.reported", "proxy.decode_first"),
    ("reported_to_scheduled", "d.reported", "d.scheduled"),
    ("scheduled_to_answer", "d.scheduled", "proxy.decode_first"),
    ("second_token_after_first", "proxy.first_out", "proxy.decode_first"),
]


DECODE_KEYED = ("p.signal", "d.landed", "d.reported", "d.scheduled")
"""Milestones keyed by the decode request (joined to the transfer through ``d.alloc``/``d.new``)."""


def load_trace(directory: Path) -> list[dict[str, Any]]:
    """The milestones recorded under ``directory`` (kvtransport_vllm.trace's format), ordered by time."""
    try:
        from kvtransport_vllm.trace import load
    except ImportError:
        return []
    return load(directory) if directory.exists() else []


def breakdown(rows: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    """Median milliseconds of each SEGMENTS segment over the requests traced in ``[t0, t1]``, keyed by the
    proxy's transfer id (decode-side milestones keyed by the decode request are mapped through ``d.alloc``),
    how many requests had each segment, and when the prefill workers bound the destinations (``w.bind``
    ``phase``: before / during / after the forward; counts)."""
    seq_to_xfer = {r["seq"]: r["key"] for r in rows if r.get("ev") in ("d.alloc", "d.new") and "seq" in r}
    first: dict[str, dict[str, float]] = {}
    phases: dict[str, int] = {}
    for r in rows:
        if not t0 <= r["t"] <= t1:
            continue
        key = seq_to_xfer.get(r["key"], r["key"]) if r["ev"] in DECODE_KEYED else r["key"]
        first.setdefault(key, {}).setdefault(r["ev"], r["t"])
        if r["ev"] == "w.bind" and isinstance(r.get("phase"), str):
            phases[r["phase"]] = phases.get(r["phase"], 0) + 1
    out: dict[str, Any] = {}
    for name, a, b in SEGMENTS:
        vals = sorted(1000 * (m[b] - m[a]) for m in first.values() if a in m and b in m)
        if vals:
            out[name] = {"p50_ms": round(vals[len(vals) // 2], 3), "n": len(vals)}
    if phases:
        out["bound"] = dict(sorted(phases.items()))
    return out


# ---------------------------------------------------------------------------------------------- report
def _ms(value: Any) -> Any:
    """A client figure in ms to the microsecond (what the tables show); anything else as it is."""
    return round(value, 3) if isinstance(value, float) else value


def summarize(files: list[Path]) -> list[dict[str, Any]]:
    """One row per (phase, configuration, setting) with TTFT/ITL figures, the overhead over that phase's single
    instance, the transfer time per request and the share pushed layer-wise."""
    rows = []
    for f in files:
        data = json.loads(f.read_text())
        for label, per in data["configs"].items():
            config, _, rnd = label.partition("#")
            base = data["configs"].get("single" + ("#" + rnd if rnd else ""), {})
            for setting, r in per.items():
                if "error" in r:
                    rows.append({"phase": data["phase"], "config": label, "setting": setting, "error": r["error"]})
                    continue
                b = base.get(setting, {})
                conn: dict[str, float] = {}
                for m in r.get("connector", {}).values():
                    for k, v in m.items():
                        conn[k] = conn.get(k, 0.0) + v
                sent = conn.get("layerwise", 0) + conn.get("whole", 0)
                row = {
                    "phase": data["phase"], "config": label, "setting": setting, "round": int(rnd or 1),
                    "ttft_p50_ms": _ms(r.get("median_ttft_ms")), "ttft_p99_ms": _ms(r.get("p99_ttft_ms")),
                    "ttft_mean_ms": _ms(r.get("mean_ttft_ms")),
                    "itl_p50_ms": _ms(r.get("median_itl_ms")), "tpot_p50_ms": _ms(r.get("median_tpot_ms")),
                    "completed": r.get("completed"),
                    "ttft_overhead_pct": (round(100 * (r["median_ttft_ms"] / b["median_ttft_ms"] - 1), 1)
                                          if b.get("median_ttft_ms") and config != "single" else None),
                    "transfer_ms": (round(1000 * conn["hold_s_sum"] / conn["hold_n"], 2) if conn.get("hold_n")
                                    else round(1000 * conn["nixl_xfer_s_sum"] / conn["nixl_xfer_n"], 2)
                                    if conn.get("nixl_xfer_n") else None),
                    "bound_before_during_after": ([int(conn.get(f"bound_{k}", 0)) for k in ("before", "during", "after")]
                                                  if any(conn.get(f"bound_{k}") for k in ("before", "during", "after"))
                                                  else None),
                    "layerwise_share": round(conn.get("layerwise", 0) / sent, 3) if sent else None,
                    "decode_local_compute": conn.get("prompt_tokens_local_compute"),
                    "breakdown": r.get("breakdown"),
                    "engine": engine_means(r),
                }
                rows.append(row)
    return rows


def engine_means(result: dict[str, Any]) -> dict[str, float] | None:
    """vLLM's own request metrics (means over the run, ms; the client's warm-up requests included) on the instance
    that computed the prompt — the watched instance named ``single`` or ``prefill-*`` — and ``outside``: the
    client's mean TTFT less the engine's, i.e. HTTP, tokenization, the proxy and the answer's way back. None when
    that instance was not watched or reported nothing."""
    metrics = next((m for name, m in result.get("connector", {}).items()
                    if name == "single" or name.startswith("prefill")), None)
    if not metrics:
        return None
    out = {seg: round(1000 * metrics[s] / metrics[n], 3) for seg, s, n in ENGINE_SEGMENTS if metrics.get(n)}
    if "engine_ttft" in out and isinstance(result.get("mean_ttft_ms"), (int, float)):
        out["outside"] = round(result["mean_ttft_ms"] - out["engine_ttft"], 3)
    return out or None


def paired(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (configuration, setting) over interleaved rounds: the median TTFT p50 and the median, lowest and
    highest of the overheads over the single instance of the same round (``ttft_overhead_pct``); the baseline's
    own spread over the rounds beside it. Rows of one round only are left out."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        config = r.get("config", "").partition("#")[0]
        if r.get("ttft_p50_ms") is not None and config != "single-again":
            groups.setdefault((config, r["setting"]), []).append(r)
    out = []
    for (config, setting), rs in groups.items():
        if len(rs) < 2:
            continue
        p50s = sorted(r["ttft_p50_ms"] for r in rs)
        over = sorted(r["ttft_overhead_pct"] for r in rs if r.get("ttft_overhead_pct") is not None)
        out.append({"config": config, "setting": setting, "rounds": len(rs),
                    "ttft_p50_ms_median": p50s[len(p50s) // 2], "ttft_p50_ms_range": [p50s[0], p50s[-1]],
                    "overhead_pct_median": over[len(over) // 2] if over else None,
                    "overhead_pct_range": [over[0], over[-1]] if over else None})
    return out


def report(files: list[Path], out: Path) -> None:
    rows = summarize(files)
    cols = ["phase", "config", "setting", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "ttft_overhead_pct",
            "transfer_ms", "bound_before_during_after", "layerwise_share", "completed"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, r.get("error", ""))) for c in cols) + " |")
    segs = [name for name, _, _ in SEGMENTS]
    shown = [g for g in segs if any(g in (r.get("breakdown") or {}) for r in rows)]
    if shown:
        lines += ["", "Where the time went (median ms per request, from the instances' and the proxy's milestones):",
                  "", "| config | setting | " + " | ".join(shown) + " |", "|" + "---|" * (len(shown) + 2)]
        for r in rows:
            b = r.get("breakdown") or {}
            if b:
                lines.append(f"| {r['config']} | {r['setting']} | "
                             + " | ".join(str(b[g]["p50_ms"]) if g in b else "" for g in shown) + " |")
    engine = [r for r in rows if r.get("engine")]
    if engine:
        names = (*(seg for seg, _, _ in ENGINE_SEGMENTS), "outside")
        lines += ["", "vLLM's own request metrics on the instance that computed the prompt (means over the run, ms, "
                  "warm-up requests included; `outside`: the client's mean TTFT less the engine's):", "",
                  "| config | setting | client TTFT mean | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 3)]
        for r in engine:
            lines.append(f"| {r['config']} | {r['setting']} | {r.get('ttft_mean_ms')} | "
                         + " | ".join(str(r["engine"].get(n, "")) for n in names) + " |")
    rounds = paired(rows)
    if rounds:
        lines += ["", "Interleaved rounds (each overhead against the single instance of its own round):", "",
                  "| config | setting | rounds | TTFT p50 median (ms) | p50 range | overhead median | overhead range |",
                  "|---|---|---|---|---|---|---|"]
        for g in rounds:
            lines.append(f"| {g['config']} | {g['setting']} | {g['rounds']} | {g['ttft_p50_ms_median']} | "
                         f"{g['ttft_p50_ms_range']} | {g['overhead_pct_median']} | {g['overhead_pct_range']} |")
    (out / "serving.md").write_text("\n".join(lines) + "\n")
    (out / "serving-summary.json").write_text(json.dumps({"rows": rows, "rounds": rounds}, indent=1))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    settings = [s[0] for s in SETTINGS]
    configs = [c for c in ("single", "push-mscclpp", "push-ucx", "push-mscclpp-decode-first", "pull-mscclpp", "nixl")
               if any(r.get("config") == c for r in rows)]
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.8), sharey=False)
    for ax, setting in zip(axes, settings, strict=True):
        vals, errs, names = [], [], []
        for c in configs:
            r = next((r for r in rows if r.get("config") == c and r.get("setting") == setting
                      and r.get("ttft_p50_ms") is not None), None)
            if r is None:
                continue
            names.append(c)
            vals.append(r["ttft_p50_ms"])
            errs.append(max(0.0, (r.get("ttft_p99_ms") or r["ttft_p50_ms"]) - r["ttft_p50_ms"]))
        ax.bar(range(len(vals)), vals, yerr=[[0] * len(errs), errs], capsize=3, color="#4477aa")
        ax.set_xticks(range(len(vals)), names, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"TTFT p50 (whisker: p99), {setting}", fontsize=9)
        ax.set_ylabel("ms (log scale)")
        for i, v in enumerate(vals):
            ax.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ttft.png", dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-model", help="write the Llama-3.1-8B-shaped model directory (config + tokenizer)")
    mk.add_argument("path", type=Path)
    run = sub.add_parser("run", help="start the instances and benchmark each configuration (one GPU)")
    run.add_argument("--model", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--configs", nargs="+",
                     default=["single", "push-mscclpp", "push-mscclpp-decode-first", "pull-mscclpp", "push-ucx",
                              "nixl"])
    run.add_argument("--kv-gib", type=float, default=3.0, help="KV cache per instance (GiB; 8k tokens = 1 GiB)")
    run.add_argument("--wait-for", type=Path, default=None,
                     help="start the instances, but measure only once this file exists")
    run.add_argument("--rounds", type=int, default=1,
                     help="measure the single instance and the kvtransport configurations this many times, "
                          "interleaved (overheads are then judged within each round)")
    cl = sub.add_parser("client", help="(used by run) vllm bench serve for each setting, in one process")
    cl.add_argument("--url", required=True)
    cl.add_argument("--model", type=Path, required=True)
    cl.add_argument("--label", required=True)
    cl.add_argument("--settings", required=True)
    cl.add_argument("--watch", default="")
    cl.add_argument("--out", type=Path, required=True)
    rep = sub.add_parser("report", help="Markdown table and plot from serving-*.json")
    rep.add_argument("files", nargs="+", type=Path)
    rep.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "make-model":
        print(make_model(a.path))
    elif a.cmd == "run":
        run_all(a.model, a.out, a.configs, a.kv_gib, a.wait_for, a.rounds)
    elif a.cmd == "client":
        client(a.url, a.model, a.label, a.settings.split(","), [w for w in a.watch.split(",") if w], a.out)
    else:
        a.out.mkdir(parents=True, exist_ok=True)
        report(a.files, a.out)


if __name__ == "__main__":
    main()
