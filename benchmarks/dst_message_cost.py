"""A decode's destination message (``dst``) on the side channel: encode, then parse and check, as both
schedulers do per request. Protocol 5 sends block ids packed (u32 after a JSON header, read into ``array('I')``);
the baseline is protocol 4's JSON list of numbers (encode, guard, ``json.loads``, check), measured in the same
run with the same messages. The packed message is parsed from memory by the same parser that reads it off the
socket (``protocol._recv_packed``, fed by a buffer instead of ``recv_into``).

    python benchmarks/dst_message_cost.py [--repeat 2000]

Block counts: 128 (a 2,048-token prompt at block size 16: what the TTFT benchmark sends), 2,048 and 65,536
(a 1M-token context). Reported: median microseconds per message and the ratio packed / JSON. Needs
kvtransport-vllm only (no vLLM, no GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def json_baseline(msg: dict[str, Any]) -> None:
    """Protocol 4's round trip: JSON numbers, guarded, parsed, every id checked into a new list."""
    from kvtransport_vllm import protocol as proto

    raw = json.dumps(msg, separators=(",", ":")).encode()
    if raw.count(b"{") + raw.count(b"[") > proto.MAX_CONTAINERS or raw.count(b'"') > proto.MAX_STRINGS:
        raise AssertionError("guard")
    parsed = json.loads(raw)
    for d in parsed["dsts"]:
        d["blocks"] = [b for b in d["blocks"] if not isinstance(b, bool) and isinstance(b, int) and 0 <= b < 1 << 40]


def packed(msg: dict[str, Any]) -> None:
    from kvtransport_vllm import protocol as proto

    proto.check_message(proto.parse_message(proto.encode_message(msg)[4:]))


def median_us(fn: Any, msg: dict[str, Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(msg)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2000)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = ap.parse_args(argv)
    rows = []
    for blocks in (128, 2048, 65536):
        msg = {"type": "dst", "xfer": "0f" * 16, "mode": "push",
               "dsts": [{"seq": "cmpl-" + "a" * 32, "blocks": list(range(7_000, 7_000 + blocks)), "offset": 0}]}
        repeat = max(20, args.repeat * 128 // blocks)
        base, new = median_us(json_baseline, msg, repeat), median_us(packed, msg, repeat)
        rows.append({"blocks": blocks, "json_us": round(base, 1), "packed_us": round(new, 1),
                     "ratio": round(new / base, 3)})
    if args.json:
        print(json.dumps({"benchmark": "dst_message_cost", "rows": rows}))
        return
    print(f"{'blocks':>7} {'JSON (protocol 4) us':>21} {'packed (5) us':>14} {'packed / JSON':>14}")
    for r in rows:
        print(f"{r['blocks']:>7} {r['json_us']:>21} {r['packed_us']:>14} {r['ratio']:>14}")


if __name__ == "__main__":
    main()
