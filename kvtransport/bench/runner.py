"""``kvtransport bench`` driver: plan the run, run every (system, workload) pair, write the outputs.

Each kvtransport backend runs each workload in its own pair of spawned processes (a failure is
recorded as an error row and the run goes on). Baselines run in the same invocation. Outputs under
``--out``: ``results.json`` (machine, options, every row, skips), ``table.txt`` (what the terminal
showed) and PNG plots.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from typing import Any

from .common import eta, mmss
from .plan import (
    ID_PATTERNS,
    MODEL_SHAPES,
    WORKLOADS,
    GiB,
    KiB,
    KVShape,
    MiB,
    Options,
    Skip,
    block_ids,
    fmt_bytes,
    kv_reps,
    kv_shape,
    memory_budget,
    parse_size,
    parse_tokens,
    sweep_reps,
    sweep_sizes,
)
from .report import TCP_STREAM

SMOKE_PRESETS = ("llama-3.1-8b", "deepseek-v3-mla")
"""--smoke: one MHA and the MLA preset, 128-token requests, sweep 4 KiB .. 1 MiB, 20 latency sequences."""


def build_parser() -> argparse.ArgumentParser:
    """The ``kvtransport bench`` argument parser (options in groups, each with its help)."""
    ap = argparse.ArgumentParser(prog="kvtransport bench", description="Benchmark every available kvtransport backend "
                                 "against the link's ceiling, raw torch.distributed and NIXL, on real KV shapes. "
                                 "Progress lines show elapsed time, rows done / planned and an estimate of the time left.")
    out = ap.add_argument_group("output")
    out.add_argument("--out", default="bench-out", help="output directory (default ./%(default)s)")
    out.add_argument("--from-json", default=None, metavar="RESULTS_JSON",
                     help="re-render table and plots from an earlier results.json; measure nothing")
    what = ap.add_argument_group("what to measure")
    what.add_argument("--smoke", action="store_true", help="a tiny version of every workload (CI; asserts nothing about speed)")
    what.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                      help="memory the KV caches live in (auto: cuda when a GPU is visible); cuda: sender cuda:0, "
                           "receiver cuda:1")
    what.add_argument("--backends", default=None, metavar="NAMES",
                      help="comma-separated backends (default: every available one)")
    what.add_argument("--workloads", default=",".join(WORKLOADS), metavar="NAMES",
                      help="comma-separated subset of %(default)s")
    what.add_argument("--no-nixl", dest="nixl", action="store_false", help="skip the NIXL baseline even when installed")
    what.add_argument("--no-mooncake", dest="mooncake", action="store_false",
                      help="skip Mooncake's transfer engine (host memory over TCP) even when installed")
    kv = ap.add_argument_group("KV requests (kv and overlap workloads)")
    kv.add_argument("--presets", default=",".join(MODEL_SHAPES), metavar="NAMES",
                    help="comma-separated model presets (default %(default)s)")
    kv.add_argument("--tokens", default="128,2k,32k", help="comma-separated prompt lengths (default %(default)s)")
    kv.add_argument("--patterns", default=",".join(ID_PATTERNS), metavar="NAMES",
                    help="block-id patterns (default %(default)s)")
    kv.add_argument("--kv-api", choices=["put_layers", "put_layer"], default="put_layers",
                    help="kv requests: one put_layers call per request (default; one device launch where the "
                         "backend can) or one put_layer call per layer (the layer-wise path is the overlap workload's)")
    sweep = ap.add_argument_group("message sweep")
    sweep.add_argument("--min-size", default="4K", help="smallest message (default %(default)s)")
    sweep.add_argument("--max-size", default="1G", help="largest message (default %(default)s; capped by memory)")
    overlap = ap.add_argument_group("layer-wise overlap")
    overlap.add_argument("--layer-compute-ms", type=float, default=None,
                         help="per-layer compute time (default: measured matmul [tokens, hidden] @ [hidden, hidden/tp])")
    overlap.add_argument("--overlap-budget-s", type=float, default=None,
                         help="skip cases whose emulated compute exceeds this many seconds (default 60 on CPU, "
                              "none on CUDA)")
    overlap.add_argument("--overlap-reps", type=int, default=2, help="timed layer-wise prefills per case (default %(default)s)")
    latency = ap.add_argument_group("completion latency")
    latency.add_argument("--latency-preset", default="llama-3.1-8b", help="model preset of the one-block sequences "
                         "(default %(default)s)")
    latency.add_argument("--latency-seqs", type=int, default=200, help="one-block sequences timed (default %(default)s)")
    run = ap.add_argument_group("how the run behaves")
    run.add_argument("--reps-scale", type=float, default=1.0, help="multiply the default repetition counts (default 1)")
    run.add_argument("--mem-fraction", type=float, default=0.6,
                     help="share of available memory the two roles may use (default %(default)s)")
    run.add_argument("--timeout", type=float, default=120.0, help="bound of every wait inside a role, seconds "
                     "(default %(default)s)")
    run.add_argument("--quiet-wait-s", type=float, default=None,
                     help="before each pair of processes, wait up to this long for the CPUs to be >= 70%% idle "
                          "(default 120 on CPU, 0 with --smoke or on CUDA); waits are recorded in the JSON")
    run.add_argument("--netns", action="store_true",
                     help="run every pair between two 'hosts' on this machine: network namespaces joined by a veth "
                          "pair (NET_IFNAME = each side's veth; needs root and iproute2), and add a raw TCP stream "
                          "of the same bytes over the same veth as a baseline")
    run.add_argument("--seed", type=int, default=0, help="seed of block ids and cache contents (default 0)")
    return ap


def parse_args(argv: list[str] | None) -> Options:
    """Command line -> Options (``--smoke`` shrinks every workload)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    device = a.device
    if device == "auto":
        device = "cuda" if _cuda_available() else "cpu"
    opts = Options(
        out=a.out, smoke=a.smoke, device=device,
        backends=[b.strip() for b in a.backends.split(",") if b.strip()] if a.backends else None,
        workloads=tuple(w.strip() for w in a.workloads.split(",") if w.strip()),
        presets=tuple(p.strip() for p in a.presets.split(",") if p.strip()),
        tokens=tuple(parse_tokens(t) for t in a.tokens.split(",") if t.strip()),
        patterns=tuple(p.strip() for p in a.patterns.split(",") if p.strip()),
        min_size=parse_size(a.min_size), max_size=parse_size(a.max_size), reps_scale=a.reps_scale,
        layer_compute_ms=a.layer_compute_ms,
        overlap_budget_s=a.overlap_budget_s if a.overlap_budget_s is not None else (60.0 if device == "cpu" else 1e9),
        overlap_reps=a.overlap_reps, latency_preset=a.latency_preset, latency_seqs=a.latency_seqs,
        mem_fraction=a.mem_fraction, timeout=a.timeout, seed=a.seed, nixl=a.nixl, mooncake=a.mooncake, netns=a.netns,
    )
    opts.extra["from_json"] = a.from_json
    opts.extra["kv_api"] = a.kv_api
    opts.extra["quiet_wait_s"] = (a.quiet_wait_s if a.quiet_wait_s is not None
                                  else 0.0 if (a.smoke or device == "cuda") else 120.0)
    if opts.netns:
        from ..workload.netns import unavailable_reason

        why = unavailable_reason()
        if why:
            ap.error(f"--netns: {why}")
        if device != "cpu":
            ap.error("--netns moves host memory between namespaces (--device cpu)")
    for w in opts.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    for p in opts.patterns:
        if p not in ID_PATTERNS:
            ap.error(f"unknown block-id pattern {p!r}; choose from {', '.join(ID_PATTERNS)}")
    from ..workload.caches import PRESETS

    for p in (*opts.presets, opts.latency_preset):
        if p not in PRESETS:
            ap.error(f"unknown preset {p!r}; choose from {', '.join(sorted(PRESETS))}")
    if opts.smoke:
        opts.presets = SMOKE_PRESETS
        opts.tokens = (128,)
        opts.min_size, opts.max_size = 4 * KiB, MiB
        opts.latency_seqs = 20
        opts.overlap_reps = 1
    return opts


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


