"""Backend registry: entry points of the group ``kvtransport.backends`` (built-in and third-party alike)."""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata

from .backend import Availability, BackendSpec
from .errors import BackendUnavailable, UnknownBackend

GROUP = "kvtransport.backends"

KNOWN_BACKENDS = {
    "nccl": "pip install ./backends/nccl   (torch.distributed: NCCL for CUDA memory, gloo for host memory)",
    "ucx": "pip install ./backends/ucx     (UCX one-sided puts; pulls ucxx-cu12 / libucx wheels)",
    "mscclpp": "build MSCCL++ from upstream source, then pip install ./backends/mscclpp (backends/mscclpp/README.md)",
}
"""Install hints for the project's own backends, shown when they are missing."""


@dataclass(frozen=True)
class BackendInfo:
    """One row of :func:`available_backends`."""

    name: str
    installed: bool
    available: bool
    reason: str
    priority: int
    install_hint: str

    def __str__(self) -> str:
        state = "available" if self.available else ("unavailable" if self.installed else "not installed")
        tail = f": {self.reason}" if self.reason else ""
        return f"{self.name:<9} {state}{tail}"


@functools.cache
def _specs() -> dict[str, BackendSpec]:
    specs: dict[str, BackendSpec] = {}
    for ep in metadata.entry_points(group=GROUP):
        try:
            spec = ep.load()
        except Exception as exc:  # a broken plugin must not break the others
            specs[ep.name] = _BrokenSpec(ep.name, f"entry point {ep.value} failed to load: {exc}")
            continue
        specs[ep.name] = spec
    return specs


def specs() -> dict[str, BackendSpec]:
    """Registered backend specs by name (loaded once per process)."""
    return dict(_specs())


def get_spec(name: str) -> BackendSpec:
    """The spec for ``name`` (test-only backends included); raises UnknownBackend naming the installed
    backends and how to get the missing one."""
    all_specs = _specs()
    if name in all_specs:
        return all_specs[name]
    installed = ", ".join(sorted(n for n, s in all_specs.items() if not s.test_only)) or "none"
    hint = KNOWN_BACKENDS.get(name)
    msg = f"backend {name!r} is not installed (installed: {installed})"
    if hint:
        raise UnknownBackend(msg, fix=f"to install it: {hint}")
    close = difflib.get_close_matches(name, [*all_specs, *KNOWN_BACKENDS], n=1)
    raise UnknownBackend(msg + (f"; did you mean {close[0]!r}?" if close else ""))


@functools.cache
def probe(name: str) -> Availability:
    """Cached :meth:`BackendSpec.probe` of a registered backend."""
    try:
        return get_spec(name).probe()
    except Exception as exc:  # probe must never raise; be defensive about third-party code
        return Availability(False, f"probe failed: {exc}")


def available_backends(include_test_only: bool = False) -> list[BackendInfo]:
    """Every registered backend (usable or not, with the reason) plus known ones that are not installed.
    Test-only backends (``BackendSpec.test_only``, e.g. ``inproc``) only with ``include_test_only``."""
    rows = []
    all_specs = _specs()
    for name, spec in sorted(all_specs.items()):
        if spec.test_only and not include_test_only:
            continue
        av = probe(name)
        rows.append(BackendInfo(name, True, av.ok, av.reason, spec.priority, spec.install_hint))
    for name, hint in KNOWN_BACKENDS.items():
        if name not in all_specs:
            rows.append(BackendInfo(name, False, False, f"not installed; {hint}", -1, hint))
    return rows


def choose(name: str, memory_kind: str) -> BackendSpec:
    """Resolve ``auto`` or a name to a usable spec for ``memory_kind``; raises a typed error with the fix."""
    if name != "auto":
        spec = get_spec(name)
        av = probe(name)
        if not av.ok:
            raise BackendUnavailable(f"backend {name!r} cannot run here: {av.reason}")
        if memory_kind not in spec.memory_kinds:
            raise BackendUnavailable(
                f"backend {name!r} cannot move {memory_kind} memory (it supports {sorted(spec.memory_kinds)})",
                fix="pick another with --backend, backend= or KV_TRANSPORT (`kvtransport backends` lists them)",
            )
        return spec
    candidates = sorted((s for s in _specs().values()
                         if s.auto_select and not s.test_only and memory_kind in s.memory_kinds),
                        key=lambda s: (s.priority, s.name), reverse=True)
    for spec in candidates:  # best first; probing stops at the first usable one (a probe may import torch)
        if probe(spec.name).ok:
            return spec
    rows = "; ".join(str(r) for r in available_backends())
    raise BackendUnavailable(f"no usable backend for {memory_kind} memory. Backends: {rows}")


def check_options(spec: BackendSpec, names: Iterable[str]) -> None:
    """Refuse keyword options of ``open()`` that are neither core options nor declared by ``spec`` (see
    ``BackendSpec.options``), naming the closest valid one. Undeclared (None): the backend checks them."""
    from .config import CORE_OPTIONS, unknown_option

    if spec.options is None:
        return
    for name in sorted(names):
        if name not in spec.options:
            raise unknown_option(name, (*CORE_OPTIONS, "backend", "ifname", *spec.options),
                                 f"kvtransport.open() with backend {spec.name}")


class _BrokenSpec(BackendSpec):
    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        self.auto_select = False

    def probe(self) -> Availability:
        return Availability(False, self.reason)

    def create(self, layout, settings):  # type: ignore[no-untyped-def]
        raise BackendUnavailable(self.reason)
