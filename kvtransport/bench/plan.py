"""What a bench run measures: sizes, KV request shapes, block-id patterns, repetitions, memory fit.

Pure Python (no numpy/torch): the runner builds the plan, the roles execute pieces of it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

WORKLOADS = ("sweep", "kv", "overlap", "latency")
ID_PATTERNS = ("contiguous", "runs8", "random")
"""Block-id patterns of a KV request: one run; runs of 8 blocks at random places; every block random."""

BLOCK_SIZE = 16  # tokens per block, as in the presets
RUN_LENGTH = 8  # blocks per run in the lightly fragmented pattern

MODEL_SHAPES: dict[str, tuple[int, int]] = {
    # preset -> (hidden size, tensor-parallel degree): the overlap workload's per-layer compute proxy is a
    # matmul [tokens, hidden] @ [hidden, hidden / tp] on the sender's device
    "llama-3.1-8b": (4096, 1),
    "llama-3.1-70b-tp8": (8192, 8),
    "qwen3-8b": (4096, 1),
    "deepseek-v3-mla": (7168, 1),
}
DEFAULT_HIDDEN = (4096, 1)


def fmt_bytes(n: float) -> str:
    """``4 KiB``, ``1.5 MiB``, ``1 GiB``: binary units, at most one decimal."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) or v >= 100 else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def fmt_tokens(t: int) -> str:
    """``128``, ``2k``, ``32k``."""
    return f"{t // 1024}k" if t >= 1024 and t % 1024 == 0 else str(t)


