"""Re-render the tables and plots of an earlier bench run without measuring anything.

    python benchmarks/render.py bench-out/results.json --out docs/img/cpu

Useful where the run happened on a host without matplotlib: copy results.json here and render.
"""

from __future__ import annotations

import argparse

from kvtransport.bench import run

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="results.json written by kvtransport bench")
    ap.add_argument("--out", default="bench-out", help="directory for table.txt, table.md and the PNGs")
    a = ap.parse_args()
    raise SystemExit(run(["--from-json", a.results, "--out", a.out]))
