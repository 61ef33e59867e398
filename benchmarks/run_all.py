"""Run every kvtransport benchmark: the same as ``kvtransport bench`` (all arguments are passed through).

    python benchmarks/run_all.py --out bench-out            # full run on this machine's default device
    python benchmarks/run_all.py --smoke --out /tmp/smoke   # tiny version of every workload
    python benchmarks/run_all.py --device cuda              # GPU host: sender cuda:0, receiver cuda:1
"""

from __future__ import annotations

import sys

from kvtransport.bench import run

if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
