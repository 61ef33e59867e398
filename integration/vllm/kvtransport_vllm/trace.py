"""Per-request timelines across the processes of a P/D pair: where a request's time goes, measured.

Off unless ``KV_TRANSPORT_VLLM_TRACE`` names a directory. Then every process of the pair (the proxy, each
engine's scheduler, each worker) appends one JSON line per milestone to ``<dir>/<role>-<pid>.jsonl``:
``{"t": <time.monotonic()>, "ev": <name>, "key": <transfer id or request id>, ...}``. ``time.monotonic`` is one
clock for every process of a host (Linux CLOCK_MONOTONIC), so lines from different processes line up;
``benchmarks/serving.py`` joins them into a breakdown (proxy, intake, forward, binding, signal, decode).

Milestones (``key`` is the proxy's transfer id ``kvt_xfer`` where the process knows it, else the request id;
``req``/``seq`` fields tie a worker's request ids to it):

    proxy.recv            the client's request reached the proxy
    proxy.sent            both legs sent (prefill and decode)
    proxy.prefill_done    the prefill's answer (with the first token) reached the proxy
    proxy.first_out       the first token went out to the client
    proxy.decode_first    the decode's first bytes reached the proxy
    p.new / d.new         the request reached the prefill / decode scheduler
    p.dst                 the prefill scheduler learnt the destination blocks
    w.bind                a prefill worker bound them (``phase``: before / during / after the request's forward)
    p.scheduled           the prefill scheduler scheduled the request's last prompt chunk
    p.finished            the prefill request finished (its first token sampled)
    p.first_sent          the first token was sent to the decode engine(s)
    p.signal              a prefill worker issued the sequence's final signal (``seq``: the decode request)
    d.alloc               the decode allocated the destination blocks (``seq``)
    d.first               the decode scheduler received the first token and appended it (``seq``)
    d.landed              a decode worker saw the sequence's KV land (``seq``)
    d.reported            a decode worker reported it finished to vLLM (``seq``)
    d.scheduled           the decode scheduler scheduled it for its first forward (``seq``)

Writes are line-buffered appends from whichever thread reaches a milestone (a lock per process); each costs a
few microseconds. Nothing here is read by the connector itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any

ENV = "KV_TRANSPORT_VLLM_TRACE"

_lock = threading.Lock()
_out: IO[str] | None = None
_role = ""
_dir: str | None = os.environ.get(ENV) or None


def enabled() -> bool:
    """Whether milestones are recorded in this process (``KV_TRANSPORT_VLLM_TRACE`` set)."""
    return _dir is not None


def configure(directory: str | None, role: str) -> None:
    """Record into ``directory`` (None: stop) as ``role``; the proxy and tests call this, the connector reads
    the environment."""
    global _dir, _out, _role
    with _lock:
        if _out is not None:
            _out.close()
        _dir, _out, _role = directory, None, role


def set_role(role: str) -> None:
    """Name this process's file after its role (``prefill-scheduler``, ``decode-worker0``, ``proxy`` ...)."""
    global _role
    if not _role:
        _role = role


def event(ev: str, key: str, **fields: Any) -> None:
    """Record milestone ``ev`` of transfer or request ``key`` now. Never raises; no-op when tracing is off."""
    if _dir is None:
        return
    t = time.monotonic()
    global _out
    try:
        with _lock:
            if _out is None:
                Path(_dir).mkdir(parents=True, exist_ok=True)
                _out = open(Path(_dir) / f"{_role or 'process'}-{os.getpid()}.jsonl", "a", buffering=1)
            _out.write(json.dumps({"t": t, "ev": ev, "key": str(key), **fields}, separators=(",", ":")) + "\n")
    except (OSError, TypeError, ValueError):
        pass


def load(directory: str | Path) -> list[dict[str, Any]]:
    """Every milestone recorded under ``directory``, ordered by time (for reports and tests)."""
    rows: list[dict[str, Any]] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("t"), (int, float)):
                row["file"] = path.stem
                rows.append(row)
    rows.sort(key=lambda r: r["t"])
    return rows
