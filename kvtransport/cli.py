"""The ``kvtransport`` command: ``demo`` (the main job), ``backends``, ``doctor``, ``bench``.

A kvtransport error (bad backend, interface, setting; also one raised inside the demo's or bench's child
processes) is printed as one line, plus a ``fix:`` line when the error carries one, and the command exits
with 2 (a ConfigurationError) or 1 (any other KVTransportError). ``--debug`` prints the traceback as well.
Anything else (a bug) keeps Python's traceback.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable

from . import __version__
from .errors import ConfigurationError, KVTransportError


def _backends(argv: list[str]) -> int:
    from . import available_backends

    ap = argparse.ArgumentParser(prog="kvtransport backends", description=COMMANDS["backends"][0])
    ap.add_argument("--all", action="store_true", help="also list test-only backends (inproc)")
    ap.add_argument("--require", metavar="NAMES", default="",
                    help="comma-separated backends that must be usable here: exit 1 naming those that are not "
                         "(CI runs it before the tests, so a broken install cannot pass as skipped tests)")
    args = ap.parse_args(argv)
    for row in available_backends(include_test_only=args.all):
        print(row)
    rows = available_backends(include_test_only=True)
    required = [n.strip() for n in args.require.split(",") if n.strip()]
    usable = {r.name for r in rows if r.available}
    missing = [n for n in required if n not in usable]
    if missing:
        why = {r.name: r.reason for r in rows}
        for name in missing:
            print(f"kvtransport backends: required backend {name} is not usable here: "
                  f"{why.get(name) or 'not installed'}", file=sys.stderr)
        return 1
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


COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "demo": ("move a vLLM-shaped KV request (Llama-3.1-8B, 2k tokens) between two local processes, verify it "
             "byte for byte, and report GB/s next to a copy ceiling measured in the same run", _demo),
    "backends": ("list the backends: installed, usable here, or why not", _backends),
    "doctor": ("check this machine (backends, NET_IFNAME, memlock and RDMA where relevant, CUDA) and print the "
               "fix for each problem; exit 1 if a check failed", _doctor),
    "bench": ("benchmark every usable backend against the copy ceiling, raw torch.distributed and NIXL on real KV "
              "shapes; writes results.json, tables and plots (minutes; --smoke for a quick run)", _bench),
}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvtransport", description="KV-cache transport for disaggregated (prefill/decode) LLM serving.",
        epilog="`kvtransport COMMAND --help` lists a command's options. Errors print one line and their fix "
               "(exit 2: configuration, 1: other); --debug adds the traceback.")
    ap.add_argument("--version", action="version", version=f"kvtransport {__version__}")
    ap.add_argument("--debug", action="store_true", help="print the traceback of an error, not only its line")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (text, _) in COMMANDS.items():
        sub.add_parser(name, help=text, description=text, add_help=False)
    return ap


def format_error(exc: BaseException, where: str) -> str:
    """The one-line report of ``exc`` (plus its ``fix:`` line, when it has one) for command ``where``.
    A RoleFailed of the test harness is reported as the error its process raised, naming the process."""
    from .workload.harness import HarnessError, RoleFailed

    origin = ""
    if isinstance(exc, RoleFailed) and exc.error is not None:
        origin = f" (in the {exc.role} process)"
        exc = exc.error
    if isinstance(exc, HarnessError):  # a child died, hung or raised something untyped: its last line
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        text = f"{lines[0].rstrip(':')}: {lines[-1].strip()}" if len(lines) > 1 else (lines[0] if lines else "")
        return f"{where}: error: {' '.join(text.split())}\n  (--debug shows the processes' tracebacks)"
    line = f"{where}: error{origin}: {type(exc).__name__}: {' '.join(str(exc).split())}"
    if not isinstance(exc, KVTransportError):  # untyped: most likely a bug, and its traceback is the clue
        return line + "\n  (--debug shows the traceback)"
    return line + (f"\n  fix: {exc.fix}" if exc.fix else "")


def _typed(exc: BaseException) -> bool:
    """Whether ``exc`` gets the one-line report: a KVTransportError, or a child process's failure."""
    from .workload.harness import HarnessError

    return isinstance(exc, KVTransportError | HarnessError)


def exit_code(exc: BaseException) -> int:
    """2 for a ConfigurationError (here or in a child process), 1 for any other reported error."""
    from .workload.harness import RoleFailed

    if isinstance(exc, RoleFailed) and exc.error is not None:
        exc = exc.error
    return 2 if isinstance(exc, ConfigurationError) else 1


def main(argv: list[str] | None = None) -> int:
    """Run ``kvtransport [--debug] COMMAND [options]``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    at = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
    head, command, rest = argv[:at], argv[at:at + 1], argv[at + 1:]
    debug = "--debug" in rest
    rest = [a for a in rest if a != "--debug"]
    ap = _parser()
    args = ap.parse_args(head + command)  # --help, --version, an unknown command: argparse answers and exits
    debug = debug or args.debug
    if args.command is None:
        ap.print_help()
        return 2
    where = f"kvtransport {args.command}"
    try:
        return COMMANDS[args.command][1](rest)
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not _typed(exc):
            raise
        if debug:
            traceback.print_exc()
        print(format_error(exc, where), file=sys.stderr)
        return exit_code(exc)


if __name__ == "__main__":
    raise SystemExit(main())
