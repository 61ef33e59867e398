"""``kvtransport`` command line: ``demo`` (main job), ``backends``, ``doctor``."""

from __future__ import annotations

import argparse
import sys


def _backends(_: list[str]) -> int:
    from . import available_backends

    for row in available_backends():
        print(row)
    return 0


def _doctor(argv: list[str]) -> int:
    from .doctor import run

    return run(argv)


def _demo(argv: list[str]) -> int:
    from .demo import run

    return run(argv)


def _bench(argv: list[str]) -> int:
    from .bench import run

    return run(argv)


COMMANDS = {"demo": _demo, "backends": _backends, "doctor": _doctor, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="kvtransport", description="KV-cache transport for disaggregated serving")
    ap.add_argument("command", choices=sorted(COMMANDS), help="demo: transfer a vLLM-shaped KV request between "
                    "two local processes and report GB/s; backends: list backends; doctor: preflight checks")
    if not argv or argv[0] in ("-h", "--help"):
        ap.print_help()
        return 0 if argv else 2
    args, _ = ap.parse_known_args(argv[:1])
    return COMMANDS[args.command](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