def parse_size(text: str) -> int:
    """``4K``/``4KiB``/``64M``/``1G``/``4096`` -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def parse_tokens(text: str) -> int:
    """``128``/``2k``/``32K`` -> tokens (k = 1024)."""
    s = text.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def sweep_sizes(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` inclusive (4x steps above 1 MiB keep the run short)."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2 if s < MiB else 4
    if out and out[-1] != hi and hi > lo and hi & (hi - 1) == 0:
        out.append(hi)
    return out


def sweep_reps(size: int, smoke: bool, scale: float) -> int:
    """Timed repetitions of one sweep size (more for small, latency-bound sizes)."""
    if smoke:
        return 3
    base = 50 if size <= MiB else 20 if size <= 16 * MiB else 8 if size <= 256 * MiB else 4
    return max(2, round(base * scale))


def kv_reps(nbytes: int, smoke: bool, scale: float) -> int:
    """Timed repetitions of one KV request (after one warm-up)."""
    if smoke:
        return 1
    base = 10 if nbytes <= 64 * MiB else 5 if nbytes <= 512 * MiB else 3
    return max(2, round(base * scale))


@dataclass(frozen=True)
class KVShape:
    """One KV request: preset, prompt tokens and the sender/receiver cache pools it lives in."""

    preset: str
    tokens: int
    num_layers: int
    piece_bytes: int  # one (layer, block) piece, K and V together
    request_blocks: int
    pool_blocks: int  # blocks per layer in each side's cache (the request plus slack for fragmentation)

    @property
    def request_bytes(self) -> int:
        return self.num_layers * self.request_blocks * self.piece_bytes

    @property
    def layer_bytes(self) -> int:
        return self.request_blocks * self.piece_bytes

    @property
    def pool_bytes(self) -> int:
        return self.num_layers * self.pool_blocks * self.piece_bytes

    def pair_bytes(self, staged: bool) -> int:
        """Memory both roles together need: two cache pools, two layers of staging each, and, when the
        backend stages sends (``staged``: two-sided backends gather into buffers held until the send
        completes), a whole request more on the sender."""
        return 2 * self.pool_bytes + 4 * self.layer_bytes + (self.request_bytes if staged else 0)

    def label(self) -> str:
        return f"{self.preset} {fmt_tokens(self.tokens)}"

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "tokens": self.tokens, "num_layers": self.num_layers,
                "piece_bytes": self.piece_bytes, "request_blocks": self.request_blocks,
                "pool_blocks": self.pool_blocks, "request_bytes": self.request_bytes}


def kv_shape(preset: str, tokens: int) -> KVShape:
    """The KVShape of a preset request; pools hold 25% more blocks than the request (at least 16)."""
    from ..workload.caches import PRESETS

    layers, heads, head_dim, itemsize = PRESETS[preset]
    piece = heads * BLOCK_SIZE * 2 * head_dim * itemsize
    n = -(-tokens // BLOCK_SIZE)
    pool = max(n + 16, math.ceil(n * 1.25))
    pool = -(-pool // RUN_LENGTH) * RUN_LENGTH
    return KVShape(preset, tokens, layers, piece, n, pool)


def block_ids(pattern: str, n: int, pool: int, seed: int) -> tuple[list[int], list[int]]:
    """(src, dst) block ids of an ``n``-block request in ``pool``-block caches, per ``pattern``.

    ``contiguous``: one run on both sides. ``runs8``: runs of RUN_LENGTH blocks placed at random, sender
    and receiver independently (the last run may be shorter). ``random``: every block drawn at random.
    Deterministic for a seed."""
    rng = random.Random(f"{pattern}-{n}-{pool}-{seed}")
    if pattern == "contiguous":
        return list(range(n)), list(range(pool - n, pool))
    if pattern == "runs8":
        chunks = -(-n // RUN_LENGTH)
        nchunks = pool // RUN_LENGTH

        def side() -> list[int]:
            picked = rng.sample(range(nchunks), chunks)
            ids = [c * RUN_LENGTH + i for c in picked for i in range(RUN_LENGTH)]
            return ids[:n]

        return side(), side()
    if pattern == "random":
        return rng.sample(range(pool), n), rng.sample(range(pool), n)
    raise ValueError(f"unknown block-id pattern {pattern!r}; choose from {ID_PATTERNS}")


@dataclass
class Skip:
    """A combination the plan leaves out, with the reason (reported in the table and the JSON)."""

    workload: str
    what: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"workload": self.workload, "what": self.what, "reason": self.reason}


@dataclass
class Options:
    """Resolved command-line options of one run."""

    out: str = "bench-out"
    smoke: bool = False
    device: str = "cpu"  # cpu | cuda
    backends: list[str] | None = None  # None: every available one
    workloads: tuple[str, ...] = WORKLOADS
    presets: tuple[str, ...] = tuple(MODEL_SHAPES)
    tokens: tuple[int, ...] = (128, 2048, 32768)
    patterns: tuple[str, ...] = ID_PATTERNS
    min_size: int = 4 * KiB
    max_size: int = GiB
    reps_scale: float = 1.0
    layer_compute_ms: float | None = None  # None: measured matmul
    overlap_budget_s: float = 60.0  # CPU: skip overlap cases whose emulated compute takes longer
    overlap_reps: int = 2
    latency_preset: str = "llama-3.1-8b"
    latency_seqs: int = 200
    mem_fraction: float = 0.6
    timeout: float = 120.0
    seed: int = 0
    nixl: bool = True
    mooncake: bool = True  # Mooncake's transfer engine as a peer (host memory, TCP) when importable
    netns: bool = False  # every pair between two network namespaces joined by a veth pair
    extra: dict[str, Any] = field(default_factory=dict)


def memory_budget(opts: Options) -> tuple[int, str]:
    """Bytes the two roles together may allocate, and where that figure comes from."""
    if opts.device == "cuda":
        import torch

        n = torch.cuda.device_count()
        free = min(torch.cuda.mem_get_info(i)[0] for i in range(min(n, 2)))
        # with two GPUs each role has its own; with one both share it
        total = free * 2 if n > 1 else free
        return int(total * opts.mem_fraction), f"{opts.mem_fraction:.0%} of free GPU memory ({fmt_bytes(total)})"
    avail = _meminfo().get("MemAvailable", 0)
    return int(avail * opts.mem_fraction), f"{opts.mem_fraction:.0%} of MemAvailable ({fmt_bytes(avail)})"


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[-1] == "kB" else 1)
    except OSError:
        pass
    return out


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where unavailable)."""
    return _meminfo()
