"""Turn bench rows into the terminal table (also table.txt / table.md), results.json and PNG plots."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from .plan import fmt_bytes, fmt_tokens

HEADLINE = ("llama-3.1-8b", 2048, "random")
"""The KV request the acceptance criteria quote: Llama-3.1-8B, 2k tokens, fully fragmented block ids."""


# ====================================================================== annotation
def annotate(rows: list[dict[str, Any]], ceiling: Any) -> None:
    """Add ``ceiling_gbps`` and ``pct_of_ceiling`` to every bandwidth row (latency rows get no percentage)."""
    for r in rows:
        nbytes = r.get("bytes")
        if not nbytes:
            continue
        c = ceiling.measure(int(nbytes))
        r["ceiling_gbps"] = c["gbps"]
        g = r.get("gbps")
        if r.get("workload") == "latency" or g is None or not math.isfinite(g):
            r["pct_of_ceiling"] = None
        else:
            r["pct_of_ceiling"] = 100.0 * g / c["gbps"]


# ====================================================================== tables
BUSY_PSI = 50.0
"""Rows taken while CPU pressure (PSI some avg10) exceeded this are marked ``*``: other work competed."""


def _busy(r: dict[str, Any] | None) -> str:
    psi = (r or {}).get("cpu_psi10")
    return "*" if psi is not None and psi > BUSY_PSI else ""


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    g, p = r.get("gbps"), r.get("pct_of_ceiling")
    if g is None or not math.isfinite(g):
        return "n/a"
    text = f"{g:.3g}" if g < 100 else f"{g:.0f}"
    return (f"{text} ({p:.0f}%)" if p is not None else text) + _busy(r)


def _us(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    return f"{s * 1e6:.0f} us" if s < 1e-2 else f"{s * 1e3:.1f} ms"


def _ms(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.2f} s"


class Table:
    """Headers + rows, rendered as aligned text or as Markdown."""

    def __init__(self, title: str, headers: Sequence[str], rows: list[list[str]], note: str = "") -> None:
        self.title, self.headers, self.rows, self.note = title, list(headers), rows, note

    def text(self) -> str:
        widths = [max(len(str(x)) for x in col) for col in zip(self.headers, *self.rows, strict=True)]
        line = "  ".join("-" * w for w in widths)
        out = [self.title, "  ".join(h.ljust(w) for h, w in zip(self.headers, widths, strict=True)), line]
        out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in self.rows]
        if self.note:
            out.append(self.note)
        return "\n".join(out)

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |",
               "|" + "|".join("---" for _ in self.headers) + "|"]
        out += ["| " + " | ".join(str(c) for c in r) + " |" for r in self.rows]
        if self.note:
            out += ["", self.note]
        return "\n".join(out)


def _systems(rows: list[dict[str, Any]]) -> list[str]:
    def key(s: str) -> tuple[int, str]:
        order = 0 if s.startswith("kvtransport/") else 1 if s.startswith("torch.") else 2
        return order, s

    return sorted({r["system"] for r in rows}, key=key)


def _find(rows: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    return [r for r in rows if pred(r)]


def _headline(rows: list[dict[str, Any]]) -> tuple[str, int, str] | None:
    kv = [r for r in rows if r.get("workload") == "kv"]
    keys = {(r["case"]["preset"], r["case"]["tokens"], r["case"]["ids"]) for r in kv}
    if HEADLINE in keys:
        return HEADLINE
    if not keys:
        return None
    rnd = sorted((k for k in keys if k[2] == "random"), key=lambda k: (k[0] != HEADLINE[0], -k[1]))
    return rnd[0] if rnd else sorted(keys)[0]


def _kv_row(rows: list[dict[str, Any]], system: str, key: tuple[str, int, str], coalesce: bool | None) -> dict[str, Any] | None:
    for r in rows:
        c = r.get("case", {})
        if (r["system"] == system and r.get("workload") == "kv" and (c.get("preset"), c.get("tokens"), c.get("ids")) == key
                and (c.get("coalesce") in (coalesce, None))):
            return r
    return None


def summary_table(result: dict[str, Any]) -> Table:
    """Systems x workloads: the headline figure of each workload, GB/s (% of the ceiling)."""
    rows = result["rows"]
    head = _headline(rows)
    out = []
    for s in _systems(rows):
        mine = [r for r in rows if r["system"] == s]
        sw = [r for r in mine if r.get("workload") == "sweep" and r.get("gbps") is not None]
        peak = max(sw, key=lambda r: r["gbps"], default=None)
        small = min(sw, key=lambda r: r["bytes"], default=None)
        kv_on = [r for r in mine if r.get("workload") == "kv" and r["case"].get("coalesce") in (True, None)]
        pcts = [r["pct_of_ceiling"] for r in kv_on if r.get("pct_of_ceiling") is not None]
        speedups = []
        for r in mine:
            c = r.get("case", {})
            if r.get("workload") == "kv" and c.get("coalesce") is True:
                off = _kv_row([x for x in mine if x["case"].get("coalesce") is False], s,
                              (c["preset"], c["tokens"], c["ids"]), False)
                if off and off.get("gbps"):
                    speedups.append(r["gbps"] / off["gbps"])
        ov = [r["exposed_pct"] for r in mine if r.get("workload") == "overlap" and r.get("exposed_pct") is not None]
        lat = next((r for r in mine if r.get("workload") == "latency"), None)
        out.append([
            s,
            f"{_cell(peak)} @ {fmt_bytes(peak['bytes'])}" if peak else "-",
            _us(small["median_s"]) + f" @ {fmt_bytes(small['bytes'])}" if small else "-",
            _cell(_kv_row(rows, s, head, True)) if head else "-",
            f"{statistics.median(pcts):.0f}%" if pcts else "-",
            f"{statistics.median(speedups):.2f}x" if speedups else "-",
            f"{statistics.median(ov):.1f}%" if ov else "-",
            f"{_us(lat['median_s'])} / {_us(lat['p99_s'])}" if lat else "-",
        ])
    if head:
        ceil = next((r.get("ceiling_gbps") for r in rows if r.get("workload") == "kv"
                     and (r["case"]["preset"], r["case"]["tokens"], r["case"]["ids"]) == head), None)
        what = "memcpy" if result.get("machine", {}).get("device") == "cpu" else "GPU0->GPU1 copy"
        out.append([f"ceiling ({what})", "", "", f"{ceil:.3g}" if ceil else "-", "100%", "", "", ""])
    hl = f"kv {head[0]} {fmt_tokens(head[1])} {head[2]}" if head else "kv headline"
    headers = ["system", "sweep peak GB/s (% ceil)", "sweep small-msg latency", f"{hl} GB/s (%)",
               "kv median % ceil", "coalescing on/off", "overlap exposed %", "signal->wait p50 / p99"]
    note = ("GB/s are decimal (1e9 B/s). % ceil: of one contiguous copy of the same bytes measured in the same run. "
            "kv columns use coalescing on. overlap: transfer time still exposed after the last layer's compute, "
            f"as % of the serialized transfer. *: measured while other work kept the CPUs busy "
            f"(CPU pressure > {BUSY_PSI:.0f}%).")
    return Table("Summary (system x workload)", headers, out, note)


def sweep_table(result: dict[str, Any]) -> Table | None:
    rows = [r for r in result["rows"] if r.get("workload") == "sweep"]
    if not rows:
        return None
    systems = _systems(rows)
    sizes = sorted({r["bytes"] for r in rows})
    by = {(r["system"], r["bytes"]): r for r in rows}
    ceil = result.get("ceiling", {}).get("by_size", {})
    out = []
    for s in sizes:
        c = ceil.get(str(s), {}).get("gbps")
        line = [fmt_bytes(s), f"{c:.3g}" if c else "-"]
        for sy in systems:
            r = by.get((sy, s))
            line.append(_cell(r) + (f", {_us(r['median_s'])}" if r and s <= 256 * 1024 else ""))
        out.append(line)
    return Table("1. Message sweep: one contiguous put, GB/s (% of ceiling)[, median time for small sizes]",
                 ["size", "ceiling GB/s", *systems], out)


def kv_table(result: dict[str, Any]) -> Table | None:
    rows = [r for r in result["rows"] if r.get("workload") == "kv"]
    if not rows:
        return None
    systems = _systems(rows)
    cols: list[tuple[str, bool | None]] = []
    for s in systems:
        if s.startswith("kvtransport/"):
            cols += [(s, True), (s, False)]
        else:
            cols.append((s, None))
    keys = sorted({(r["case"]["preset"], r["case"]["tokens"], r["case"]["ids"]) for r in rows},
                  key=lambda k: (k[0], k[1], ["contiguous", "runs8", "random"].index(k[2]) if k[2] in ("contiguous", "runs8", "random") else 9))
    out = []
    for key in keys:
        any_row = next(r for r in rows if (r["case"]["preset"], r["case"]["tokens"], r["case"]["ids"]) == key)
        runs = next((r.get("runs_per_layer") for r in rows if (r["case"]["preset"], r["case"]["tokens"], r["case"]["ids"]) == key
                     and r.get("runs_per_layer") is not None), None)
        line = [key[0], fmt_tokens(key[1]), key[2], fmt_bytes(any_row["bytes"]), str(runs) if runs is not None else "-",
                f"{any_row.get('ceiling_gbps', float('nan')):.3g}"]
        for s, coal in cols:
            line.append(_cell(_kv_row(rows, s, key, coal) if coal is not None else _kv_row(rows, s, key, None)))
        out.append(line)
    headers = ["preset", "tokens", "ids", "bytes", "runs/layer", "ceiling GB/s"]
    headers += [f"{s} {'on' if c else 'off'}" if c is not None else s for s, c in cols]
    apis = sorted({r["case"].get("api", "put_layer") for r in rows if r["system"].startswith("kvtransport/")})
    how = {"put_layers": "one put_layers call per request", "put_layer": "one put_layer call per layer"}
    return Table("2. KV requests: GB/s (% of ceiling); kvtransport with coalescing on / off", headers, out,
                 "runs/layer: contiguous runs per layer after coalescing (blocks per layer when off). "
                 f"kvtransport issues {' / '.join(how.get(a, a) for a in apis) or '-'} (--kv-api), then signals once. "
                 "Raw send/recv moves the same byte count as one buffer (no gather/scatter).")


def overlap_table(result: dict[str, Any]) -> Table | None:
    rows = [r for r in result["rows"] if r.get("workload") == "overlap"]
    if not rows:
        return None
    out = []
    for r in sorted(rows, key=lambda r: (r["system"], r["case"]["preset"], r["case"]["tokens"])):
        out.append([r["system"], r["case"]["preset"], fmt_tokens(r["case"]["tokens"]), fmt_bytes(r["bytes"]),
                    f"{r['num_layers']} x {_ms(r['compute_s_per_layer'])}", _ms(r["serialized_s"]),
                    _ms(r["exposed_s"]), f"{r['exposed_pct']:.1f}%{_busy(r)}"])
    return Table("3. Layer-wise overlap (random block ids): transfer exposed after the last layer's compute",
                 ["system", "preset", "tokens", "bytes", "compute/layer", "serialized transfer", "exposed (median)",
                  "exposed %"], out,
                 "compute/layer: " + "; ".join(sorted({str(r.get("compute_note", "")) for r in rows})))


def latency_table(result: dict[str, Any]) -> Table | None:
    rows = [r for r in result["rows"] if r.get("workload") == "latency"]
    if not rows:
        return None
    out = [[r["system"], r["case"]["preset"], str(r["case"]["seqs"]), fmt_bytes(r["bytes"]), _us(r["median_s"]) + _busy(r),
            _us(r["p99_s"]), _us(r.get("request_median_s"))] for r in rows]
    return Table("4. Completion latency: signal -> receiver's wait returns (one-block sequences)",
                 ["system", "preset", "sequences", "request bytes", "median", "p99", "whole request (median)"], out,
                 "The sender flushes the sequence's puts before stamping and signalling, so the figure is the "
                 "completion path alone; 'whole request' runs from the first put.")


def skipped_table(result: dict[str, Any]) -> Table | None:
    skips = result.get("skipped") or []
    errs = result.get("errors") or []
    if not skips and not errs:
        return None
    out = [[s["workload"], s["what"], s["reason"]] for s in skips]
    out += [[e["workload"], e["system"], "ERROR: " + e["error"].strip().splitlines()[-1][:200]] for e in errs]
    return Table("Skipped / failed", ["workload", "what", "why"], out)


TCP_STREAM = "tcp stream"
"""The raw TCP stream baseline of ``bench --netns`` (runner.TCP_STREAM)."""


def netns_table(result: dict[str, Any]) -> Table | None:
    """``bench --netns``: each KV request and sweep size against the raw TCP stream of the same bytes over the
    same veth, measured in the same run (the figure the TCP backends are judged by)."""
    rows = [r for r in result["rows"] if r.get("workload") in ("kv", "sweep") and r.get("gbps")]
    tcp = {r["bytes"]: r for r in rows if r["system"] == TCP_STREAM}
    if not tcp:
        return None
    systems = [s for s in _systems(rows) if s != TCP_STREAM]
    out = []
    for r in sorted((r for r in rows if r["system"] == TCP_STREAM and r["workload"] == "kv"),
                    key=lambda r: (r["case"]["preset"], r["case"]["tokens"], str(r["case"]["ids"]))):
        key = (r["case"]["preset"], r["case"]["tokens"], r["case"]["ids"])
        line = [f"kv {key[0]} {fmt_tokens(key[1])} {key[2]}", fmt_bytes(r["bytes"]), f"{r['gbps']:.3g}{_busy(r)}"]
        for s in systems:
            mine = _kv_row(rows, s, key, True if s.startswith("kvtransport/") else None)
            line.append(f"{mine['gbps']:.3g} ({100 * mine['gbps'] / r['gbps']:.0f}%){_busy(mine)}" if mine else "-")
        out.append(line)
    hosts = result.get("netns") or {}
    where = ", ".join(f"{role} {h.get('ifname')} {h.get('address')}" for role, h in sorted(hosts.items()))
    return Table("Between two hosts (network namespaces, one veth pair): GB/s (% of the raw TCP stream of the "
                 "same bytes)", ["request", "bytes", "tcp stream GB/s", *systems], out,
                 f"{where}. kvtransport rows with coalescing on; the TCP stream and raw send/recv move the bytes "
                 "as one buffer (no gather/scatter).")


def tables(result: dict[str, Any]) -> list[Table]:
    """Every table of a result, summary first."""
    found = [summary_table(result), netns_table(result), sweep_table(result), kv_table(result), overlap_table(result),
             latency_table(result), skipped_table(result)]
    return [t for t in found if t is not None]


# ====================================================================== plots
def spread(row: dict[str, Any], scale: float, key: str = "samples_s") -> tuple[float, float]:
    """(low, high) of ``scale / t`` over the row's timed samples ``t`` (e.g. ``scale`` = bytes: GB/s x 1e9):
    the whiskers of a rate. Falls back to the row's ``min_s``/``max_s``; NaNs when it has neither."""
    times = [float(t) for t in (row.get(key) or []) if t and float(t) > 0]
    if not times and row.get("min_s") and row.get("max_s"):
        times = [float(row["min_s"]), float(row["max_s"])]
    if not times:
        return float("nan"), float("nan")
    return scale / max(times), scale / min(times)


