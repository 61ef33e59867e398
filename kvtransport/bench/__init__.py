"""``kvtransport bench``: every available backend against the link's ceiling, on real KV shapes.

Workloads (each through the public API, sender and receiver in two spawned processes):

1. ``sweep``: one contiguous put of 4 KiB .. 1 GiB (bandwidth; latency for small sizes).
2. ``kv``: real KV requests (model presets x prompt tokens x block-id pattern), coalescing on and off.
3. ``overlap``: a synthetic layer-by-layer prefill; transfer time still exposed after the last layer vs
   the serialized transfer.
4. ``latency``: ``signal`` -> the receiver's ``wait`` returning, one-block sequences.

Baselines measured in the same run: the ceiling (memcpy on CPU; GPU0->GPU1 copy on CUDA), raw
``torch.distributed`` send/recv (gloo / NCCL) of the same bytes, and NIXL when ``import nixl`` works.

Importing this package is cheap; numpy, torch and matplotlib load inside the functions that need them.
"""

from __future__ import annotations


def run(argv: list[str] | None = None) -> int:
    """Entry point of ``kvtransport bench`` (see ``kvtransport bench --help``); returns the exit status."""
    from .runner import main

    return main(argv)


__all__ = ["run"]