# ====================================================================== the run
class Bench:
    """One bench run: plan, measure, collect. ``result`` is what goes into results.json."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.t0 = time.time()
        self.rows: list[dict[str, Any]] = []
        self.skips: list[Skip] = []
        self.errors: list[dict[str, str]] = []
        self.paths: dict[str, str] = {}
        self.rss: list[dict[str, Any]] = []
        self.ceiling_quiet: tuple[float, bool] = (0.0, True)
        self.counter = 0
        self.total = 0
        if opts.device == "cuda":
            import torch

            n = torch.cuda.device_count()
            self.send_device, self.recv_device = "cuda:0", f"cuda:{1 if n > 1 else 0}"
        else:
            self.send_device = self.recv_device = "cpu"
        self.budget, self.budget_note = memory_budget(opts)
        self.hosts: dict[str, Any] | None = None  # --netns: role -> workload.netns.Host

    # ---------------------------------------------------------------- planning
    def backends(self) -> tuple[list[str], list[dict[str, Any]]]:
        """Backends to run (available, cross-process, able to move this memory) and every backend's status."""
        import kvtransport
        from kvtransport import registry

        specs = registry.specs()
        kind = "cuda" if self.opts.device == "cuda" else "cpu"
        chosen, listing = [], []
        for row in kvtransport.available_backends():
            entry = {"name": row.name, "installed": row.installed, "available": row.available, "reason": row.reason}
            if row.name in specs and not specs[row.name].cross_process:
                entry["used"] = "no: its peers must share one process (the bench runs two)"
            elif not row.available:
                entry["used"] = "no: " + (row.reason or "unavailable")
            elif row.name in specs and kind not in specs[row.name].memory_kinds:
                entry["used"] = f"no: cannot move {kind} memory"
            elif self.opts.backends is not None and row.name not in self.opts.backends:
                entry["used"] = "no: not selected (--backends)"
            else:
                entry["used"] = "yes"
                chosen.append(row.name)
            listing.append(entry)
        if self.opts.backends:
            for name in self.opts.backends:
                if name not in chosen:
                    why = next((str(e["used"]) for e in listing if e["name"] == name), "not installed")
                    self.skips.append(Skip("all", f"backend {name}", why))
        return chosen, listing

    def plan_sweep(self) -> list[int]:
        o = self.opts
        sizes = sweep_sizes(o.min_size, o.max_size)
        kept: list[int] = []
        for s in sizes:
            need = 2 * (sum(kept) + s)  # each role holds every size once
            if need > self.budget:
                self.skips.append(Skip("sweep", f"sizes >= {fmt_bytes(s)}",
                                       f"needs {fmt_bytes(need)} across the two processes; budget {fmt_bytes(self.budget)} "
                                       f"({self.budget_note})"))
                break
            kept.append(s)
        return kept

    def plan_kv(self) -> list[tuple[KVShape, list[tuple[str, int]]]]:
        """[(shape, [(pattern, reps)])]; memory is checked per system when it runs (:meth:`fitting`)."""
        o = self.opts
        out = []
        for preset in o.presets:
            for tokens in o.tokens:
                shape = kv_shape(preset, tokens)
                reps = kv_reps(shape.request_bytes, o.smoke, o.reps_scale)
                out.append((shape, [(p, reps) for p in o.patterns]))
        return out

    def fits(self, workload: str, system: str, shape: KVShape, staged: bool) -> bool:
        """Whether the two roles of ``system`` can hold ``shape``; records a Skip when not."""
        need = shape.pair_bytes(staged)
        if need > self.budget:
            what = "2 cache pools + staging" + (" + one request of send staging (two-sided backend)" if staged else "")
            self.skips.append(Skip(workload, f"{shape.label()} on {system}",
                                   f"needs {fmt_bytes(need)} ({what}); budget {fmt_bytes(self.budget)} "
                                   f"({self.budget_note})"))
            return False
        return True

    def stages(self, backend: str) -> bool:
        """False for one-sided backends (puts go straight from the cache); True otherwise, or if unknown."""
        import kvtransport
        from kvtransport.layout import KVLayout

        from .common import alloc

        try:
            with kvtransport.open(KVLayout.from_tensors([alloc(4096, self.send_device, 0)]), backend=backend) as cm:
                return not cm.capabilities.one_sided
        except Exception:
            return True

    def plan_overlap(self) -> list[dict[str, Any]]:
        """Overlap groups: shape, per-layer compute (measured or given), emulation mode, repetitions."""
        from .baselines import layer_compute_seconds

        o = self.opts
        groups = []
        tokens = [t for t in o.tokens]
        for preset in o.presets:
            for t in tokens:
                shape = kv_shape(preset, t)
                hidden, tp = MODEL_SHAPES.get(preset, (4096, 1))
                matmul = None
                if o.layer_compute_ms is not None:
                    secs, note = o.layer_compute_ms / 1e3, "given (--layer-compute-ms)"
                    mode = "sleep" if o.device == "cpu" else "cuda_sleep"
                else:
                    secs, note = layer_compute_seconds(hidden, tp, t, o.device)
                    mode = "sleep" if o.device == "cpu" else "matmul"
                    matmul = [t, hidden, max(1, hidden // tp)]
                total = o.overlap_reps * shape.num_layers * secs
                if total > o.overlap_budget_s:
                    self.skips.append(Skip("overlap", shape.label(), f"emulated compute {shape.num_layers} layers x "
                                           f"{secs * 1e3:.0f} ms x {o.overlap_reps} reps = {total:.0f} s exceeds "
                                           f"--overlap-budget-s {o.overlap_budget_s:g} ({note})"))
                    continue
                serial = kv_reps(shape.request_bytes, o.smoke, o.reps_scale)
                groups.append({"shape": shape.to_dict(), "compute_s": secs, "compute_note": note, "mode": mode,
                               "matmul": matmul, "reps": o.overlap_reps, "serial_reps": serial})
        return groups

    # ---------------------------------------------------------------- execution
    def _cfg(self, label: str, n_rows: int, **kw: Any) -> dict[str, Any]:
        cfg = {"label": label, "timeout": self.opts.timeout, "seed": self.opts.seed,
               "send_device": self.send_device, "recv_device": self.recv_device,
               "progress": {"t0": self.t0, "offset": self.counter, "total": self.total}}
        cfg.update(kw)
        self.counter += n_rows
        return cfg

    def say(self, text: str) -> None:
        print(f"[{mmss(time.time() - self.t0)}] {text}", flush=True)

    def pair(self, module: str, role: str, cfg: dict[str, Any], est_s: float, system: str,
             workload: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """Run one role pair; on failure record an error and return None."""
        from ..workload.harness import HarnessError, run_pair

        timeout = 120.0 + 3.0 * est_s
        waited, quiet = self.wait_quiet(f"{system} {workload}")
        p = cfg.get("progress", {})
        self.say(f"{system} {workload}: starting two processes{eta(self.t0, int(p.get('offset', 0)), self.total)}")
        try:
            res = run_pair(f"kvtransport.bench.{module}.{role}_receiver", f"kvtransport.bench.{module}.{role}_sender",
                           cfg, timeout=timeout, hosts=self.hosts)
            self.rss.append({"system": system, "workload": workload, "receiver_bytes": res[0].get("peak_rss_bytes"),
                             "sender_bytes": res[1].get("peak_rss_bytes"), "waited_for_quiet_s": waited,
                             "started_quiet": quiet})
            return res
        except HarnessError as exc:
            text = str(exc)
            self.errors.append({"system": system, "workload": workload, "error": text[-4000:]})
            first = text.strip().splitlines()
            self.say(f"ERROR {system} {workload}: {first[-1] if first else text}"[:400])
            return None

    def wait_quiet(self, what: str) -> tuple[float, bool]:
        """Wait (up to --quiet-wait-s) until two 2-second windows in a row see the CPUs >= 70% idle: other
        work on a shared machine distorts every figure. Returns (seconds waited, whether it got quiet)."""
        from .common import cpu_idle

        limit = float(self.opts.extra.get("quiet_wait_s") or 0.0)
        if limit <= 0:
            return 0.0, True
        t0, ok, said = time.time(), 0, False
        while ok < 2:
            idle = cpu_idle(2.0)
            if idle is None:
                return 0.0, True
            ok = ok + 1 if idle >= 0.7 else 0
            waited = time.time() - t0
            if ok < 2 and waited > limit:
                self.say(f"machine still busy after {waited:.0f} s (CPUs {idle:.0%} idle); running {what} anyway")
                return waited, False
            if ok == 0 and not said and waited > 4:
                self.say(f"waiting for other work on this machine to calm down before {what} (CPUs {idle:.0%} idle)")
                said = True
        return time.time() - t0, True

    def add_rows(self, rows: list[dict[str, Any]], system: str, **extra: Any) -> None:
        for r in rows:
            r.setdefault("workload", extra.get("workload"))
            r["system"] = system
            r.update({k: v for k, v in extra.items() if k != "workload"})
            self.rows.append(r)

    def run(self) -> dict[str, Any]:
        """Measure everything (between two network namespaces with --netns; they are removed at the end)."""
        if not self.opts.netns:
            return self._run()
        from ..workload.netns import remove_stale, two_hosts

        remove_stale()
        with two_hosts() as net:
            self.hosts = {"receiver": net.host("a"), "sender": net.host("b")}
            self.say(f"netns: receiver on {self.hosts['receiver'].ifname} ({self.hosts['receiver'].address}), "
                     f"sender on {self.hosts['sender'].ifname} ({self.hosts['sender'].address}), one veth pair")
            result = self._run()
        result["netns"] = {role: {"netns": h.netns, "hostname": h.hostname, "ifname": h.ifname, "address": h.address}
                           for role, h in self.hosts.items()}
        return result

    def _run(self) -> dict[str, Any]:
        from .baselines import Ceiling, mooncake_version, nixl_version
        from .machine import describe, summary_line

        o = self.opts
        machine = describe(o.device)
        self.say(f"kvtransport bench{' --smoke' if o.smoke else ''} on {o.device}: {summary_line(machine)}")
        backends, listing = self.backends()
        self.say("backends: " + "; ".join(f"{e['name']} ({'used' if e['used'] == 'yes' else e['used']})" for e in listing))
        nixl_ver = nixl_version() if o.nixl else None
        nixl_status = (f"installed ({nixl_ver})" if nixl_ver else "not installed") if o.nixl else "disabled (--no-nixl)"
        self.say(f"NIXL: {nixl_status}; memory budget {fmt_bytes(self.budget)} ({self.budget_note})")
        moon_ver = mooncake_version() if o.mooncake and o.device == "cpu" else None
        moon_status = ("disabled (--no-mooncake)" if not o.mooncake
                       else "host memory only here (its GPU path needs RDMA)" if o.device != "cpu"
                       else f"installed ({moon_ver})" if moon_ver else
                       "not installed (pip install mooncake-transfer-engine-non-cuda; needs libibverbs1)")
        self.say(f"Mooncake transfer engine: {moon_status}")

        sizes = self.plan_sweep() if "sweep" in o.workloads else []
        kv = self.plan_kv() if "kv" in o.workloads else []
        if "overlap" in o.workloads and o.layer_compute_ms is None:
            self.wait_quiet("measuring the per-layer compute")
        overlap = self.plan_overlap() if "overlap" in o.workloads else []
        lat_shape = kv_shape(o.latency_preset, 16 * 64)  # pool of 64 one-block sequences
        lat_shape = KVShape(lat_shape.preset, 16, lat_shape.num_layers, lat_shape.piece_bytes, 1, 64)
        raw_sizes = sorted(set(sizes) | {s.request_bytes for s, _ in kv})
        plans = {}
        for b in backends:  # memory is checked per backend: two-sided ones stage whole requests
            system, staged = f"kvtransport/{b}", self.stages(b)
            plans[b] = ([(sh, cs) for sh, cs in kv if self.fits("kv", system, sh, staged)],
                        [g for g in overlap if self.fits("overlap", system, kv_shape(g["shape"]["preset"],
                                                                                     g["shape"]["tokens"]), staged)])
        # peer systems: (name, what the skip list calls it, status); installed ones run over the KV cases that fit
        peers = [("nixl", "NIXL baseline", nixl_status), ("mooncake", "Mooncake baseline", moon_status)]
        peer_kv = {name: [(sh, cs) for sh, cs in kv if self.fits("kv", name, sh, False)]
                   for name, ver in (("nixl", nixl_ver), ("mooncake", moon_ver)) if ver}
        self.total = len(raw_sizes) * (2 if o.netns else 1)
        self.total += sum(len(sizes) + sum(len(c) for _, c in cases) for cases in peer_kv.values())
        for pkv, pov in plans.values():
            self.total += len(sizes) + 2 * sum(len(c) for _, c in pkv) + len(pov) + (1 if "latency" in o.workloads else 0)

        ceiling = Ceiling(o.device, cap=GiB if o.device == "cpu" else 2 * GiB, samples=3 if o.smoke else 5)
        all_sizes = sorted(set(raw_sizes) | ({lat_shape.request_bytes} if "latency" in o.workloads else set()))
        self.ceiling_quiet = self.wait_quiet("the ceiling")
        self.say(f"ceiling: {ceiling.method} at {len(all_sizes)} sizes")
        for s in all_sizes:
            ceiling.measure(s)

        for b in backends:
            self._run_backend(b, sizes, plans[b][0], plans[b][1], lat_shape)
        if raw_sizes:
            self._run_raw(raw_sizes, sizes, kv)
        if raw_sizes and o.netns:
            self._run_tcp(raw_sizes, sizes, kv)
        for name, label, status in peers:
            if name in peer_kv and (sizes or peer_kv[name]):
                self._run_peer(name, sizes, peer_kv[name])
            elif "sweep" in o.workloads or "kv" in o.workloads:
                self.skips.append(Skip("sweep,kv", label, status))

        from .report import annotate

        annotate(self.rows, ceiling)
        for r in self.rows:
            if r.get("verified") is False:
                self.errors.append({"system": r["system"], "workload": str(r.get("workload")),
                                    "error": f"data check failed for {r.get('case')}: the bytes did not arrive"})
        return {
            "schema": 1,
            "machine": machine,
            "options": {k: v for k, v in asdict(o).items() if k != "extra"},
            "backends": listing,
            "paths": self.paths,
            "nixl": nixl_status,
            "mooncake": moon_status,
            "ceiling": {"method": ceiling.method, "by_size": {str(k): v for k, v in sorted(ceiling.cache.items())},
                        "waited_for_quiet_s": self.ceiling_quiet[0], "started_quiet": self.ceiling_quiet[1]},
            "memory_budget": {"bytes": self.budget, "note": self.budget_note},
            "rows": self.rows,
            "skipped": [s.to_dict() for s in self.skips],
            "errors": self.errors,
            "pairs": self.rss,
            "elapsed_s": time.time() - self.t0,
            "loadavg_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        }

    def _run_backend(self, b: str, sizes: list[int], kv: list[tuple[KVShape, list[tuple[str, int]]]],
                     overlap: list[dict[str, Any]], lat_shape: KVShape) -> None:
        from ..coalesce import coalesce

        o = self.opts
        system = f"kvtransport/{b}"
        if sizes:
            sreps = [sweep_reps(s, o.smoke, o.reps_scale) for s in sizes]
            est = sum((r + 1) * (s / 3e8 + 0.002) for s, r in zip(sizes, sreps, strict=True))
            cfg = self._cfg(f"{b}", len(sizes), backend=b, sizes=sizes, reps=sreps)
            res = self.pair("roles", "sweep", cfg, est, system, "sweep")
            if res:
                self.add_rows(res[0]["rows"], system, backend=b)
                self.paths[b] = res[1]["path"]
        if kv:
            groups: list[dict[str, Any]] = []
            k = 0
            est = 0.0
            for gi, (shape, cases) in enumerate(kv):
                cs: list[dict[str, Any]] = []
                for pattern, reps in cases:
                    src, dst = block_ids(pattern, shape.request_blocks, shape.pool_blocks, o.seed)
                    cs.append({"index": {"on": k, "off": k + 1}, "pattern": pattern, "reps": reps,
                               "runs": {"on": len(coalesce(src, dst)), "off": len(src)}})
                    est += 2 * (reps + 1) * (shape.request_bytes / 3e8 + 0.05)
                    k += 2
                groups.append({"index": gi, "shape": shape.to_dict(), "coalesce": [True, False], "cases": cs})
            cfg = self._cfg(b, k, backend=b, groups=groups, kv_api=o.extra.get("kv_api", "put_layers"))
            res = self.pair("roles", "kv", cfg, est, system, "kv")
            if res:
                self.add_rows(res[0]["rows"], system, backend=b)
                self.paths.setdefault(b, res[1]["path"])
        if overlap:
            groups = [dict(g, index=i) for i, g in enumerate(overlap)]
            est = sum((g["reps"] + g["serial_reps"] + 1) * (g["shape"]["request_bytes"] / 3e8 + 0.05)
                      + g["reps"] * g["shape"]["num_layers"] * g["compute_s"] for g in groups)
            cfg = self._cfg(b, len(groups), backend=b, groups=groups)
            res = self.pair("roles", "overlap", cfg, est, system, "overlap")
            if res:
                for row, g in zip(res[0]["rows"], groups, strict=True):
                    row["compute_note"] = g["compute_note"]
                self.add_rows(res[0]["rows"], system, backend=b)
        if "latency" in o.workloads:
            cfg = self._cfg(b, 1, backend=b, shape=lat_shape.to_dict(), seqs=o.latency_seqs)
            res = self.pair("roles", "latency", cfg, o.latency_seqs * 0.05, system, "latency")
            if res:
                self.add_rows(res[0]["rows"], system, backend=b)

    def _run_raw(self, raw_sizes: list[int], sizes: list[int], kv: list[tuple[KVShape, list[tuple[str, int]]]]) -> None:
        kind = "gloo" if self.opts.device == "cpu" else "nccl"
        if self._run_baseline("raw", f"torch.distributed/{kind}", f"raw {kind} send/recv", raw_sizes, sizes, kv):
            self.paths[kind] = f"torch.distributed {kind}, {fmt_bytes(min(max(raw_sizes), 256 * MiB))} messages"

    def _run_tcp(self, raw_sizes: list[int], sizes: list[int], kv: list[tuple[KVShape, list[tuple[str, int]]]]) -> None:
        res = self._run_baseline("tcp", TCP_STREAM, "raw TCP stream", raw_sizes, sizes, kv)
        if res:
            self.paths["tcp"] = res[1]["path"]

    def _run_baseline(self, role: str, system: str, label: str, raw_sizes: list[int], sizes: list[int],
                      kv: list[tuple[KVShape, list[tuple[str, int]]]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """A baseline that moves each size as one buffer (``baselines.<role>_*``): its rows count for the sweep
        sizes and, for every block-id pattern alike, for the KV requests of the same byte count."""
        o = self.opts
        kv_bytes = {s.request_bytes: s for s, _ in kv}
        reps = [sweep_reps(s, o.smoke, o.reps_scale) if s in sizes else kv_reps(s, o.smoke, o.reps_scale)
                for s in raw_sizes]
        est = sum((r + 1) * (s / 3e8 + 0.002) for s, r in zip(raw_sizes, reps, strict=True))
        cfg = self._cfg(label, len(raw_sizes), sizes=raw_sizes, reps=reps)
        res = self.pair("baselines", role, cfg, est, system, role)
        if not res:
            return None
        for row in res[0]["rows"]:
            size = row["bytes"]
            if size in sizes:
                self.add_rows([dict(row, workload="sweep")], system)
            if size in kv_bytes:
                shape = kv_bytes[size]
                for pattern in o.patterns:  # raw moves the bytes in one piece: the same figure for every pattern
                    r = dict(row, workload="kv", case={"preset": shape.preset, "tokens": shape.tokens,
                                                       "ids": pattern, "coalesce": None})
                    self.add_rows([r], system)
        return res

    def _run_peer(self, system: str, sizes: list[int], kv: list[tuple[KVShape, list[tuple[str, int]]]]) -> None:
        """A peer system's pair (``baselines.<system>_receiver`` / ``_sender``: nixl, mooncake) over the same
        sweep sizes and KV cases as ours; its rows under ``system``."""
        o = self.opts
        items: list[dict[str, Any]] = []
        n = 0
        if sizes:
            items.append({"kind": "sweep", "index": 0})
            n += len(sizes)
        k = 0
        for shape, cases in kv:
            cs = []
            for pattern, reps in cases:
                cs.append({"index": k, "pattern": pattern, "reps": reps})
                k += 1
            items.append({"kind": "kv", "index": len(items), "shape": shape.to_dict(), "cases": cs})
        n += k
        est = sum(s * 20 / 3e8 for s in sizes) + sum(s.request_bytes * 6 / 3e8 for s, _ in kv)
        # each role's own address (--netns: its host's), for peers that bind one (Mooncake)
        addresses = {role: str(self.hosts[role].address) if self.hosts else "127.0.0.1" for role in ("receiver", "sender")}
        cfg = self._cfg(system, n, sizes=sizes, sweep_reps=[sweep_reps(s, o.smoke, o.reps_scale) for s in sizes],
                        items=items, addresses=addresses)
        res = self.pair("baselines", system, cfg, est, system, "sweep,kv")
        if res:
            self.add_rows(res[0]["rows"], system)
            self.paths[system] = res[1].get("path", system)


def main(argv: list[str] | None = None) -> int:
    """Run the bench (or re-render with --from-json); 0 on success, 1 if any pair failed."""
    import json

    from .report import render

    opts = parse_args(argv)
    os.makedirs(opts.out, exist_ok=True)
    src = opts.extra.get("from_json")
    if src:
        with open(src) as f:
            result = json.load(f)
    else:
        result = Bench(opts).run()
    files = render(result, opts.out, write_json=not src)
    print("wrote: " + ", ".join(files), flush=True)
    return 1 if result.get("errors") else 0