def _whiskers(centers: Sequence[float], bounds: Sequence[tuple[float, float]]) -> list[list[float]]:
    """matplotlib's ``yerr`` (distances below and above each center) from (low, high) bounds; 0 where unknown."""
    below = [c - lo if math.isfinite(lo) else 0.0 for c, (lo, _) in zip(centers, bounds, strict=True)]
    above = [hi - c if math.isfinite(hi) else 0.0 for c, (_, hi) in zip(centers, bounds, strict=True)]
    return [[max(0.0, b) for b in below], [max(0.0, a) for a in above]]


def plots(result: dict[str, Any], out: str) -> list[str]:
    """Write PNGs (bandwidth vs size; exposed latency vs prompt length; KV requests); returns their paths.

    Every point or bar is the median of its repetitions with whiskers from the fastest to the slowest one;
    panels that are compared share their y axis; legends sit outside the data. Raises ImportError when
    matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    files = []
    rows = result["rows"]
    when = result.get("machine", {}).get("date", "")[:10]
    dev = result.get("machine", {}).get("device", "")
    whisker = "whiskers: fastest..slowest"
    sw = [r for r in rows if r.get("workload") == "sweep" and r.get("gbps")]
    if sw:
        fig, ax = plt.subplots(figsize=(9, 5), dpi=100, layout="constrained")
        for s in _systems(sw):
            mine = sorted((r for r in sw if r["system"] == s), key=lambda r: r["bytes"])
            xs, ys = [r["bytes"] for r in mine], [r["gbps"] for r in mine]
            bounds = [(lo / 1e9, hi / 1e9) for lo, hi in (spread(r, r["bytes"]) for r in mine)]
            ax.errorbar(xs, ys, yerr=_whiskers(ys, bounds), marker="o", ms=3, capsize=2, elinewidth=0.8, label=s)
        ceil = sorted((int(k), v["gbps"]) for k, v in result.get("ceiling", {}).get("by_size", {}).items()
                      if int(k) in {r["bytes"] for r in sw})
        if ceil:
            ax.plot([c[0] for c in ceil], [c[1] for c in ceil], "k--", lw=1,
                    label=f"ceiling: {result['ceiling']['method'].split(' (')[0]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r["bytes"] for r in sw})
        ax.set_xticks(ticks, [fmt_bytes(t).replace(" ", "") for t in ticks], rotation=45, fontsize=7)
        ax.yaxis.set_major_formatter(FuncFormatter(_tick))
        ax.set_xlabel("message size (one contiguous put)")
        ax.set_ylabel("GB/s (median; " + whisker + ")")
        ax.set_title(f"Bandwidth vs message size ({dev}, {when})")
        ax.grid(True, which="both", alpha=0.3)
        fig.legend(loc="outside right upper", fontsize=8)
        files.append(_save(fig, out, "bandwidth_vs_size.png"))
        plt.close(fig)
    ov = [r for r in rows if r.get("workload") == "overlap"]
    if ov:
        systems = _systems(ov)
        fig, axes = plt.subplots(1, len(systems), figsize=(5 * len(systems) + 2.5, 4.5), dpi=100, squeeze=False,
                                 sharey=True, layout="constrained")
        for ax, s in zip(axes[0], systems, strict=True):
            mine = [r for r in ov if r["system"] == s]
            for i, preset in enumerate(sorted({r["case"]["preset"] for r in mine})):
                pts = sorted((r for r in mine if r["case"]["preset"] == preset), key=lambda r: r["case"]["tokens"])
                xs = [r["case"]["tokens"] for r in pts]
                for key, samples, style in (("exposed", "samples_exposed_s", "-o"),
                                            ("serialized", "samples_serialized_s", "--x")):
                    ys = [r[f"{key}_s"] * 1e3 for r in pts]
                    bounds = [_ms_bounds(r.get(samples)) for r in pts]
                    ax.errorbar(xs, ys, yerr=_whiskers(ys, bounds), fmt=style, color=f"C{i}", ms=4, capsize=2,
                                elinewidth=0.8, label=f"{preset} {key}" if ax is axes[0][0] else None)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({r["case"]["tokens"] for r in mine})
            ax.set_xticks(ticks, [fmt_tokens(t) for t in ticks])
            ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.5)
            ax.yaxis.set_major_formatter(FuncFormatter(_tick))
            ax.yaxis.set_minor_formatter(FuncFormatter(_minor_tick))
            ax.set_xlabel("prompt tokens")
            ax.set_title(f"{s}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("ms (median; " + whisker + ")")
        fig.legend(loc="outside right upper", fontsize=7)
        fig.suptitle(f"Layer-wise push: transfer exposed after the last layer vs serialized ({dev}, {when})",
                     fontsize=11)
        files.append(_save(fig, out, "exposed_vs_prompt.png"))
        plt.close(fig)
    kv = [r for r in rows if r.get("workload") == "kv" and r.get("pct_of_ceiling") is not None]
    if kv:
        presets = sorted({r["case"]["preset"] for r in kv})
        ncol = 2 if len(presets) > 1 else 1
        nrow = -(-len(presets) // ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(7 * ncol, 3.6 * nrow + 1.0), dpi=100, squeeze=False,
                                 sharey=True, layout="constrained")
        series: list[tuple[str, bool | None]] = []
        for s in _systems(kv):
            series += [(s, True), (s, False)] if s.startswith("kvtransport/") else [(s, None)]
        palette: Any = getattr(plt.get_cmap("tab20"), "colors", [f"C{i // 2}" for i in range(20)])  # pairs: dark (coalescing on) / light (off) of one hue
        colors: list[Any] = []
        hue = 0
        for _, coal in series:
            colors.append(palette[(2 * hue + (1 if coal is False else 0)) % 20])
            hue += 0 if coal is True else 1
        width = 0.8 / max(1, len(series))
        for n, (ax, preset) in enumerate(zip(axes.flat, presets, strict=False)):
            keys = sorted({(r["case"]["tokens"], r["case"]["ids"]) for r in kv if r["case"]["preset"] == preset},
                          key=lambda k: (k[0], ["contiguous", "runs8", "random"].index(k[1])))
            for j, (s, coal) in enumerate(series):
                vals, bounds = [], []
                for t, ids in keys:
                    r = _kv_row(kv, s, (preset, t, ids), coal)
                    pct = r["pct_of_ceiling"] if r else 0.0
                    vals.append(pct)
                    # a sample's % of the ceiling scales as 1 / its time: pct x median / t
                    bounds.append(spread(r, pct * r["median_s"]) if r and r.get("median_s") else (pct, pct))
                label = s + ("" if coal is None else " on" if coal else " off")
                ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(keys))], vals, width,
                       label=label if n == 0 else None, color=colors[j], yerr=_whiskers(vals, bounds),
                       error_kw={"elinewidth": 0.8, "capsize": 1.5})
            ax.set_xticks(range(len(keys)), [f"{fmt_tokens(t)}\n{ids}" for t, ids in keys], fontsize=7)
            ax.set_ylabel("% of ceiling (median; " + whisker + ")", fontsize=8)
            ax.set_title(preset, fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
        for ax in list(axes.flat)[len(presets):]:
            ax.axis("off")
        fig.legend(loc="outside lower center", ncol=min(4, len(series)), fontsize=7)
        fig.suptitle(f"KV requests: % of the contiguous-copy ceiling ({dev}, {when})", fontsize=11)
        files.append(_save(fig, out, "kv_requests.png"))
        plt.close(fig)
    return files


def _ms_bounds(samples: Any) -> tuple[float, float]:
    """(fastest, slowest) of a list of seconds, in ms; NaNs when empty."""
    xs = [float(x) for x in (samples or []) if x is not None]
    return (min(xs) * 1e3, max(xs) * 1e3) if xs else (float("nan"), float("nan"))


def _tick(v: float, _: Any) -> str:
    return f"{v:g}"


def _minor_tick(v: float, _: Any) -> str:
    """Label the 2x and 5x minor ticks of a log axis (ranges narrower than a decade get labels)."""
    return f"{v:g}" if f"{v:.0e}"[0] in "25" else ""


def _save(fig: Any, out: str, name: str) -> str:
    path = os.path.join(out, name)
    fig.savefig(path)
    return path


# ====================================================================== everything
def render(result: dict[str, Any], out: str, *, write_json: bool = True) -> list[str]:
    """Print the tables, write table.txt/table.md, the plots and (unless re-rendering) results.json."""
    files = []
    ts = tables(result)
    text = "\n\n".join(t.text() for t in ts)
    print("\n" + text, flush=True)
    for name, body in (("table.txt", text), ("table.md", "\n\n".join(t.markdown() for t in ts))):
        path = os.path.join(out, name)
        with open(path, "w") as f:
            f.write(body + "\n")
        files.append(path)
    try:
        pngs = plots(result, out)
        result["plots"] = [os.path.basename(p) for p in pngs]
        files += pngs
    except ImportError as exc:
        result["plots"] = f"skipped: matplotlib not importable ({exc}); pip install 'kvtransport[bench]'"
        print(result["plots"], flush=True)
    if write_json:
        path = os.path.join(out, "results.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=_json_default)
        files.insert(0, path)
    return files


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, set | tuple):
        return list(x)
    return str(x)
